"""float32 -> bf16 rounding in Triton (integer operations) against reference.bf16 (bit-exact).

The fused matmul's epilogue rounds with the same Triton function, so these cases guard it. The
float32 input sits amid NaN poison and the output amid guard cells (conformance/poison.py), so a
read or a write past either end shows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.poison import GUARD, PoisonedOutput, embed, expected_guards
from conformance.registry import Case, Gen, Level, register


def _to_device(bits: np.ndarray, gen: Gen) -> dict[str, Any]:
    import torch

    return {"x32": bits.view(np.float32), "x": torch.from_numpy(bits.view(np.float32).copy()).to(gen.device)}


def random_floats(gen: Gen) -> dict[str, Any]:
    """Normal-ish floats over many magnitudes: half of them sit off a bf16 tie."""
    n = gen.size(10_000, 10_000_000)
    x = (gen.rng.standard_normal(n) * np.exp2(gen.rng.integers(-40, 40, n))).astype(np.float32)
    return _to_device(x.view(np.uint32), gen)


def special_floats(gen: Gen) -> dict[str, Any]:
    """Ties (low half exactly 0x8000, both parities), NaNs with payloads, infinities, subnormals, overflow."""
    rng = gen.rng
    hi = rng.integers(0, 1 << 16, 4096, dtype=np.uint32) << 16
    patterns = [
        hi | 0x8000, hi | 0x7FFF, hi | 0x8001, hi,  # ties, just below, just above, exact
        np.array([0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x00000001, 0x80000001,
                  0x007FFFFF, 0x00008000, 0x80000000, 0x00000000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                  0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF], dtype=np.uint32),
        rng.integers(0x7F800001, 0x7FFFFFFF, 256, dtype=np.uint32),  # NaN payloads
        rng.integers(0, 1 << 32, gen.size(4096, 1 << 20), dtype=np.uint32),  # any pattern at all
    ]
    return _to_device(np.concatenate(patterns).astype(np.uint32), gen)


def _reference(inputs: dict[str, Any]) -> dict[str, Any]:
    from reference.bf16 import float32_to_bf16

    return {"bf16": float32_to_bf16(inputs["x32"]), GUARD: expected_guards()}


def _fast(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast import bf16

    out = PoisonedOutput(tuple(inputs["x"].shape), inputs["x"].device)
    return {"bf16": bf16.float32_to_bf16(embed(inputs["x"]), out=out.view), GUARD: out.guards()}


for _label, _gen in [("random", random_floats), ("special", special_floats)]:
    register(Case(f"bf16.round_rne.{_label}", Level.BIT_EXACT, _gen, _reference, _fast,
                  about="Triton float32->bf16 (integer RNE) vs reference.bf16.float32_to_bf16"))
