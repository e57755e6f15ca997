"""fp8 e4m3 encode/decode and the scale exponent as Triton functions, in integer operations only.

The rule is ``reference/kv/fp8.py``'s, spelled out on bit patterns: no float->fp8 cast, whose
rounding differs between Triton's interpreter and a GPU (paper/design.md). The only float operations are
exact ones: an int < 2^24 converted to float32 (to read its bit length) and products with powers
of two whose results fit float32. So the codes are bit-exact on the GPU and under the interpreter.
(One caveat on a GPU: a decoded value below 2^-126, possible only with scale exponents near -126,
is a float32 subnormal; kernels compiled to flush subnormals would read it as 0.)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def encode_e4m3(x, e):
    """int32 codes (0..255) of float32 ``x / 2^e`` (e: int32, broadcast), ties to even, saturating at 448."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    field = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    m = tl.where(field > 0, frac | 0x800000, frac)  # significand with the hidden bit
    k = tl.where(field > 0, field - 127, -126) - e  # x / 2^e = m * 2^(k - 23)
    m_exp = (m.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127  # floor(log2 m): m < 2^24 converts exactly
    p = k + m_exp - 23  # floor(log2 |x / 2^e|) (meaningless when m == 0)
    low = tl.maximum(p, -6)
    shift = tl.minimum(tl.maximum(low - 3 - (k - 23), 0), 30)  # past 24 every bit drops and nothing rounds up
    q = m >> shift
    rest = m - (q << shift)
    half = tl.where(shift > 0, 1 << tl.maximum(shift - 1, 0), 0)
    up = (shift > 0) & ((rest > half) | ((rest == half) & ((q & 1) == 1)))
    code = ((low + 7) << 3) + q + up.to(tl.int32) - 8
    code = tl.where(m == 0, 0, code)
    code = tl.minimum(code, 0x7E)
    code = tl.where((field == 0xFF) & (frac != 0), 0x7F, code)
    return code | (sign << 7)


@triton.jit
def pow2(e):
    """float32 2^e for int32 e in [-126, 127], from its exponent bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def decode_e4m3(c, e):
    """float32 value of int32 codes ``c`` (0..255) times 2^e (exact; 0x7F/0xFF give NaN)."""
    negative = (c & 0x80) != 0
    field = (c >> 3) & 0xF
    mant = c & 0x7
    normal = (((field + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * 0.001953125  # mant / 8 * 2^-6, exact
    mag = tl.where(field == 0, sub, normal)
    mag = tl.where((field == 0xF) & (mant == 7), float("nan"), mag)
    return tl.where(negative, -mag, mag) * pow2(e)


@triton.jit
def scale_exponent(amax):
    """int32: smallest e in [-126, 120] with amax <= 448 * 2^e (amax >= 0 float32; 0, subnormal, inf, NaN -> -126)."""
    bits = amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    field = bits >> 23
    e = field - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # amax = m 2^(field-126), 448 = 0.875 2^9
    e = tl.where((field == 0) | (field == 0xFF), -126, e)
    return tl.minimum(tl.maximum(e, -126), 120)
