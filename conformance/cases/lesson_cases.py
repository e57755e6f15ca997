"""The lesson kernels of fast/KERNELS.md against their reference twins (bit-exact).

``lesson.row_scale.*``: the per-row fp8 scales (``fast/lesson/``) against ``reference.lesson.row_scale``, by the
Triton kernel, by the C kernel on every path this CPU can run (``UNFIRE_CPU_ISA`` caps them), and by the torch
fallback. The rows are a slice of a wider matrix whose other columns hold NaN poison, so a kernel that reads
past a row's end (or steps by the wrong stride) returns NaN where the reference has a number; the outputs sit
amid guard cells (conformance/poison.py), so a write past either end shows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from conformance.poison import GUARD, GUARD_UINT8, NAN_BITS, PoisonedOutput, expected_guards
from conformance.registry import Case, Gen, Level, register

PAD = 37  # poisoned columns right of each row: odd, wider than any vector step's overrun


def _matrix(gen: Gen, bits: np.ndarray) -> dict[str, Any]:
    """The bits as a [rows, cols] view into a [rows, cols + PAD] matrix whose extra columns hold NaN poison."""
    import torch

    rows, cols = bits.shape
    wide = np.full((rows, cols + PAD), NAN_BITS, np.uint16)
    wide[:, :cols] = bits
    t = torch.from_numpy(wide.view(np.int16)).to(gen.device)
    return {"bits": bits, "x": t[:, :cols].view(torch.bfloat16)}


def random_rows(gen: Gen) -> list[dict[str, Any]]:
    """Matrices of bf16 values over many magnitudes, of every width around the vector steps (8, 16, 32, 1024)."""
    out = []
    for cols in (0, 1, 7, 15, 16, 17, 31, 32, 33, 100, gen.size(1024 + 37, 4096 + 37)):
        rows = int(gen.rng.integers(1, 9))
        x = (gen.rng.standard_normal((rows, cols)) * np.exp2(gen.rng.integers(-30, 30, (rows, 1)))).astype(np.float32)
        out.append(_matrix(gen, (x.view(np.uint32) >> 16).astype(np.uint16)))
    return out


def special_rows(gen: Gen) -> list[dict[str, Any]]:
    """Rows whose amax sits on the exponent rule's edges (448 * 2^e, mantissa 96/97, the clip at -126 and 120),
    zeros, subnormals, infinities, NaNs with payloads, negative signs; each value placed at a random column."""
    edges = [0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x43E0, 0x43E1, 0xC3E0, 0x3F60, 0x3F61, 0x7F7F, 0xFF7F,
             0x7F80, 0xFF80, 0x7FC1, 0xFFC0, 0x7F81, 0x0B60, 0x0B61, 0x7E60, 0x7EE1, 0x3F80]
    bits = np.zeros((len(edges), 40), np.uint16)
    for r, value in enumerate(edges):
        bits[r] = gen.rng.integers(0, 0x0080, 40, dtype=np.uint16)  # tiny values (subnormal bits) around it
        bits[r, gen.rng.integers(0, 40)] = value
    return [_matrix(gen, bits)]


def _reference(inputs: dict[str, Any]) -> dict[str, Any]:
    from reference.lesson.row_scale import row_scales

    out: dict[str, Any] = {}
    for i, m in enumerate(inputs["matrices"]):
        amax, exponent = row_scales(m["bits"])
        out[f"{i} {m['bits'].shape} amax"], out[f"{i} {m['bits'].shape} exponent"] = amax, exponent
        out[f"{i} {GUARD}"], out[f"{i} {GUARD_UINT8}"] = expected_guards(), expected_guards(kind="uint8")
    return out


def _run(kernel: Callable[..., Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """The kernel on every matrix, into poisoned outputs."""
    import torch

    out: dict[str, Any] = {}
    for i, m in enumerate(inputs["matrices"]):
        x = m["x"]
        amax = PoisonedOutput((x.shape[0],), x.device)
        exponent = PoisonedOutput((x.shape[0],), x.device, kind="uint8")
        kernel(x, (amax.view, exponent.view.view(torch.int8)))
        out[f"{i} {m['bits'].shape} amax"] = amax.view
        out[f"{i} {m['bits'].shape} exponent"] = exponent.view.view(torch.int8)
        out[f"{i} {GUARD}"], out[f"{i} {GUARD_UINT8}"] = amax.guards(), exponent.guards()
    return out


def _triton(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.lesson import row_scale

    return _run(row_scale.row_scales_triton, inputs)


def _torch(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.lesson import row_scale

    return _run(row_scale.row_scales_torch, inputs)


def _c_reference(inputs: dict[str, Any]) -> dict[str, Any]:
    """The reference once per C path (the fast side names its outputs by path)."""
    from fast.lesson import row_scale_c

    ref = _reference(inputs)
    return {f"{name} {key}": value for name in _path_names(row_scale_c).values() for key, value in ref.items()}


def _path_names(row_scale_c: Any) -> dict[int, str]:
    from fast import cpu_isa

    names = row_scale_c.PATH_ISA.get(cpu_isa.arch(), {0: "scalar"})
    return {p: names[p] for p in row_scale_c.paths()}


def _c(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.lesson import row_scale_c

    out: dict[str, Any] = {}
    for path, name in _path_names(row_scale_c).items():
        def kernel(x: Any, outs: Any, path: int = path) -> Any:
            return row_scale_c.row_scales_c(x, outs, path=path)

        out |= {f"{name} {key}": value for key, value in _run(kernel, inputs).items()}
    return out


def _c_requires() -> str | None:
    from fast.lesson import row_scale_c

    built = row_scale_c.library() is not None
    return None if built else "no C compiler (or UNFIRE_NATIVE=0): the C kernel is not built"


def _cpu_only(gen: Gen) -> bool:
    return gen.device.type == "cpu"


for _label, _make in [("random", random_rows), ("special", special_rows)]:
    def _inputs(gen: Gen, make: Callable[[Gen], list[dict[str, Any]]] = _make) -> dict[str, Any]:
        return {"matrices": make(gen)}

    register(Case(f"lesson.row_scale.triton.{_label}", Level.BIT_EXACT, _inputs, _reference, _triton,
                  about="Triton per-row amax and fp8 scale exponent vs reference.lesson.row_scale"))
    register(Case(f"lesson.row_scale.torch.{_label}", Level.BIT_EXACT, _inputs, _reference, _torch,
                  about="the torch fallback of the row scales vs reference.lesson.row_scale"))
    register(Case(f"lesson.row_scale.c.{_label}", Level.BIT_EXACT, _inputs, _c_reference, _c,
                  about="C row scales, every path this CPU has (scalar, AVX2, AVX-512BW / NEON) vs the reference",
                  requires=_c_requires))
