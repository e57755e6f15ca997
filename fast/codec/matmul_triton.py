"""y = x @ W.T in Triton, with W either plain bf16 or in palette form, decoded tile by tile in registers.

One kernel body serves both: ``W_PALETTE`` (a compile-time flag) only changes how a [BN x BK]
weight tile reaches ``tl.dot``. Plain: loaded from the bf16 matrix. Fused: ``palette_tile`` reads
12 bits per weight (4-bit index + sm byte), decodes in registers and hands the bf16 tile straight to
``tl.dot``; the decoded weights are never written to memory. Everything else (tiling, the order of
the K loop, split-K, the fp32 accumulator, the epilogue) is shared, which is what makes the fused
kernel "same-kernel exact" against the plain kernel run on the decoded weights.

Under TRITON_INTERPRET=1 (triton 3.9) ``tl.dot`` on bf16 tiles multiplies their raw uint16 bit
patterns as integers; the kernel therefore widens both tiles to fp32 first there (``DOT_F32``, exact:
every bf16 is a float32). On the GPU the tiles go to the tensor cores as bf16.

The epilogue rounds the fp32 accumulator to bf16 with integer operations (``bf16_bits_rne``),
so the result is rounded to nearest even on the GPU and in the interpreter alike. With split-K
each K range writes an fp32 partial, and a second kernel adds the partials in a fixed order (so the
result is deterministic: no atomics), adds the bias and rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fast.bf16 import bf16_bits_rne
from fast.codec.forms import PaletteForm
from fast.codec.palette_triton import check_palette_form, kernel_arrays, palette_tile, split_vstart
from fast.errors import KernelInputError
from fast.triton_util import DeviceProps, cdiv, device_props, on_interpreter
from fast.validate import check_tensor


@dataclass(frozen=True)
class MatmulConfig:
    """Tile sizes and launch parameters. block_k must be a multiple of 16; split_k >= 1."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, idx_ptr, sm_ptr, palette_ptr, vchunks_ptr, vexp_ptr, vstart_ptr, row_vstart_ptr,
                   bias_ptr, out_ptr, part_ptr, M, N, K, half_k, chunks_per_row, k_per_split,
                   W_PALETTE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, CS: tl.constexpr,
                   NV_ITERS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   DOT_F32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN).to(tl.int64)
    m_ok = rm < M
    n_ok = rn < N
    k_begin = pid_k.to(tl.int64) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    vptr = tl.zeros([BN], dtype=tl.int64)
    vend = tl.zeros([BN], dtype=tl.int64)
    if W_PALETTE:
        vptr = tl.load(vstart_ptr + rn * SPLIT_K + pid_k, mask=n_ok, other=0)
        vend = tl.load(row_vstart_ptr + rn + 1, mask=n_ok, other=0)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BK):
        rk = k0 + tl.arange(0, BK).to(tl.int64)
        k_ok = rk < k_end
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if W_PALETTE:
            bits, vptr = palette_tile(idx_ptr, sm_ptr, palette_ptr, vchunks_ptr, vexp_ptr, rn, n_ok, k0, rk, k_end,
                                      half_k, K, chunks_per_row, vptr, vend, CS, NV_ITERS)
            w = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:  # the interpreter multiplies bf16 tiles as raw uint16 bits: widen them first (exact)
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out_offs = rm[:, None] * N + rn[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, bf16_bits_rne(acc).to(tl.int16), mask=out_mask)
    else:
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + out_offs, acc, mask=out_mask)


@triton.jit
def _reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK: tl.constexpr):
    """out = bf16(sum over k of part[k] (+ bias)), summed in order k = 0, 1, ... (deterministic)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < M * N
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for k in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + k * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, bf16_bits_rne(acc).to(tl.int16), mask=mask)


def default_config(m: int, n: int, k: int, props: DeviceProps | None = None) -> MatmulConfig:
    """A tile shape by batch size (hand-picked, not autotuned: see experiments/unweight/gpu_bench.py).

    A pure function of the shapes and the GPU's properties (``props``; default: this machine's GPU,
    or H100's), so ``python -m conformance --compile`` computes the choice without a GPU. Under the
    interpreter (and no ``props``) small tiles: it pays per operation, not per element. The plain
    and the fused kernel get the same configuration (what makes them "same-kernel exact").

    Register pressure (sm_90, ptxas, see fast/README.md): the fused kernel decodes a [BN x BK] tile
    in registers, 64 weights per thread at BN=64, BK=128 and 4 warps: 250-254 registers. BK=64 and
    8 warps halve that (117-120 registers, no spills) at batch <= 64; batch > 64 keeps 128x128x64
    (215 registers, no spills; one block of 8 warps per SM either way).
    """
    if props is None:
        if on_interpreter():
            return MatmulConfig(block_m=16, block_n=32, block_k=64, split_k=1)
        props = device_props()
    if m <= 16:
        cfg = MatmulConfig(16, 64, 64, 1, 8, 4)
    elif m <= 64:
        cfg = MatmulConfig(64, 64, 64, 1, 8, 3)
    elif props.capability >= 90:
        cfg = MatmulConfig(128, 128, 64, 1, 8, 3)
    else:  # no wgmma: the accumulator stays in registers (128x128 spills 104 bytes on sm_80, 128x64: none)
        cfg = MatmulConfig(128, 64, 64, 1, 8, 3)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    split = 1
    while tiles * split < 2 * props.sm_count and k // (split * 2) >= 4 * cfg.block_k:  # fill the GPU on small grids
        split *= 2
    return MatmulConfig(cfg.block_m, cfg.block_n, cfg.block_k, split, cfg.num_warps, cfg.num_stages)


def _launch(x: torch.Tensor, w: torch.Tensor | None, form: PaletteForm | None, n: int, k: int,
            bias: torch.Tensor | None, config: MatmulConfig | None, out: torch.Tensor | None = None) -> torch.Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if out is not None:
        check_tensor(out, "out", dtype=(torch.bfloat16, torch.int16), shape=(*lead, n), device=x.device)
        out = out.view(torch.int16).view(m, n)
    else:
        out = torch.empty((m, n), dtype=torch.int16, device=x.device)
    if m == 0 or n == 0:
        return out.view(torch.bfloat16).view(*lead, n)
    if k == 0:  # an empty sum: the bias alone
        y = torch.zeros((m, n), dtype=torch.float32, device=x.device) + (bias.float() if bias is not None else 0)
        out.copy_(y.to(torch.bfloat16).view(torch.int16))
        return out.view(torch.bfloat16).view(*lead, n)
    cfg = config or default_config(m, n, k)
    if cfg.block_k % 16 or cfg.split_k < 1:
        raise KernelInputError(f"matmul config: block_k must be a multiple of 16 and split_k >= 1, got {cfg}")
    k_per_split = cdiv(cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = cdiv(k, k_per_split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    dummy8 = torch.zeros(1, dtype=torch.uint8, device=x.device)
    dummy64 = torch.zeros(1, dtype=torch.int64, device=x.device)
    if form is not None:
        vchunks, vexp = kernel_arrays(form)
        vstart = split_vstart(form, k_per_split, split)
        args = (dummy8, form.idx, form.sm, form.palette, vchunks, vexp, vstart, form.row_vstart)
        half_k, cpr, cs = form.idx.shape[1], form.layout.chunks_per_row, form.layout.chunk_size
    else:
        args = (w, dummy8, dummy8, dummy8, dummy64, dummy8, dummy64, dummy64)
        half_k, cpr, cs = 0, 1, 64
    grid = (cdiv(m, cfg.block_m), cdiv(n, cfg.block_n), split)
    _matmul_kernel[grid](
        x2, *args, bias if bias is not None else dummy8, out, part, m, n, k, half_k, cpr, k_per_split,
        W_PALETTE=form is not None, HAS_BIAS=bias is not None, SPLIT_K=split, CS=cs,
        NV_ITERS=cdiv(cfg.block_k, cs) + 1, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        DOT_F32=on_interpreter(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        _reduce_kernel[(cdiv(m * n, block),)](part, bias if bias is not None else dummy8, out, m, n,
                                              HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=block)
    return out.view(torch.bfloat16).view(*lead, n)


def _check_x(x: torch.Tensor, k: int) -> None:
    check_tensor(x, "x", dtype=torch.bfloat16)
    if x.dim() < 1 or x.shape[-1] != k:
        raise KernelInputError(f"x: expected last dimension {k} (the weight's in_features), got shape {tuple(x.shape)}")


def _check_bias(bias: torch.Tensor | None, n: int, device: torch.device) -> None:
    if bias is not None:
        check_tensor(bias, "bias", dtype=torch.bfloat16, shape=(n,), device=device)


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           config: MatmulConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T (+ bias) for bf16 x [..., K] and bf16 w [N, K]; the plain-weights twin of ``fused_matmul``."""
    check_tensor(w, "w", dtype=torch.bfloat16, ndim=2)
    n, k = w.shape
    _check_x(x, k)
    check_tensor(w, "w", device=x.device)
    _check_bias(bias, n, x.device)
    return _launch(x, w, None, n, k, bias, config, out)


def fused_matmul(x: torch.Tensor, form: PaletteForm, bias: torch.Tensor | None = None,
                 config: MatmulConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T (+ bias) with W [N, K] in palette form, decoded tile by tile in registers."""
    check_palette_form(form)
    if len(form.shape) != 2:
        raise KernelInputError(f"fused_matmul: the weight must be 2-D [out, in], got shape {form.shape}")
    n, k = form.shape
    _check_x(x, k)
    if form.device != x.device:
        raise KernelInputError(f"fused_matmul: x is on {x.device}, the weight on {form.device}")
    _check_bias(bias, n, x.device)
    return _launch(x, None, form, n, k, bias, config, out)
