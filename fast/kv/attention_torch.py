"""Paged attention in plain torch (gather + ``scaled_dot_product_attention``): the CPU path.

Keys and values are gathered through the block tables into padded per-chunk tensors (a copy, as
advanced indexing makes), dequantized to float32 (fp8 codes times their block's power-of-two scale:
exact), and positions past each chunk's length are zeroed, so unused cache slots (which may
hold anything, NaN included) never reach a result. Attention runs in float32 whatever the query
dtype; the output has q's dtype. Grouped-query attention folds each kv head's query heads into
rows of that head, so K/V are never repeated per query head.
Decode chunks (one token) are batched into one call; longer chunks run one call each, with the
mask ``key position <= query position`` (causal within the chunk, everything of the prefix).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fast.kv import fp8_torch as fp8
from fast.kv.cache import PagedKVCache
from fast.kv.step import KVStep


def _gather(cache: PagedKVCache, layer: int, tables: torch.Tensor, lens: torch.Tensor,
            max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K, V as float32 [B, kv_heads, L, D], valid [B, L]) for L = max_len rounded up to whole blocks."""
    width = -(-max_len // cache.block_size)
    tables = tables[:, :width]
    b = tables.shape[0]
    length = width * cache.block_size
    valid = torch.arange(length, device=tables.device)[None, :] < lens[:, None].to(torch.int64)
    bad = torch.nonzero(~valid.reshape(-1)).reshape(-1)  # few: the tails of last blocks, padded entries
    out = []
    for which in ("k", "v"):
        x = _gather_blocks(cache, layer, tables.reshape(-1), which)  # a fresh copy, [B * W, bs, kv, D]
        x = x.reshape(b * length, cache.num_kv_heads, cache.head_dim)
        x.index_fill_(0, bad, 0.0)  # unused slots may hold NaN: 0 * NaN would poison the weighted sum
        out.append(x.reshape(b, length, cache.num_kv_heads, cache.head_dim).transpose(1, 2))
    return out[0], out[1], valid


def _gather_blocks(cache: PagedKVCache, layer: int, blocks: torch.Tensor, which: str) -> torch.Tensor:
    """float32 copies of ``blocks`` (1-D ids) of layer's K or V: [len(blocks), block_size, kv, D].

    The result lives in a scratch buffer kept on the cache (valid until the next gather of the same
    tensor), which saves allocating, and page-faulting in, megabytes per layer.
    """
    store = (cache.k if which == "k" else cache.v)[layer]
    ids = blocks.to(torch.int64)
    shape = (len(ids), cache.block_size, cache.num_kv_heads, cache.head_dim)
    out = _scratch(cache, which + "32", shape, torch.float32)
    if cache.is_fp8:  # a 256-entry table lookup, then the power-of-two scales (exact)
        codes = _scratch(cache, "codes", shape, torch.int32).copy_(store.index_select(0, ids))
        torch.index_select(fp8.decode_table_on(cache.device), 0, codes.view(-1), out=out.view(-1))
        exps = (cache.k_exp if which == "k" else cache.v_exp)[layer].index_select(0, ids)
        return out.mul_(fp8.exp2_int(exps)[:, None, :, None])
    if store.dtype == torch.float32:
        return torch.index_select(store, 0, ids, out=out)
    return out.copy_(torch.index_select(store, 0, ids, out=_scratch(cache, which + "16", shape, store.dtype)))


def _scratch(cache: PagedKVCache, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` carved from a buffer on the cache that only ever grows."""
    buffers = cache.scratch
    n = 1
    for size in shape:
        n *= size
    buf = buffers.get(name)
    if buf is None or buf.numel() < n:
        buf = buffers[name] = torch.empty(n, dtype=dtype, device=cache.device)
    return buf[:n].view(shape)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention without repeating K/V: q [B, H, n, D], k/v [B, kv, L, D], mask [B, n, L].

    The GROUP query heads sharing a kv head become GROUP * n query rows of that kv head, so SDPA
    runs as plain multi-head attention over kv heads. Returns float32 [B, H, n, D].
    """
    b, heads, n, d = q.shape
    kv = k.shape[1]
    group = heads // kv
    qg = q.to(torch.float32).reshape(b, kv, group * n, d)
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device).masked_fill_(~mask, float("-inf"))
    if n == 1:  # one row per query head: the same mask for all of them, broadcast
        bias = bias[:, None]
    else:
        bias = bias[:, None, None].expand(b, 1, group, n, mask.shape[-1]).reshape(b, 1, group * n, mask.shape[-1])
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=scale)
    return out.reshape(b, heads, n, d)


def decode_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, step: KVStep, scale: float) -> torch.Tensor:
    """q [B, H, D] (one token per chunk) -> [B, H, D] in q's dtype."""
    k, v, valid = _gather(cache, layer, step.block_tables, step.seq_lens, step.max_seq_len)
    out = _attend(q[:, :, None, :], k, v, valid[:, None, :], scale)
    return out[:, :, 0, :].to(q.dtype)


def prefill_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, step: KVStep, scale: float) -> torch.Tensor:
    """q [T, H, D] for the step's chunks concatenated -> [T, H, D] in q's dtype."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    offsets = [0]
    for n in step.query_lens:
        offsets.append(offsets[-1] + n)
    single = [i for i, n in enumerate(step.query_lens) if n == 1]
    if single:
        idx = torch.tensor(single, device=q.device)
        rows = torch.tensor([offsets[i] for i in single], device=q.device)
        k, v, valid = _gather(cache, layer, step.block_tables[idx], step.seq_lens[idx],
                              max(step.starts[i] + 1 for i in single))
        out[rows] = _attend(q[rows][:, :, None, :], k, v, valid[:, None, :], scale)[:, :, 0, :].to(q.dtype)
    for i, n in enumerate(step.query_lens):
        if n == 1:
            continue
        start = step.starts[i]
        k, v, _ = _gather(cache, layer, step.block_tables[i:i + 1], step.seq_lens[i:i + 1], start + n)
        key_pos = torch.arange(k.shape[2], device=q.device)
        query_pos = start + torch.arange(n, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # also excludes every position past the chunk
        qi = q[offsets[i]:offsets[i] + n].transpose(0, 1)[None]  # [1, H, n, D]
        out[offsets[i]:offsets[i] + n] = _attend(qi, k, v, mask[None], scale)[0].transpose(0, 1).to(q.dtype)
    return out
