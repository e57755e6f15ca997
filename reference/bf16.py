"""bfloat16 in plain NumPy: conversion, bit fields, and per-field statistics.

A bfloat16 is the top half of a float32: 1 sign bit, 8 exponent bits, 7 mantissa bits.
NumPy has no bfloat16 dtype, so throughout this codebase a bf16 tensor is a ``uint16`` array
holding the raw bit patterns. This module is the one place that knows how those bits are laid out.

Unweight (claim U1) rests on one observation: in trained weights the exponent byte carries only
~2.6 bits of information while sign and mantissa are close to random. ``field_entropy`` measures it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SIGN_SHIFT = 15
EXPONENT_SHIFT = 7
EXPONENT_MASK = 0xFF
MANTISSA_MASK = 0x7F


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 bit patterns (uint16), round-to-nearest-even.

    Matches ``torch.Tensor.to(torch.bfloat16)`` bit for bit on every non-NaN float32: normals,
    subnormals, +-0 and +-inf. Values that round past the largest finite bf16 become inf, as in
    torch. A NaN stays a NaN: we keep its sign and top payload bits and set the quiet bit (what
    the x86 ``VCVTNEPS2BF16`` instruction does). torch itself is not consistent here: its scalar
    path returns 0x7FC0 and its vectorised CPU path 0xFFFF for every NaN.
    """
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"float32_to_bf16 expects float32, got {x.dtype}")
    bits = x.view(np.uint32).astype(np.uint64)  # room for the carry out of bit 31
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16).astype(np.uint16)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    quiet_nan = ((bits >> 16) | 0x0040).astype(np.uint16)
    return np.where(is_nan, quiet_nan, rounded)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32. Exact: every bf16 is a float32."""
    bits = _as_bf16_bits(bits)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def split_fields(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split bf16 bit patterns into (sign, exponent, mantissa), each a uint8 array."""
    bits = _as_bf16_bits(bits)
    sign = (bits >> SIGN_SHIFT).astype(np.uint8)
    exponent = ((bits >> EXPONENT_SHIFT) & EXPONENT_MASK).astype(np.uint8)
    mantissa = (bits & MANTISSA_MASK).astype(np.uint8)
    return sign, exponent, mantissa


def join_fields(sign: np.ndarray, exponent: np.ndarray, mantissa: np.ndarray) -> np.ndarray:
    """Inverse of ``split_fields``: rebuild bf16 bit patterns from the three fields."""
    sign = np.asarray(sign).astype(np.uint16)
    exponent = np.asarray(exponent).astype(np.uint16)
    mantissa = np.asarray(mantissa).astype(np.uint16)
    if sign.size and sign.max() > 1:
        raise ValueError("sign field must be 0 or 1")
    if mantissa.size and mantissa.max() > MANTISSA_MASK:
        raise ValueError("mantissa field must fit in 7 bits")
    if exponent.size and exponent.max() > EXPONENT_MASK:
        raise ValueError("exponent field must fit in 8 bits")
    return (sign << SIGN_SHIFT) | (exponent << EXPONENT_SHIFT) | mantissa


def sign_mantissa_byte(bits: np.ndarray) -> np.ndarray:
    """The byte Unweight stores verbatim next to the coded exponent: sign bit, then 7 mantissa
    bits."""
    bits = _as_bf16_bits(bits)
    return (((bits >> 8) & 0x80) | (bits & MANTISSA_MASK)).astype(np.uint8)


def join_sign_mantissa(sm: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    """Inverse of ``sign_mantissa_byte``: bf16 bits (uint16) from the sm byte and the 8-bit
    exponent.

    ``b = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)`` (FORMAT.md section 1).
    """
    sm = np.asarray(sm).astype(np.uint16)
    exponent = np.asarray(exponent).astype(np.uint16)
    return ((sm & 0x80) << 8) | (exponent << EXPONENT_SHIFT) | (sm & MANTISSA_MASK)


def shannon_entropy(counts: np.ndarray) -> float:
    """Shannon entropy in bits of a histogram (counts, not probabilities). 0 for an empty one."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())


@dataclass(frozen=True)
class FieldStats:
    """Histograms of the three bf16 fields of one tensor (or of many, summed)."""

    sign_counts: np.ndarray  # shape (2,)
    exponent_counts: np.ndarray  # shape (256,)
    mantissa_counts: np.ndarray  # shape (128,)

    @property
    def n(self) -> int:
        return int(self.sign_counts.sum())

    @property
    def sign_entropy(self) -> float:
        return shannon_entropy(self.sign_counts)

    @property
    def exponent_entropy(self) -> float:
        return shannon_entropy(self.exponent_counts)

    @property
    def mantissa_entropy(self) -> float:
        return shannon_entropy(self.mantissa_counts)

    def top_k_coverage(self, k: int = 16) -> float:
        """Share of elements whose exponent is among the k most frequent values."""
        return top_k_coverage(self.exponent_counts, k)

    def __add__(self, other: FieldStats) -> FieldStats:
        return FieldStats(
            self.sign_counts + other.sign_counts,
            self.exponent_counts + other.exponent_counts,
            self.mantissa_counts + other.mantissa_counts,
        )

    @staticmethod
    def empty() -> FieldStats:
        z = np.zeros
        return FieldStats(z(2, np.int64), z(256, np.int64), z(128, np.int64))


def field_stats(bits: np.ndarray) -> FieldStats:
    """Count each value of sign, exponent and mantissa in a bf16 tensor."""
    sign, exponent, mantissa = split_fields(np.ravel(bits))
    return FieldStats(
        np.bincount(sign, minlength=2).astype(np.int64),
        np.bincount(exponent, minlength=256).astype(np.int64),
        np.bincount(mantissa, minlength=128).astype(np.int64),
    )


def exponent_frequencies(bits: np.ndarray) -> np.ndarray:
    """Histogram of the 256 possible exponent values (int64, length 256)."""
    return field_stats(bits).exponent_counts


def top_k_coverage(exponent_counts: np.ndarray, k: int = 16) -> float:
    """Share of elements covered by the k most frequent exponent values (1.0 for an empty
    tensor)."""
    counts = np.asarray(exponent_counts, dtype=np.int64)
    total = counts.sum()
    if total == 0:
        return 1.0
    top = np.sort(counts)[::-1][:k]
    return float(top.sum() / total)


def _as_bf16_bits(bits: np.ndarray) -> np.ndarray:
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 tensors are uint16 bit patterns here, got dtype {bits.dtype}")
    return bits
