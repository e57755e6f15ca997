"""Per-row fp8 scales of a bf16 matrix: the reference twin of the lesson kernel (fast/KERNELS.md).

This docstring is the specification; ``fast/lesson/`` reproduces it bit for bit in Triton and in C.

Before a bf16 matrix is stored as fp8 e4m3 with one power-of-two scale per row (the rule of the fp8
KV cache, ``reference/kv/fp8.py``), each row needs two numbers:

* ``amax``: the largest |x| of the row, as bf16 bits (uint16). NaN wins: a row holding a NaN has a
  NaN amax (the largest NaN bit pattern of the row, sign cleared), so a caller sees it instead of a
  scale that silently left the NaN out. An empty row has amax 0.
* ``exponent``: ``scale_exponent(amax)`` of the fp8 rule, the smallest e in [-126, 120] with
  amax <= 448 * 2^e (int8); a NaN, infinite or zero amax gives -126.

The maximum is taken on bit patterns, not on floats: clearing the sign bit of a bf16 leaves an
integer whose order is the order of the absolute values, with +inf above every finite value and
every NaN above +inf. An integer maximum is exact and does not depend on the order in which the
row is visited, so every implementation (one row per Triton program, 32 lanes of AVX-512, a plain
loop) gives the same bits.
"""

from __future__ import annotations

import numpy as np

from reference.kv.fp8 import scale_exponent

SIGN_CLEAR = 0x7FFF


def row_amax_bits(x: np.ndarray) -> np.ndarray:
    """The bf16 bits of max |x| over each row of ``x`` (uint16 bf16 bits, shape [rows, cols])."""
    x = np.asarray(x, dtype=np.uint16)
    if x.shape[1] == 0:
        return np.zeros(x.shape[0], dtype=np.uint16)
    return (x & SIGN_CLEAR).max(axis=1).astype(np.uint16)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bits to float32 values (exact: a bf16 is the top half of a float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def row_scales(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(amax as bf16 bits [rows], scale exponent int8 [rows]) of each row of ``x``."""
    amax = row_amax_bits(x)
    exponent = scale_exponent(bf16_to_float32(amax)).astype(np.int8)
    return amax, exponent
