"""Write-to-cache kernels: new K/V tokens into their slots, with fp8 quantization by the reference's rule.

For an fp8 cache one write is three launches per tensor (K, then V), because the four rules of
``reference/kv/fp8.py`` have an order: a block's scale must be final, and the codes already in the
block re-encoded, before new codes land in it.

1. ``_row_exponent_kernel`` (one program per token): each kv head's scale exponent of its finite amax.
   torch then reduces per block (``scatter_reduce`` "amax", no host sync): e_new = max(e_old, rows'),
   with e_old = -126 for a block written at offset 0 (rule 1).
2. ``_rescale_kernel`` (one program per token and head; only the block's first token in ``slots``
   acts): zeroes a fresh block, or re-encodes its codes when its scale grew (rules 1, 3); stores e_new.
3. ``_encode_kernel`` (one program per token): encodes the token with its block's e_new (rule 4).
Bookkeeping tensors are [num_blocks] or [num_blocks, kv_heads] int32 per call: small next to K/V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.bf16 import bf16_bits_rne
from fast.errors import KernelInputError
from fast.kv.fp8_triton import decode_e4m3, encode_e4m3, scale_exponent
from fast.triton_util import check_kernel_device, next_pow2


@triton.jit
def _row_exponent_kernel(x_ptr, out_ptr, HEADS: tl.constexpr, DIM: tl.constexpr, H_P2: tl.constexpr,
                         D_P2: tl.constexpr):
    i = tl.program_id(0)
    h = tl.arange(0, H_P2)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    mask = (h < HEADS) & (d < DIM)
    x = tl.load(x_ptr + i * HEADS * DIM + h * DIM + d, mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    a = tl.where(a < float("inf"), a, 0.0)  # drops inf and NaN (NaN < inf is false)
    e = scale_exponent(tl.max(a, axis=1))
    hs = tl.arange(0, H_P2)
    tl.store(out_ptr + i * HEADS + hs, e, mask=hs < HEADS)


@triton.jit
def _rescale_kernel(codes_ptr, exps_ptr, new_ptr, fresh_ptr, owner_ptr, slots_ptr, BLOCK_SIZE: tl.constexpr,
                    HEADS: tl.constexpr, DIM: tl.constexpr, BS_P2: tl.constexpr, D_P2: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    block = tl.load(slots_ptr + i) // BLOCK_SIZE
    if tl.load(owner_ptr + block) == i:  # one program per touched block does the block's work
        fresh = tl.load(fresh_ptr + block) != 0
        old = tl.where(fresh, -126, tl.load(exps_ptr + block * HEADS + h).to(tl.int32))
        new = tl.load(new_ptr + block * HEADS + h)
        if fresh | (new > old):  # (bitwise: runtime scalars, as compiled Triton wants them)
            s = tl.arange(0, BS_P2)[:, None]
            d = tl.arange(0, D_P2)[None, :]
            mask = (s < BLOCK_SIZE) & (d < DIM)
            ptrs = codes_ptr + ((block * BLOCK_SIZE + s) * HEADS + h) * DIM + d
            c = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
            c = encode_e4m3(decode_e4m3(c, old), new)
            c = tl.where(fresh, 0, c)
            tl.store(ptrs, c.to(tl.uint8), mask=mask)
        tl.store(exps_ptr + block * HEADS + h, new.to(tl.int8))


@triton.jit
def _encode_kernel(x_ptr, codes_ptr, new_ptr, slots_ptr, BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr,
                   DIM: tl.constexpr, H_P2: tl.constexpr, D_P2: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i)
    h = tl.arange(0, H_P2)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    mask = (h < HEADS) & (d < DIM)
    x = tl.load(x_ptr + i * HEADS * DIM + h * DIM + d, mask=mask, other=0.0).to(tl.float32)
    e = tl.load(new_ptr + (slot // BLOCK_SIZE) * HEADS + h, mask=h < HEADS, other=0)
    tl.store(codes_ptr + slot * HEADS * DIM + h * DIM + d, encode_e4m3(x, e).to(tl.uint8), mask=mask)


@triton.jit
def _copy_kernel(x_ptr, store_ptr, slots_ptr, ROW: tl.constexpr, ROW_P2: tl.constexpr, TO_BF16: tl.constexpr):
    """Row i of x into row slots[i] of the store; TO_BF16: float32 -> bf16 bits by integer RNE (no cast)."""
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i)
    r = tl.arange(0, ROW_P2)
    x = tl.load(x_ptr + i * ROW + r, mask=r < ROW)
    if TO_BF16:
        x = bf16_bits_rne(x).to(tl.int16)
    tl.store(store_ptr + slot * ROW + r, x, mask=r < ROW)


def write(cache, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What ``PagedKVCache.write`` does, on the Triton kernels (``ops.write_kv`` has checked shapes, dtypes
    and devices)."""
    n = slots.shape[0]
    if n == 0:
        return
    for name, t in (("slots", slots), ("k", k), ("v", v)):
        check_kernel_device(t, name)
    heads, dim, bs = cache.num_kv_heads, cache.head_dim, cache.block_size
    for x, store, exps in ((k, cache.k[layer], cache.k_exp), (v, cache.v[layer], cache.v_exp)):
        x = x.contiguous()
        if not cache.is_fp8:
            to_bf16 = store.dtype == torch.bfloat16 and x.dtype == torch.float32
            if store.dtype == torch.bfloat16:
                store = store.view(torch.int16)
                x = x if to_bf16 else x.view(torch.int16)
            else:
                x = x.to(torch.float32)  # exact from bf16
            _copy_kernel[(n,)](x, store, slots, ROW=heads * dim, ROW_P2=next_pow2(heads * dim), TO_BF16=to_bf16)
            continue
        exps = exps[layer]
        blocks = slots // bs
        fresh = torch.zeros(cache.num_blocks, dtype=torch.int32, device=slots.device)
        fresh.scatter_reduce_(0, blocks, (slots % bs == 0).to(torch.int32), "amax")
        owner = torch.full((cache.num_blocks,), n, dtype=torch.int64, device=slots.device)
        owner.scatter_reduce_(0, blocks, torch.arange(n, device=slots.device), "amin")
        rows = torch.empty((n, heads), dtype=torch.int32, device=slots.device)
        _row_exponent_kernel[(n,)](x, rows, HEADS=heads, DIM=dim, H_P2=next_pow2(heads), D_P2=next_pow2(dim))
        new = torch.where(fresh[:, None] != 0, -126, exps.to(torch.int32))
        new.scatter_reduce_(0, blocks[:, None].expand(n, heads), rows, "amax")
        _rescale_kernel[(n, heads)](store, exps, new, fresh, owner, slots, BLOCK_SIZE=bs, HEADS=heads, DIM=dim,
                                    BS_P2=next_pow2(bs), D_P2=next_pow2(dim))
        _encode_kernel[(n,)](x, store, new, slots, BLOCK_SIZE=bs, HEADS=heads, DIM=dim, H_P2=next_pow2(heads),
                             D_P2=next_pow2(dim))


@triton.jit
def _encode_elementwise_kernel(x_ptr, e_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    e = tl.load(e_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, encode_e4m3(x, e).to(tl.uint8), mask=mask)


def encode_codes(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes of float32 ``x / 2^e`` elementwise (``e``: int32, same shape) by the Triton encoder."""
    check_kernel_device(x, "x")
    if x.dtype != torch.float32 or e.dtype != torch.int32 or x.shape != e.shape:
        raise KernelInputError(f"encode_codes needs float32 x and int32 e of one shape, got {x.dtype} "
                               f"{tuple(x.shape)} and {e.dtype} {tuple(e.shape)}")
    x, e = x.contiguous(), e.contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    n = x.numel()
    if n:
        _encode_elementwise_kernel[(triton.cdiv(n, 1024),)](x, e, out, n, BLOCK=1024)
    return out
