"""Paged attention kernels: decode (one query token per sequence, GQA heads packed) and prefill
(variable-length chunks with a cached prefix). fp8 caches are dequantized inside the kernel.

Both walk a sequence's block table one cache block at a time with an online softmax (running max,
running sum, rescaled accumulator) in float32. Positions at or past a chunk's length are masked at
the load (never read), so whatever unused slots hold, NaN included, cannot reach the output.

* decode: one program per (sequence, kv head). The GROUP query heads that share the kv head form
  the rows of the tile, so each K/V block is read once for the whole group (the point of GQA at
  decode, where attention is bound by memory). Products are broadcast-multiply-and-sum: group sizes
  (often 3-8) are too small for ``tl.dot``.
* prefill: one program per (chunk, tile of BLOCK_M query tokens, query head); scores and the
  weighted sum by ``tl.dot`` in IEEE float32 (``input_precision="ieee"``: no TF32). A tile stops
  reading at its last query's position (causal), so a chunk reads only its prefix and itself.

Conformance level: bounded against float64 (``conformance/cases/kv_cases.py`` states the bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.bf16 import bf16_bits_rne
from fast.errors import KernelInputError
from fast.kv.fp8_triton import decode_e4m3
from fast.triton_util import DeviceProps, check_kernel_device, device_props, next_pow2


@triton.jit
def _load_block(store_ptr, exp_ptr, block, kv_head, pos_in_block, valid, d, IS_FP8: tl.constexpr,
                HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """float32 [positions, D_P2] of one cache block for one kv head; invalid rows and padded columns are 0."""
    mask = valid[:, None] & (d[None, :] < DIM)
    ptrs = store_ptr + ((block * BLOCK_SIZE + pos_in_block[:, None]) * HEADS + kv_head) * DIM + d[None, :]
    if IS_FP8:
        codes = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        x = decode_e4m3(codes, tl.load(exp_ptr + block * HEADS + kv_head).to(tl.int32))
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, x, 0.0)


@triton.jit
def _store(ptrs, x, mask, OUT_BF16: tl.constexpr):
    """Store float32 x; into a bf16 output (seen as int16) by integer round-to-nearest-even, not a cast."""
    if OUT_BF16:
        tl.store(ptrs, bf16_bits_rne(x).to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, x, mask=mask)


@triton.jit
def _softmax_step(m_i, l_i, scores):
    """One online-softmax update: the new running max, the factor rescaling old sums, the new weights, the new sum."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _decode_kernel(q_ptr, out_ptr, k_ptr, v_ptr, kexp_ptr, vexp_ptr, tables_ptr, seq_lens_ptr, table_stride,
                   scale, part_m_ptr, part_l_ptr, part_acc_ptr, blocks_per_split, IS_FP8: tl.constexpr,
                   OUT_BF16: tl.constexpr, SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr, HEADS: tl.constexpr,
                   GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, G_P2: tl.constexpr,
                   D_P2: tl.constexpr, BS_P2: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, G_P2)
    d = tl.arange(0, D_P2)
    s = tl.arange(0, BS_P2)
    q_rows = (b * HEADS * GROUP + kv_head * GROUP + g) * DIM  # query heads kv_head*GROUP .. +GROUP-1
    q_mask = (g[:, None] < GROUP) & (d[None, :] < DIM)
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + b)
    m_i = tl.full((G_P2,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_P2,), tl.float32)
    acc = tl.zeros((G_P2, D_P2), tl.float32)
    first = split * blocks_per_split
    for j in range(first, tl.minimum(first + blocks_per_split, tl.cdiv(seq_len, BLOCK_SIZE))):
        block = tl.load(tables_ptr + b * table_stride + j).to(tl.int64)
        pos = j * BLOCK_SIZE + s
        valid = (s < BLOCK_SIZE) & (pos < seq_len)
        k = _load_block(k_ptr, kexp_ptr, block, kv_head, s, valid, d, IS_FP8, HEADS, DIM, BLOCK_SIZE)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BS]
        m_i, alpha, p, l_i = _softmax_step(m_i, l_i, tl.where(valid[None, :], scores, float("-inf")))
        v = _load_block(v_ptr, vexp_ptr, block, kv_head, s, valid, d, IS_FP8, HEADS, DIM, BLOCK_SIZE)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    if SPLIT:  # partial results of this split (an empty split leaves m = -inf, l = 0, acc = 0)
        part = (b * (HEADS * NUM_SPLITS) + kv_head * NUM_SPLITS + split) * G_P2
        tl.store(part_m_ptr + part + g, m_i)
        tl.store(part_l_ptr + part + g, l_i)
        tl.store(part_acc_ptr + (part + g[:, None]) * D_P2 + d[None, :], acc)
    else:
        _store(out_ptr + q_rows[:, None] + d[None, :], acc / l_i[:, None], q_mask, OUT_BF16)


@triton.jit
def _combine_kernel(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, OUT_BF16: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    HEADS: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr, G_P2: tl.constexpr,
                    D_P2: tl.constexpr):
    """Merge the splits of one (sequence, kv head): weights exp(m_split - max m) rescale sums and accumulators."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, G_P2)
    d = tl.arange(0, D_P2)
    base = (b * HEADS + kv_head) * NUM_SPLITS * G_P2
    m = tl.full((G_P2,), float("-inf"), tl.float32)
    for i in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(part_m_ptr + base + i * G_P2 + g))
    total = tl.zeros((G_P2,), tl.float32)
    acc = tl.zeros((G_P2, D_P2), tl.float32)
    for i in range(NUM_SPLITS):
        w = tl.exp(tl.load(part_m_ptr + base + i * G_P2 + g) - m)  # 0 for an empty split
        total += w * tl.load(part_l_ptr + base + i * G_P2 + g)
        acc += w[:, None] * tl.load(part_acc_ptr + (base + i * G_P2 + g[:, None]) * D_P2 + d[None, :])
    q_rows = (b * HEADS * GROUP + kv_head * GROUP + g) * DIM
    _store(out_ptr + q_rows[:, None] + d[None, :], acc / total[:, None], (g[:, None] < GROUP) & (d[None, :] < DIM),
           OUT_BF16)


@triton.jit
def _prefill_kernel(q_ptr, out_ptr, k_ptr, v_ptr, kexp_ptr, vexp_ptr, tables_ptr, query_starts_ptr,
                    context_lens_ptr, table_stride, scale, IS_FP8: tl.constexpr, OUT_BF16: tl.constexpr,
                    HEADS: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, D_P2: tl.constexpr):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_starts_ptr + b)
    n = tl.load(query_starts_ptr + b + 1) - q_start
    if tile * BLOCK_M < n:
        context = tl.load(context_lens_ptr + b)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n
        d = tl.arange(0, D_P2)
        s = tl.arange(0, BLOCK_SIZE)
        q_ptrs = q_ptr + ((q_start + rows[:, None]) * HEADS * GROUP + head) * DIM + d[None, :]
        q_mask = row_ok[:, None] & (d[None, :] < DIM)
        q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)
        query_pos = context + rows  # rows past the chunk are never stored
        last = context + tl.minimum(tile * BLOCK_M + BLOCK_M, n)  # keys [0, last) can matter to this tile
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D_P2), tl.float32)
        for j in range(0, tl.cdiv(last, BLOCK_SIZE)):
            block = tl.load(tables_ptr + b * table_stride + j).to(tl.int64)
            key_pos = j * BLOCK_SIZE + s
            valid = key_pos < last
            k = _load_block(k_ptr, kexp_ptr, block, kv_head, s, valid, d, IS_FP8, HEADS, DIM, BLOCK_SIZE)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_SIZE]
            allowed = valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
            m_i, alpha, p, l_i = _softmax_step(m_i, l_i, tl.where(allowed, scores, float("-inf")))
            v = _load_block(v_ptr, vexp_ptr, block, kv_head, s, valid, d, IS_FP8, HEADS, DIM, BLOCK_SIZE)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        o_ptrs = out_ptr + ((q_start + rows[:, None]) * HEADS * GROUP + head) * DIM + d[None, :]
        _store(o_ptrs, acc / l_i[:, None], q_mask, OUT_BF16)


def _common(q: torch.Tensor, cache, layer: int, step) -> tuple:
    for name, t in (("q", q), ("block_tables", step.block_tables), ("cache", cache.k[layer])):
        check_kernel_device(t, name)
    if step.block_tables.dtype != torch.int32 or step.block_tables.stride(1) != 1:
        raise KernelInputError("step.block_tables must be int32 with contiguous rows")
    q = q.contiguous()
    k, v = cache.k[layer], cache.v[layer]
    kexp, vexp = (cache.k_exp[layer], cache.v_exp[layer]) if cache.is_fp8 else (k, v)  # unused unless fp8
    out = torch.empty_like(q)
    return q, out.view(torch.int16) if out.dtype == torch.bfloat16 else out, k, v, kexp, vexp


def num_splits_for(batch: int, kv_heads: int, max_blocks: int, device: torch.device | DeviceProps) -> int:
    """How many parts to split each sequence's blocks into, so that a small batch still fills the GPU.

    Aims at two programs per streaming multiprocessor, with at least 8 blocks (128 tokens at block
    size 16) per part; 1 for a non-CUDA device (the interpreter: pass ``num_splits`` to test
    splitting there). A pure function of the shapes and the GPU's properties (pass a ``DeviceProps``).
    """
    if isinstance(device, DeviceProps):
        props = device
    elif device.type != "cuda":
        return 1
    else:
        props = device_props(device)
    programs = 2 * props.sm_count
    return max(1, min(-(-programs // max(1, batch * kv_heads)), max_blocks // 8, 64))


def decode_attention(q: torch.Tensor, cache, layer: int, step, scale: float,
                     num_splits: int | None = None) -> torch.Tensor:
    """The decode kernel; arguments as ``fast.kv.ops.decode_attention`` (already checked there).

    With ``num_splits`` > 1 (default: ``num_splits_for``) each sequence's blocks are cut into that
    many parts run by separate programs (split-KV, "flash decoding"), merged by a second kernel.
    """
    q, out, k, v, kexp, vexp = _common(q, cache, layer, step)
    heads, group = cache.num_kv_heads, q.shape[1] // cache.num_kv_heads
    batch, bs = step.num_chunks, cache.block_size
    max_blocks = -(-step.max_seq_len // bs)
    if num_splits is None:
        num_splits = num_splits_for(batch, heads, max_blocks, q.device)
    num_splits = max(1, min(int(num_splits), max_blocks))
    per_split = -(-max_blocks // num_splits)
    g_p2, d_p2 = next_pow2(group), next_pow2(cache.head_dim)
    split = num_splits > 1
    part_shape = (batch, heads, num_splits, g_p2) if split else (1,)
    part_m = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_l = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_acc = torch.empty((*part_shape, d_p2) if split else (1,), dtype=torch.float32, device=q.device)
    consts = {"OUT_BF16": q.dtype == torch.bfloat16, "NUM_SPLITS": num_splits, "HEADS": heads, "GROUP": group,
              "DIM": cache.head_dim, "G_P2": g_p2, "D_P2": d_p2}
    _decode_kernel[(batch, heads, num_splits)](
        q, out, k, v, kexp, vexp, step.block_tables, step.seq_lens, step.block_tables.stride(0), scale,
        part_m, part_l, part_acc, per_split, IS_FP8=cache.is_fp8, SPLIT=split, BLOCK_SIZE=bs,
        BS_P2=next_pow2(bs), num_warps=decode_num_warps(g_p2, next_pow2(bs), d_p2), **consts)
    if split:
        _combine_kernel[(batch, heads)](out, part_m, part_l, part_acc, **consts)
    return out.view(q.dtype)


def decode_num_warps(g_p2: int, bs_p2: int, d_p2: int) -> int:
    """Warps per decode program: 16 once a block step's broadcast products [G, BS, D] reach 8192.

    At Llama-8B's 4 x 16 x 128 with float32 queries, 4 and 8 warps leave ptxas (sm_90) at 128
    registers with 16-24 bytes of spills per thread (triton 3.9 at 4 warps, 3.6 at 8 with an fp8
    cache); 16 warps: 78-105 registers, no spills, the same occupancy (``python -m conformance --compile``).
    """
    return 16 if g_p2 * bs_p2 * d_p2 >= 8192 else 4


def prefill_block_m(head_dim: int, props: DeviceProps | None = None) -> int:
    """Query rows per prefill program: a pure function of the head size (and the GPU, unused so far)."""
    return 16


def prefill_num_warps(block_m: int, head_dim: int) -> int:
    """Warps per prefill program for a [block_m, head_dim] tile.

    The IEEE float32 dots run on FMA units, each thread holding a share of q, k, v and the
    accumulator: at [16, 128] with 4 warps that is 255 registers and ~600 bytes of spills per
    thread on sm_90; 8 warps bring it to 166 registers, no spills (``python -m conformance --compile``).
    """
    return 8 if block_m * next_pow2(head_dim) >= 2048 else 4


def prefill_attention(q: torch.Tensor, cache, layer: int, step, scale: float,
                      block_m: int | None = None) -> torch.Tensor:
    """The prefill kernel; arguments as ``fast.kv.ops.prefill_attention`` (already checked there).

    Needs a block size that is a power of two >= 16 (``tl.dot`` tile sizes on a GPU). ``block_m``
    (query rows per program) defaults to ``prefill_block_m``.
    """
    bs = cache.block_size
    if bs < 16 or bs & (bs - 1):
        raise KernelInputError(f"the Triton prefill kernel needs block_size a power of two >= 16, got {bs}; "
                               "use backend='torch' for this cache")
    q, out, k, v, kexp, vexp = _common(q, cache, layer, step)
    heads, group = cache.num_kv_heads, q.shape[1] // cache.num_kv_heads
    block_m = block_m or prefill_block_m(cache.head_dim)
    grid = (step.num_chunks, -(-step.max_query_len // block_m), q.shape[1])
    _prefill_kernel[grid](
        q, out, k, v, kexp, vexp, step.block_tables, step.query_starts, step.context_lens,
        step.block_tables.stride(0), scale, IS_FP8=cache.is_fp8, OUT_BF16=q.dtype == torch.bfloat16, HEADS=heads,
        GROUP=group, DIM=cache.head_dim, BLOCK_SIZE=bs, BLOCK_M=block_m, D_P2=max(16, next_pow2(cache.head_dim)),
        num_warps=prefill_num_warps(block_m, cache.head_dim))
    return out.view(q.dtype)
