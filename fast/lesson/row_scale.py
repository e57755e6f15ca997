"""Per-row fp8 scales of a bf16 matrix in Triton and torch: the Triton lesson kernel of fast/KERNELS.md.

    amax, exponent = row_scales_triton(x)          # x: bf16 [rows, cols] -> bf16 [rows], int8 [rows]
    row_scales_triton(x, out=(amax, exponent))     # into given tensors (the conformance case's poisoned ones)
    amax, exponent = row_scales_torch(x)           # the same bits in torch lines (the fallback)

The specification and its NumPy twin are ``reference/lesson/row_scale.py``: amax is the largest
``bits & 0x7fff`` of the row (NaN wins), the exponent the fp8 rule's ``scale_exponent(amax)``. All of it is
integer work on bit patterns, so the Triton kernel, the torch lines and the C kernel
(``fast/lesson/row_scale_c.py``) give the same bits, in any order of the row.

Which one runs is ``fast.lesson.row_scales``'s choice (run-time dispatch, in ``fast/lesson/__init__.py``).
Conformance: bit-exact, ``conformance/cases/lesson_cases.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.triton_util import next_pow2
from fast.validate import check_tensor

MAX_BLOCK = 1024  # columns a program reads per step: a row of 4096 takes 4 steps


@triton.jit
def fp8_scale_exponent(amax):
    """The fp8 scale exponent of bf16 amax bits (int32, sign clear): reference.kv.fp8.scale_exponent in integers.

    bf16 = (1 + m/128) * 2^(E-127) for 0 < E < 255, and 1 + m/128 <= 1.75 (= 448 / 2^8) exactly when m <= 96."""
    e_field = amax >> 7
    e = e_field - 135 + ((amax & 0x7F) > 96).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 120)
    return tl.where((e_field == 0) | (e_field == 255), -126, e)


@triton.jit
def _row_scale_kernel(x_ptr, amax_ptr, exp_ptr, cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # one program per row
    offs = tl.arange(0, BLOCK)
    best = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, cols, BLOCK):  # the row in BLOCK-wide steps, masked at its end
        mask = start + offs < cols
        bits = tl.load(x_ptr + row.to(tl.int64) * stride + start + offs, mask=mask, other=0)
        best = tl.maximum(best, bits.to(tl.int32) & 0x7FFF)
    amax = tl.max(best, axis=0)
    tl.store(amax_ptr + row, amax.to(tl.int16))
    tl.store(exp_ptr + row, fp8_scale_exponent(amax).to(tl.int8))


def _outputs(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0]
    if out is None:
        return (torch.empty(rows, dtype=torch.bfloat16, device=x.device),
                torch.empty(rows, dtype=torch.int8, device=x.device))
    amax, exponent = out
    check_tensor(amax, "out[0]", dtype=torch.bfloat16, shape=(rows,), device=x.device, kernel_device=False)
    check_tensor(exponent, "out[1]", dtype=torch.int8, shape=(rows,), device=x.device, kernel_device=False)
    return amax, exponent


def row_scales_triton(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax bf16 [rows], exponent int8 [rows]) of a bf16 [rows, cols] tensor, by the Triton kernel."""
    check_tensor(x, "x", dtype=torch.bfloat16, ndim=2, contiguous=False)
    if x.shape[1] and x.stride(1) != 1:
        x = x.contiguous()
    amax, exponent = _outputs(x, out)
    if x.shape[0]:
        block = min(MAX_BLOCK, next_pow2(max(x.shape[1], 16)))
        _row_scale_kernel[(x.shape[0],)](x.view(torch.int16), amax.view(torch.int16), exponent, x.shape[1],
                                         x.stride(0), BLOCK=block)
    return amax, exponent


def row_scales_torch(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, in torch lines (the fallback where neither kernel runs)."""
    check_tensor(x, "x", dtype=torch.bfloat16, ndim=2, contiguous=False, kernel_device=False)
    amax, exponent = _outputs(x, out)
    bits = (x.view(torch.int16).to(torch.int32) & 0x7FFF) if x.shape[1] else torch.zeros(
        x.shape[0], 1, dtype=torch.int32, device=x.device)
    a = bits.amax(dim=1)
    field = a >> 7
    e = (field - 135 + ((a & 0x7F) > 96).to(torch.int32)).clamp(-126, 120)
    e = torch.where((field == 0) | (field == 255), torch.full_like(e, -126), e)
    amax.view(torch.int16).copy_(a.to(torch.int16))
    exponent.copy_(e.to(torch.int8))
    return amax, exponent
