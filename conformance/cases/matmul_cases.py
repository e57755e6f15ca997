"""The fused palette-decode matmul and UnweightLinear: what each group of cases can and cannot catch.

* ``matmul.fused_vs_plain.*`` (same-kernel exact): ``fused_matmul(x, W in palette form)`` equals, bit
  for bit, ``matmul(x, decode_palette(W))``: the same Triton kernel, tiling, K order and config, fed
  the already-decoded weights. Catches: any decode mistake in the fused tile loader
  (``palette_tile``: a wrong nibble, a verbatim chunk patched into the wrong columns). Cannot catch:
  anything both sides share, i.e. the x tile loads, the K loop, the fp32 accumulator, the bias add,
  the split-K reduction and the epilogue's rounding to bf16 (a truncating epilogue passes all of
  them), nor a decode bug shared with ``decode_palette`` (``codec.palette_decode.*`` catches that).
* ``matmul.fused_vs_decoded.*`` (bounded, tight): the fused result against an independently written
  plain matmul: the palette-decode kernel's weights (checked bit-exact against the reference
  decoder by ``codec.palette_decode.*``) multiplied in float64 by NumPy. fp32 accumulation (in any
  order) of the K exact bf16 x bf16 products and the bias errs by at most
  ``E = (K + 1) 2^-23 (|x| @ |W|^T + |b|)``, so a correctly rounded result lies in
  ``[bf16(y64 - E), bf16(y64 + E)]`` (bf16 = round to nearest even, monotonic); where both ends
  round to the same bf16 the result is fixed exactly. Catches what the same-kernel cases share:
  a wrong rounding in the epilogue (truncation: ``tests/test_conformance_mutation.py``), a bias
  added twice or not at all, a dropped K tile or split-K partial. Cannot catch: differences smaller
  than the accumulation slack (an accumulation order, which it deliberately allows).
* ``matmul.fused_vs_float64.*`` and ``matmul.linear.*`` (bounded, loose): the result against the
  float64 product of the reference decoder's weights, within

      |y - y64| <= 2^-8 |y64| + (K + 1) 2^-23 (|x| @ |W|^T + |b|) + 2^-133   (each element)

  Why: every bf16 x bf16 product is exact in fp32; adding K products (and the bias) in fp32 in any
  order errs by at most (K - 1 + 1) u sum|terms| with u = 2^-24 for round-to-nearest; we allow
  u = 2^-23 to cover tensor cores that truncate during accumulation, and one more term for split-K
  partial sums. The final rounding to bf16 (RNE) adds at most 2^-8 relative (2^-133 absolute in
  bf16's subnormal range). Catches: a tile loaded from the wrong place, wrong rows or columns
  (orders of magnitude outside), and a final rounding off by more than half a bf16 ulp plus the
  slack (a truncating epilogue fails it on some elements). Cannot catch: a rounding mistake within
  that half ulp plus slack (e.g. a wrong tie rule, or a result one ulp off where the slack is wide);
  the tight cases above bound every element to the rounding interval instead.
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
    from fast.codec.matmul_triton import MatmulConfig

    return MatmulConfig(block_m=16, block_n=32, block_k=64, split_k=split_k)


def _fused(split_k: int):
    """The fused kernel with every input amid poison and its output amid NaNs (conformance/poison.py)."""
    def run(inputs: dict[str, Any]) -> Any:
        from fast.codec import matmul_triton

        x, form = inputs["x"], inputs["form"]
        out = PoisonedOutput((x.shape[0], form.shape[0]), x.device)
        y = matmul_triton.fused_matmul(embed(x), embed_form(form), embed(inputs["bias"]), _config(split_k),
                                       out=out.view)
        return {"y": y, GUARD: out.guards()}

    return run


def _plain_on_decoded(split_k: int):
    def run(inputs: dict[str, Any]) -> Any:
        from fast.codec import matmul_triton, palette_triton

        w = palette_triton.decode_palette(inputs["form"])
        return {"y": matmul_triton.matmul(inputs["x"], w, inputs["bias"], _config(split_k)), GUARD: expected_guards()}

    return run


def _float64(inputs: dict[str, Any]) -> dict[str, Any]:
    import reference.codec as rc

    w = _as_float64(rc.palette_to_bf16(inputs["pt"]))  # the reference decoder's weights
    y = inputs["x64"] @ w.T
    return {"y": y + inputs["b64"] if inputs["b64"] is not None else y, GUARD: expected_guards()}


TIGHT_TEXT = "y in [bf16(y64-E), bf16(y64+E)], E = (K+1)2^-23(|x||W|^T+|b|), W = decode kernel's"


def _bf16_values(y: np.ndarray) -> np.ndarray:
    """float64 -> the nearest-even bf16 values (via float32; the float32 step is covered by the slack)."""
    from reference.bf16 import float32_to_bf16

    return _as_float64(float32_to_bf16(y.astype(np.float32)))


def _decoded_bracket(inputs: dict[str, Any]) -> dict[str, Any]:
    """The interval a correctly rounded fused result must lie in, as (midpoint, half width).

    The weights are the palette-decode kernel's output; the product is NumPy's, in float64 (a plain
    matmul written independently of the Triton kernel)."""
    from fast.bf16 import to_numpy_bits
    from fast.codec import palette_triton

    w = _as_float64(to_numpy_bits(palette_triton.decode_palette(inputs["form"])))
    x = inputs["x64"]
    b = inputs["b64"]
    y = x @ w.T + (b if b is not None else 0.0)
    k = w.shape[1]
    slack = (k + 1) * 2.0**-23 * (np.abs(x) @ np.abs(w).T + (np.abs(b) if b is not None else 0.0))
    slack += 2.0**-22 * np.abs(y) + 2.0**-133  # float64 -> float32 on the way to bf16, and subnormals
    with np.errstate(invalid="ignore", over="ignore"):
        lo, hi = _bf16_values(y - slack), _bf16_values(y + slack)
        finite = np.isfinite(lo) & np.isfinite(hi)
        mid = np.where(finite, (lo + hi) / 2, y)
        half = np.where(finite, (hi - lo) / 2, 0.0)
    return {"y": mid, "_half_width": half}


def _tight_allowed(inputs: dict[str, Any], ref: np.ndarray) -> np.ndarray:
    return inputs["_half_width"]


TIGHT = Bound(TIGHT_TEXT, _tight_allowed)


def _with_bracket(make):
    """Inputs plus the bracket's half width (the bound reads it; computed once per case)."""
    def run(gen: Gen) -> dict[str, Any]:
        inputs = make(gen)
        inputs["_bracket"] = _decoded_bracket(inputs)
        inputs["_half_width"] = inputs["_bracket"].pop("_half_width")
        return inputs

    return run


def _bracket_mid(inputs: dict[str, Any]) -> dict[str, Any]:
    return {"y": inputs["_bracket"]["y"], GUARD: expected_guards()}


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
        register(Case(f"matmul.fused_vs_decoded.{label}", Level.BOUNDED, _with_bracket(make), _bracket_mid,
                      _fused(split), bound=TIGHT, requires=needs,
                      about="fused matmul vs NumPy on the decode kernel's weights, correctly rounded"))
        register(Case(f"matmul.fused_vs_float64.{label}", Level.BOUNDED, make, _float64, _fused(split), bound=BOUND,
                      about="fused palette matmul vs the float64 product", requires=needs))
    for label, fused in [("fused_path", True), ("decode_then_matmul", False)]:
        register(Case(f"matmul.linear.{label}", Level.BOUNDED, _inputs("70x200", (6, 64), True), _float64_y,
                      _linear(fused), bound=BOUND, about=f"UnweightLinear ({label}) vs the float64 product"))


_register_all()
