"""fp8 e4m3 codes with power-of-two scales, in torch: the rule of ``reference/kv/fp8.py``, bit for bit.

Everything is integer work on float32 bit patterns (no float->fp8 cast), so the result equals the
reference's on every input, NaN, infinities, -0.0 and subnormals included. These functions serve
the torch path of ``PagedKVCache.write`` and the attention's dequantization on any device.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
NAN_CODE, MAX_CODE = 0x7F, 0x7E
MIN_SCALE_EXP, MAX_SCALE_EXP = -126, 120


def _bits64(x: torch.Tensor) -> torch.Tensor:
    """The float32 bit pattern of ``x`` as non-negative int64."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _bit_length(m: torch.Tensor) -> torch.Tensor:
    """Number of bits of non-negative int64 m < 2^53 (0 for 0); exact via frexp of a float64."""
    return torch.frexp(m.to(torch.float64))[1].to(torch.int64)


def encode(x: torch.Tensor, scale_exp: torch.Tensor | int = 0) -> torch.Tensor:
    """uint8 e4m3 codes of float32 ``x / 2^scale_exp`` (broadcast), nearest with ties to even, saturating."""
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    bits = _bits64(x)
    sign = (bits >> 31) & 1
    field = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    significand = torch.where(field > 0, frac | 0x800000, frac)
    e = torch.as_tensor(scale_exp, dtype=torch.int64, device=x.device)
    k = torch.where(field > 0, field - 127, torch.full_like(field, -126)) - e  # x / 2^e = M * 2^(k-23)
    p = k + _bit_length(significand) - 24  # floor(log2 |x / 2^e|)
    low = torch.clamp(p, min=-6)
    shift = torch.clamp(low - 3 - (k - 23), 0, 40)
    q = significand >> shift
    rest = significand - (q << shift)
    half = torch.where(shift > 0, 1 << torch.clamp(shift - 1, min=0), torch.zeros_like(shift))
    up = (shift > 0) & ((rest > half) | ((rest == half) & ((q & 1) == 1)))
    code = ((low + 7) << 3) + q + up.to(torch.int64) - 8
    code = torch.where(significand == 0, torch.zeros_like(code), code)
    code = torch.clamp(code, max=MAX_CODE)
    code = torch.where((field == 0xFF) & (frac != 0), torch.full_like(code, NAN_CODE), code)
    return (code | (sign << 7)).to(torch.uint8)


def decode_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 value of each of the 256 codes (NaN for 0x7F and 0xFF), built from bit fields."""
    code = torch.arange(256, dtype=torch.int64, device=device)
    field, mant = (code >> 3) & 0xF, code & 0x7
    normal = torch.ldexp(1 + mant.to(torch.float64) / 8, (field - 7).to(torch.float64))
    sub = mant.to(torch.float64) / 8 * 2.0 ** -6
    value = torch.where(field == 0, sub, normal)
    value = torch.where((field == 0xF) & (mant == 7), torch.full_like(value, float("nan")), value)
    return torch.where(code >= 128, -value, value).to(torch.float32)


_TABLES: dict[torch.device, torch.Tensor] = {}


def decode_table_on(device: torch.device) -> torch.Tensor:
    """``decode_table`` on ``device``, built once per device."""
    table = _TABLES.get(device)
    if table is None:
        table = _TABLES[device] = decode_table(device)
    return table


def decode(codes: torch.Tensor, scale_exp: torch.Tensor | int = 0) -> torch.Tensor:
    """float32 values of uint8 ``codes`` times 2^scale_exp (broadcast; exact)."""
    values = decode_table_on(codes.device)[codes.to(torch.int64)]
    e = torch.as_tensor(scale_exp, device=codes.device)
    return values * exp2_int(e)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """float32 2^e for integer e in [-126, 127], built from the exponent bits (exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest e in [-126, 120] with amax <= 448 * 2^e (int32; NaN, inf and 0 give -126)."""
    bits = _bits64(amax.to(torch.float32)) & 0x7FFFFFFF
    field, frac = bits >> 23, bits & 0x7FFFFF
    e = field - 126 - 9 + (frac > 0x600000).to(torch.int64)  # amax = m 2^k, m in [0.5, 1): k = field - 126
    e = torch.where((field == 0) | (field == 0xFF), torch.full_like(e, MIN_SCALE_EXP), e)  # 0, subnormal, inf/NaN
    return torch.clamp(e, MIN_SCALE_EXP, MAX_SCALE_EXP).to(torch.int32)


def finite_abs_max(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """max |x| over ``dim``, ignoring NaN and infinities (0 when nothing finite)."""
    a = x.to(torch.float32).abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(dim=dim)
