"""The fused palette-decode matmul and UnweightLinear.

* ``matmul.fused_vs_plain.*`` (same-kernel exact): ``fused_matmul(x, W in palette form)`` equals, bit
  for bit, ``matmul(x, decode_palette(W))``: the same Triton kernel, tiling, K order and config, fed
  the already-decoded weights. Any decode mistake in the fused tile loader (a wrong nibble, a
  verbatim chunk patched into the wrong columns) changes the bits.
* ``matmul.fused_vs_float64.*`` and ``matmul.linear.*`` (bounded): the result against the float64
  product of the reference decoder's weights, within

      |y - y64| <= 2^-8 |y64| + (K + 1) 2^-23 (|x| @ |W|^T + |b|) + 2^-133   (each element)

  Why: every bf16 x bf16 product is exact in fp32; adding K products (and the bias) in fp32 in any
  order errs by at most (K - 1 + 1) u sum|terms| with u = 2^-24 for round-to-nearest; we allow
  u = 2^-23 to cover tensor cores that truncate during accumulation, and one more term for split-K
  partial sums. The final rounding to bf16 (RNE) adds at most 2^-8 relative (2^-133 absolute in
  bf16's subnormal range). A tile loaded from the wrong place breaks the bound by orders of magnitude.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import numpy as np

from conformance.inputs import Family, encoded, minilm_missing
from conformance.poison import GUARD, PoisonedOutput, embed, embed_form, expected_guards
from conformance.registry import Bound, Case, Gen, Level, register
from reference.synthetic import synthetic_weights

BOUND_TEXT = "|y-y64| <= 2^-8|y64| + (K+1)2^-23(|x||W|^T+|b|)"


def _allowed(inputs: dict[str, Any], ref: np.ndarray) -> np.ndarray:
    x = np.abs(inputs["x64"])
    w = np.abs(inputs["w64"])
    b = np.abs(inputs["b64"]) if inputs["b64"] is not None else 0.0
    k = w.shape[1]
    return 2.0**-8 * np.abs(ref) + (k + 1) * 2.0**-23 * (x @ w.T + b) + 2.0**-133


BOUND = Bound(BOUND_TEXT, _allowed)


def _as_float64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@functools.lru_cache(maxsize=4)
def _synthetic(shape: tuple[int, int], seed: int) -> Any:
    """Weights with MiniLM's exponent distribution, encoded by the reference (palette form)."""
    import reference.codec as rc

    bits = synthetic_weights(shape, np.random.default_rng([seed, zlib.crc32(str(shape).encode())]))
    ct = rc.encode(bits)
    return bits, rc.to_palette(ct)


def _weights(source: str | Family, gen: Gen) -> tuple[np.ndarray, Any]:
    """(bits, reference palette form) of a weight matrix: synthetic 'NxK' or an input family."""
    if isinstance(source, Family):
        e = encoded(source, gen.large, gen.seed)
        return e.bits, e.pt
    n, k = (int(v) for v in source.split("x"))
    return _synthetic((n, k), gen.seed)


def _inputs(source: str | Family, batch: tuple[int, int], bias: bool):
    def make(gen: Gen) -> dict[str, Any]:
        import torch

        from fast.bf16 import from_numpy_bits
        from fast.codec.convert import palette_from_reference
        from reference.bf16 import float32_to_bf16

        bits, pt = _weights(source, gen)
        n, k = bits.shape
        m = gen.size(*batch)
        x = float32_to_bf16(gen.rng.standard_normal((m, k)).astype(np.float32))
        b = float32_to_bf16(gen.rng.standard_normal(n).astype(np.float32)) if bias else None
        return {
            "x": from_numpy_bits(x, gen.device), "form": palette_from_reference(pt, gen.device),
            "bias": from_numpy_bits(b, gen.device) if bias else None, "pt": pt, "device": gen.device,
            "x64": _as_float64(x), "w64": _as_float64(bits), "b64": _as_float64(b) if bias else None,
            "torch": torch,
        }

    return make


def _config(split_k: int):
    """None = the default config; otherwise a small tile config with split-K (works on GPU and interpreter)."""
    if split_k == 0:
        return None
    from fast.codec.matmul import MatmulConfig

    return MatmulConfig(block_m=16, block_n=32, block_k=64, split_k=split_k)


def _fused(split_k: int):
    """The fused kernel with every input amid poison and its output amid NaNs (conformance/poison.py)."""
    def run(inputs: dict[str, Any]) -> Any:
        from fast.codec import matmul

        x, form = inputs["x"], inputs["form"]
        out = PoisonedOutput((x.shape[0], form.shape[0]), x.device)
        y = matmul.fused_matmul(embed(x), embed_form(form), embed(inputs["bias"]), _config(split_k), out=out.view)
        return {"y": y, GUARD: out.guards()}

    return run


def _plain_on_decoded(split_k: int):
    def run(inputs: dict[str, Any]) -> Any:
        from fast.codec import matmul, palette_decode

        w = palette_decode.decode_palette(inputs["form"])
        return {"y": matmul.matmul(inputs["x"], w, inputs["bias"], _config(split_k)), GUARD: expected_guards()}

    return run


def _float64(inputs: dict[str, Any]) -> dict[str, Any]:
    import reference.codec as rc

    w = _as_float64(rc.palette_to_bf16(inputs["pt"]))  # the reference decoder's weights
    y = inputs["x64"] @ w.T
    return {"y": y + inputs["b64"] if inputs["b64"] is not None else y, GUARD: expected_guards()}


def _linear(fused: bool):
    def run(inputs: dict[str, Any]) -> Any:
        from fast.codec.linear import UnweightLinear

        layer = UnweightLinear(inputs["form"], inputs["bias"], fused_max_rows=1 << 30 if fused else 0)
        return {"y": layer(inputs["x"])}

    return run


def _float64_y(inputs: dict[str, Any]) -> dict[str, Any]:
    return {"y": _float64(inputs)["y"]}


def _register_all() -> None:
    from conformance.inputs import FAMILIES

    fam = {f.name: f for f in FAMILIES}
    # (label, weights, (small batch, large batch), bias, split_k (0 = default config), needs MiniLM)
    setups = [
        ("synthetic_96x320.b1", "96x320", (1, 1), False, 0),
        ("synthetic_96x320.b5.split3", "96x320", (5, 16), True, 3),
        ("synthetic_70x200.b33", "70x200", (33, 256), True, 0),
        ("verbatim_rows.b3", fam["verbatim_rows"], (3, 64), True, 2),
        ("many_exponents.b2", fam["many_exponents"], (2, 4), False, 0),
        ("odd_chunks.b4", fam["odd_chunks"], (4, 16), True, 0),
        ("minilm_query.b1", fam["minilm_query"], (1, 1), True, 0),
    ]
    for label, source, batch, bias, split in setups:
        needs = minilm_missing if isinstance(source, Family) and source.needs_minilm else None
        make = _inputs(source, batch, bias)
        register(Case(f"matmul.fused_vs_plain.{label}", Level.SAME_KERNEL, make, _plain_on_decoded(split),
                      _fused(split), about="fused palette matmul vs the same Triton kernel on decoded weights",
                      requires=needs))
        register(Case(f"matmul.fused_vs_float64.{label}", Level.BOUNDED, make, _float64, _fused(split), bound=BOUND,
                      about="fused palette matmul vs the float64 product", requires=needs))
    for label, fused in [("fused_path", True), ("decode_then_matmul", False)]:
        register(Case(f"matmul.linear.{label}", Level.BOUNDED, _inputs("70x200", (6, 64), True), _float64_y,
                      _linear(fused), bound=BOUND, about=f"UnweightLinear ({label}) vs the float64 product"))


_register_all()
