"""The fused C element-wise ops of the bf16 model on a CPU (``fast/engine/fused_c.py``, ``native/fused_ops.c``).

* ``engine.residual_add.bf16.{simd,plain}`` (bit-exact): ``x + float(delta)`` (the residual stream, float32, plus
  a projection's bf16 output) written into a poisoned float32 buffer, against NumPy's float32 add (one correctly
  rounded addition per element: a single right answer). Catches: a wrong widening of bf16, a read or write past
  a row (the inputs sit amid NaN poison, the output's guard cells must stay as they were).
* ``engine.rms_norm.bf16.{simd,plain}`` (bounded): the normed rows ``bf16(x / sqrt(mean(x^2) + eps) * w)`` against
  the float64 value of the same formula on the same float32 x. Bound: half a bf16 ulp of the float64 value
  (the one final rounding) plus 2^-17 of it (the float32 steps before it: the sum of squares, at most ~40
  additions deep at these lengths, about 2^-19 together; torch's sqrt, within ~1.5 half-ulps of float32; the
  division and the scaling). The bits are torch's own (tests/test_fast_fused.py compares them with the model's
  torch lines); this case checks them against an independent float64 computation, with rows from 2^-10 to
  2^10 in scale and one all-zero row.

* ``engine.silu_mul.bf16.simd`` (bounded): ``bf16(bf16(silu(gate)) * up)`` from a fused gate/up projection, torch's
  own exp inside (the bits are the torch lines', tests/test_fast_fused.py), against float64 silu(gate) * up. Bound:
  2^-7 + 2^-14 of the float64 value (two bf16 roundings, each within 2^-8 relative; the float32 silu within a few
  ulps; the product of two bf16 is exact in float32) plus 2^-132 (bf16's subnormal spacing) plus 2^-120 |up|
  (below gate -88.7 exp(-gate) overflows float32, so silu is 0 where its true value is under 2^-120). Row lengths that
  are not a multiple of the 64-value vector step, so the scalar tail of each row is covered too.

``simd``: the AVX-512 loops (skipped without AVX-512); ``plain``: the portable C loops. Without a C compiler, or
where the norm does not know torch's summation order on this CPU, the cases are skipped (the model then runs its
torch lines).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from conformance.poison import GUARD, PoisonedOutput, embed, expected_guards
from conformance.registry import Bound, Case, Gen, Level, register

X_GUARD = "guard cells around x_out (must stay the float32 poison)"
_X_POISON = 0x7FA5A5A5  # a float32 NaN with a payload, as int32
_CELLS = 67


def _inputs(gen: Gen) -> dict[str, Any]:
    import torch

    n, h = gen.size((37, 576), (257, 4096))
    scales = 2.0 ** gen.rng.integers(-10, 11, size=(n, 1))
    x = (gen.rng.standard_normal((n, h)) * scales).astype(np.float32)
    x[n // 2] = 0.0  # an all-zero row: the norm is 0 / sqrt(eps)
    delta = (gen.rng.standard_normal((n, h)) * scales).astype(np.float32)
    delta[n // 2] = 0.0
    w = gen.rng.standard_normal(h).astype(np.float32)
    dt = torch.from_numpy(delta).bfloat16()
    return {"x": torch.from_numpy(x), "delta": dt, "w": torch.from_numpy(w), "eps": 1e-5,
            "delta32": dt.float().numpy()}


@contextmanager
def _simd(on: bool) -> Iterator[None]:
    old = os.environ.get("UNFIRE_NATIVE_SIMD")
    os.environ["UNFIRE_NATIVE_SIMD"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["UNFIRE_NATIVE_SIMD"]
        else:
            os.environ["UNFIRE_NATIVE_SIMD"] = old


def _poisoned_f32(shape: tuple[int, int]) -> tuple[Any, Any]:
    import torch

    n = shape[0] * shape[1]
    buf = torch.full((_CELLS + n + _CELLS,), _X_POISON, dtype=torch.int32)
    return buf, buf[_CELLS: _CELLS + n].view(torch.float32).view(shape)


def _x_guards(buf: Any) -> Any:
    import torch

    return torch.cat([buf[:_CELLS], buf[-_CELLS:]])


def _add_fast(simd: bool):
    def run(inputs: dict[str, Any]) -> dict[str, Any]:
        from fast.engine import fused_c

        buf, x_out = _poisoned_f32(tuple(inputs["x"].shape))
        with _simd(simd):
            fused_c.add_rms_norm(embed(inputs["x"]), embed(inputs["delta"]), None, inputs["eps"], x_out)
        return {"x_out": x_out.clone(), X_GUARD: _x_guards(buf)}

    return run


def _add_reference(inputs: dict[str, Any]) -> dict[str, Any]:
    return {"x_out": inputs["x"].numpy() + inputs["delta32"], X_GUARD: np.full(2 * _CELLS, _X_POISON, np.int32)}


def _norm_fast(simd: bool):
    def run(inputs: dict[str, Any]) -> dict[str, Any]:
        from fast.engine import fused_c

        out = PoisonedOutput(tuple(inputs["x"].shape), inputs["x"].device)
        with _simd(simd):
            fused_c.add_rms_norm(embed(inputs["x"]), None, embed(inputs["w"]), inputs["eps"], out=out.view)
        return {"h": out.view.clone(), GUARD: out.guards()}

    return run


def _norm_reference(inputs: dict[str, Any]) -> dict[str, Any]:
    x = inputs["x"].numpy().astype(np.float64)
    r = np.sqrt((x * x).mean(axis=-1, keepdims=True) + np.float64(np.float32(inputs["eps"])))
    return {"h": x / r * inputs["w"].numpy().astype(np.float64), GUARD: expected_guards()}


def _norm_allowed(inputs: dict[str, Any], ref: np.ndarray) -> np.ndarray:
    mag = np.abs(ref)
    _, e = np.frexp(mag)  # mag = m * 2^e, m in [0.5, 1): a bf16 ulp there is 2^(e - 8)
    half_ulp = np.ldexp(1.0, (e - 9).astype(np.int64))
    return np.where(mag > 0, half_ulp + mag * 2.0 ** -17, 2.0 ** -133)


NORM_BOUND = Bound("|h - float64| <= half a bf16 ulp of the float64 value + 2^-17 of it (float32 sum of squares, "
                   "torch's sqrt, division, scaling; then one bf16 rounding)", _norm_allowed)


def _requires(simd: bool):
    def check() -> str | None:
        import torch

        from fast.engine import fused_c

        lib = fused_c.library()
        if lib is None:
            return "no C compiler (or UNFIRE_NATIVE=0 / UNFIRE_NATIVE_FUSED=0): the fused ops are not built"
        if fused_c.norm_lanes() is None:
            capability = torch.backends.cpu.get_cpu_capability()
            return f"the C norm does not know torch's summation order on this CPU ({capability})"
        if simd and not lib.unf_fused_simd():
            return "no AVX-512 on this CPU: its loops do not run"
        from fast import build_c

        if simd and not build_c.isa_allows("avx512"):  # the loops would quietly be the plain ones
            return "UNFIRE_CPU_ISA caps this run below avx512: the AVX-512 loops do not run"
        return None

    return check


for _simd_on, _label in ((True, "simd"), (False, "plain")):
    register(Case(f"engine.residual_add.bf16.{_label}", Level.BIT_EXACT, _inputs, _add_reference, _add_fast(_simd_on),
                  about=f"x + float(bf16 delta) in C ({_label} loops), vs NumPy float32",
                  requires=_requires(_simd_on)))
    register(Case(f"engine.rms_norm.bf16.{_label}", Level.BOUNDED, _inputs, _norm_reference, _norm_fast(_simd_on),
                  bound=NORM_BOUND, about=f"RMSNorm to bf16 in C ({_label} loops, torch's summation order and sqrt), "
                  "vs float64", requires=_requires(_simd_on)))


def _silu_inputs(gen: Gen) -> dict[str, Any]:
    import torch

    n, inter = gen.size((23, 1536 + 37), (129, 8192 + 37))
    scales = 2.0 ** gen.rng.integers(-6, 6, size=(n, 1))
    gate_up = (gen.rng.standard_normal((n, 2 * inter)) * scales).astype(np.float32)
    t = torch.from_numpy(gate_up).bfloat16()
    return {"gate_up": t, "g64": t.float().numpy().astype(np.float64)}


def _silu_fast(inputs: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fast.engine import fused_c

    gate_up = embed(inputs["gate_up"])
    with _simd(True):
        if not fused_c.silu_applies(torch.bfloat16, gate_up.device):
            raise RuntimeError("the C silu does not run here")
        return {"act": fused_c.silu_mul(gate_up)}


def _silu_reference(inputs: dict[str, Any]) -> dict[str, Any]:
    g, u = np.split(inputs["g64"], 2, axis=-1)
    return {"act": g / (1.0 + np.exp(-g)) * u}


def _silu_allowed(inputs: dict[str, Any], ref: np.ndarray) -> np.ndarray:
    up = np.split(inputs["g64"], 2, axis=-1)[1]
    # below gate -88.7, exp(-gate) overflows float32 and silu is 0: off by |gate| e^gate |up| < 2^-120 |up|
    return np.abs(ref) * (2.0 ** -7 + 2.0 ** -14) + 2.0 ** -132 + np.abs(up) * 2.0 ** -120


def _silu_requires() -> str | None:
    import torch

    from fast.engine import fused_c

    if fused_c.library() is None:
        return "no C compiler (or UNFIRE_NATIVE=0 / UNFIRE_NATIVE_FUSED=0): the fused ops are not built"
    with _simd(True):
        if not fused_c.silu_applies(torch.bfloat16, torch.device("cpu")):
            return "the C silu does not run here (no AVX-512, or torch's vectorised exp not found or not matching)"
    return None


register(Case("engine.silu_mul.bf16.simd", Level.BOUNDED, _silu_inputs, _silu_reference, _silu_fast,
              bound=Bound("|act - float64| <= (2^-7 + 2^-14) |float64| + 2^-132 + 2^-120 |up| (two bf16 roundings, "
                          "float32 silu, which is 0 where exp(-gate) overflows)", _silu_allowed),
              about="silu(gate) * up to bf16 in C (torch's exp), vs float64", requires=_silu_requires))
