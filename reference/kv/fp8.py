"""fp8 e4m3 ("e4m3fn") codes for the KV cache, with power-of-two scales per (block, kv-head).

This docstring is the specification; the fast path must reproduce it bit for bit.

Format (OCP "E4M3FN", torch.float8_e4m3fn): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits.
  exponent field 0:      subnormal, value = mantissa/8 * 2^-6   (smallest 2^-9)
  exponent field 1..15:  normal, value = (1 + mantissa/8) * 2^(field-7)
  S.1111.111 (0x7F, 0xFF) is NaN; there is no infinity. Largest finite: 0x7E = 448.

Scale. Each (layer, K or V, block, kv-head) has an integer scale exponent ``e`` in [-126, 120]; a
stored code c means the value ``decode(c) * 2^e`` (computed in float32). Because the scale is a
power of two, applying it is exact: no rounding happens outside the one rounding of the encoder.
For a set of values X, ``scale_exponent(max|X|)`` is the smallest e >= -126 with
``max|X| <= 448 * 2^e``; NaN and +-inf are left out of the max (an all-zero set gives e = -126).
Since |x| <= 448 * 2^e, every finite value fits without saturating.

Encoding x with exponent e (``encode``), all integer work on the float32 bit pattern of x:
  * NaN            -> 0x7F with x's sign bit (0x7F or 0xFF).
  * +-inf          -> +-448 (0x7E / 0xFE): saturating.
  * finite         -> the e4m3 value nearest to x * 2^-e (computed exactly, no intermediate
                      rounding), ties to even mantissa; results above 448 saturate to 448;
                      results that round to zero keep x's sign (0x00 or 0x80).
  Concretely: let M be x's significand as an integer (with the hidden bit for normal x) and
  x = M * 2^(k-23) after removing the scale; p = floor(log2 |x|); the quantum is
  2^(max(p, -6) - 3); q = M shifted right by s = max(p,-6) - 3 - (k - 23) bits with
  round-half-to-even; code = ((max(p,-6) + 7) << 3) + q - 8 (this formula also carries a rounded-up
  mantissa into the exponent and covers subnormals, where q <= 8), then min(code, 0x7E), then the
  sign.
Decoding (``decode``) is exact: decode(c) * 2^e in float32 (only values beyond float32's range,
|x| near 2^128, could overflow to inf).

The KV cache writes tokens into a block with these rules (``KVCache.write``):
  1. a write at offset 0 of a block starts the block afresh: all its codes become 0, e = -126;
  2. for each kv-head, e_new = max(e_old, scale_exponent(max |new values of that head in that
  block|));
  3. if e_new > e_old, the codes already in the block are re-encoded: c <- encode(decode(c) *
  2^e_old,
     e_new) (a second rounding; zeros stay zeros);
  4. the new values are encoded with e_new.
So a scale only grows while a block fills, and a partly filled block that receives a larger value is
rescaled once, deterministically.
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
NAN_CODE = 0x7F
MAX_CODE = 0x7E
MIN_SCALE_EXP, MAX_SCALE_EXP = -126, 120


def _decode_table() -> np.ndarray:
    """float32 value of each of the 256 codes (NaN for 0x7F and 0xFF)."""
    table = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        field, mant = (code >> 3) & 0xF, code & 0x7
        if field == 0xF and mant == 0x7:
            table[code] = np.nan
        elif field == 0:
            table[code] = sign * mant / 8 * 2.0 ** -6
        else:
            table[code] = sign * (1 + mant / 8) * 2.0 ** (field - 7)
    return table


DECODE_TABLE = _decode_table()


def decode(codes: np.ndarray, scale_exp: np.ndarray | int = 0) -> np.ndarray:
    """float32 values of ``codes`` times 2^scale_exp (broadcast)."""
    values = DECODE_TABLE[np.asarray(codes, dtype=np.uint8)]
    return np.ldexp(values, np.asarray(scale_exp, dtype=np.int32)).astype(np.float32)


def encode(x: np.ndarray, scale_exp: np.ndarray | int = 0) -> np.ndarray:
    """e4m3 codes (uint8) of ``x / 2^scale_exp``, by the rule in the module docstring."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.int64)
    sign = ((bits >> 31) & 1).astype(np.uint8) << 7
    field = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    significand = np.where(field > 0, frac | 0x800000, frac)  # hidden bit for normal x
    # x = M * 2^(k-23)
    k = np.where(field > 0, field - 127, -126) - np.asarray(scale_exp, dtype=np.int64)
    length = np.frexp(significand.astype(np.float64))[1].astype(np.int64)  # bit length of M (exact)
    p = k + length - 24  # floor(log2 |x / 2^e|); meaningless when M == 0
    low = np.maximum(p, -6)
    shift = np.clip(low - 3 - (k - 23), 0, 40)
    q = _shift_right_rne(significand, shift)
    code = ((low + 7) << 3) + q - 8
    code = np.where(significand == 0, 0, code)  # +-0
    code = np.minimum(code, MAX_CODE)  # saturate (also +-inf: field 255, frac 0)
    code = np.where((field == 0xFF) & (frac != 0), NAN_CODE, code)  # NaN
    return (code.astype(np.uint8) | sign).astype(np.uint8)


def _shift_right_rne(m: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """m >> shift, rounded half to even (integers, 0 <= shift <= 40)."""
    q = m >> shift
    rest = m - (q << shift)
    half = np.where(shift > 0, np.left_shift(1, np.maximum(shift - 1, 0)), 0)
    up = (shift > 0) & ((rest > half) | ((rest == half) & (q & 1 == 1)))
    return q + up


def scale_exponent(amax: np.ndarray | float) -> np.ndarray:
    """Smallest e in [-126, 120] with amax <= 448 * 2^e (amax >= 0, finite; NaN/inf give -126)."""
    a = np.asarray(amax, dtype=np.float32)
    a = np.where(np.isfinite(a), a, 0).astype(np.float64)
    mant, k = np.frexp(a)  # a = mant * 2^k with mant in [0.5, 1); exact
    e = k - 9 + (mant > 0.875)  # 448 = 0.875 * 2^9
    e = np.where(a > 0, e, MIN_SCALE_EXP)
    return np.clip(e, MIN_SCALE_EXP, MAX_SCALE_EXP).astype(np.int32)


def finite_abs_max(x: np.ndarray, axis: int | tuple[int, ...]) -> np.ndarray:
    """max |x| over ``axis``, ignoring NaN and infinities (0 when nothing finite)."""
    a = np.abs(np.asarray(x, dtype=np.float32))
    return np.where(np.isfinite(a), a, 0).max(axis=axis)
