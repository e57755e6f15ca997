"""bfloat16 bit patterns in torch, and float32 -> bf16 rounding spelled out in integer operations.

reference/ holds a bf16 tensor as a NumPy ``uint16`` array of bit patterns; torch has a real
``torch.bfloat16``. These helpers move between the two without changing a bit (views, not casts).
In torch the bit patterns live in ``int16`` tensors: torch's ``uint16`` supports few operations.

``bf16_bits_rne`` is a Triton function that rounds float32 to bf16 with integer operations only.
Triton's interpreter truncates on ``x.to(tl.bfloat16)`` while GPUs round to nearest even (see
DESIGN.md), so kernels whose output must be bit-exact round with this instead of a cast.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from fast.errors import KernelInputError
from fast.triton_util import cdiv
from fast.validate import check_tensor


def bits_to_bf16(bits: torch.Tensor) -> torch.Tensor:
    """View an int16 (or uint16) tensor of bit patterns as torch.bfloat16. No copy, no rounding."""
    if not isinstance(bits, torch.Tensor) or bits.dtype not in (torch.int16, torch.uint16):
        got = bits.dtype if isinstance(bits, torch.Tensor) else type(bits).__name__
        raise KernelInputError(f"bits_to_bf16: expected an int16 or uint16 tensor, got {got}")
    return bits.view(torch.bfloat16)


def bf16_to_bits(x: torch.Tensor) -> torch.Tensor:
    """View a torch.bfloat16 tensor as int16 bit patterns. No copy."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise KernelInputError(f"bf16_to_bits: expected a torch.bfloat16 tensor, got {got}")
    return x.view(torch.int16)


def from_numpy_bits(bits: np.ndarray, device: str | torch.device = "cpu") -> torch.Tensor:
    """A reference bf16 array (NumPy uint16 bit patterns) as a torch.bfloat16 tensor on ``device``."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise KernelInputError(f"from_numpy_bits: expected uint16 bit patterns, got {bits.dtype}")
    t = torch.from_numpy(np.array(bits, dtype=np.uint16, order="C").view(np.int16))  # keeps 0-D tensors 0-D
    return t.view(torch.bfloat16).to(device)


def to_numpy_bits(x: torch.Tensor) -> np.ndarray:
    """A torch.bfloat16 tensor as NumPy uint16 bit patterns (the reference's representation)."""
    return bf16_to_bits(x).detach().cpu().contiguous().numpy().view(np.uint16)


def split_sm_exponent(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exponent, sign/mantissa byte) of int16 bf16 bit patterns, uint8 tensors, flat, C order.

    The torch twin of ``reference.bf16.sign_mantissa_byte`` (FORMAT.md section 1): sm = sign in bit 7,
    mantissa in bits 6..0. ``fast/codec/encode_words.py`` does the same into preallocated buffers.
    """
    b = bits.reshape(-1)
    exponent = (b >> 7).to(torch.uint8)  # the cast keeps the low 8 bits: bits 7..14 of b
    s = b & -32641  # 0x807F as int16: the sign and mantissa bits
    sm = (s | (s >> 8)).to(torch.uint8)  # the arithmetic shift moves the sign bit into bit 7
    return exponent, sm


def join_sm_exponent(sm: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """int16 bf16 bit patterns from sm bytes and exponents: ``((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)``.

    The torch twin of ``reference.bf16.join_sign_mantissa``; the Triton kernels write the same line inline.
    """
    sm = sm.to(torch.int32)
    return (((sm & 0x80) << 8) | (exponent.to(torch.int32) << 7) | (sm & 0x7F)).to(torch.int16)


@triton.jit
def bf16_bits_rne(x):
    """float32 values -> bf16 bit patterns (int32 holding 16 bits), round-to-nearest-even.

    The same rule as reference.bf16.float32_to_bf16: add 0x7FFF plus the lowest kept bit, drop the
    low 16 bits; a NaN keeps its sign and top payload bits with the quiet bit set.
    """
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16  # no overflow: the largest non-NaN pattern is 0xFF800000
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    quiet = (bits >> 16) | 0x0040
    return tl.where(is_nan, quiet, rounded).to(tl.int32)


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, bf16_bits_rne(x).to(tl.int16), mask=mask)


def float32_to_bf16(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Round a float32 tensor to torch.bfloat16 with the Triton kernel (bit-exact on GPU and interpreter);
    into ``out`` (bf16 or int16, x's shape, contiguous) if given."""
    check_tensor(x, "x", dtype=torch.float32)
    if out is not None:
        check_tensor(out, "out", dtype=(torch.bfloat16, torch.int16), shape=tuple(x.shape), device=x.device)
        out = out.view(torch.int16)
    else:
        out = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    n = x.numel()
    if n:
        block = 1024
        _round_kernel[(cdiv(n, block),)](x, out, n, BLOCK=block)
    return out.view(torch.bfloat16)
