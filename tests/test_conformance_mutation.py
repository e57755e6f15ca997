"""Mutation checks: a deliberately broken kernel must make the suite fail, with a readable message.

Each test swaps a correct kernel for a broken copy (a wrong bit shift, a wrong mask) and runs the
real conformance CLI in-process; it must exit 1 and print the first differing element in hex.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import fast  # noqa: F401  (switches the Triton interpreter on when there is no GPU)
from conformance.__main__ import main
from fast import bf16


@triton.jit
def _broken_round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.uint32, bitcast=True)
    lsb = (bits >> 15) & 1  # the mutation: the lowest kept bit is bit 16, not 15 (only ties notice)
    rounded = (bits + 0x7FFF + lsb) >> 16
    tl.store(out_ptr + offs, rounded.to(tl.int16), mask=mask)


def _broken_float32_to_bf16(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    _broken_round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out.view(torch.bfloat16)


def test_wrong_shift_in_rounding_fails_the_suite(monkeypatch, capsys):
    monkeypatch.setattr(bf16, "float32_to_bf16", _broken_float32_to_bf16)
    assert main(["--device", "cpu", "-k", "bf16.round_rne"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: bf16.round_rne.special (bit-exact)" in out
    assert "first difference at index" in out and "fast 0x" in out and "vs reference 0x" in out
