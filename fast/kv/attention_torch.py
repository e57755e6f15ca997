"""Paged attention in plain torch: the CPU path.

Keys and values are gathered through the block tables into padded per-chunk tensors (one copy into
scratch buffers kept on the cache, which saves allocating and page-faulting megabytes per layer),
fp8 codes dequantized (times their block's power-of-two scale: exact), and positions past each
chunk's length are zeroed, so unused cache slots (which may hold anything, NaN included) never
reach a result.

* Decode (one token per chunk, all chunks in one call): with bf16 queries, two batched bf16 matrix
  products straight over the gathered blocks (see ``decode_attention``); with float32 queries, SDPA
  in float32. A decode step is memory-bound: what matters is reading K/V few times.
* Prefill: float32 SDPA per chunk of several tokens, with the mask ``key position <= query
  position`` (causal within the chunk, everything of the prefix); one-token chunks of a mixed step
  are batched as in decode.
Grouped-query attention folds each kv head's query heads into rows of that head, so K/V are never
repeated per query head. The output has q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fast.kv import fp8_torch as fp8
from fast.kv.cache import PagedKVCache
from fast.kv.step import KVStep


def _gather(cache: PagedKVCache, layer: int, tables: torch.Tensor, lens: torch.Tensor, max_len: int,
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K, V as ``dtype`` [B, kv_heads, L, D] contiguous, valid [B, L]) for L = max_len rounded up to whole blocks.

    K and V live in scratch buffers of the cache (valid until the next gather in that dtype).
    """
    width = -(-max_len // cache.block_size)
    tables = tables[:, :width]
    b = tables.shape[0]
    length = width * cache.block_size
    valid = torch.arange(length, device=tables.device)[None, :] < lens[:, None].to(torch.int64)
    bad = torch.nonzero(~valid.reshape(-1)).reshape(-1)  # few: the tails of last blocks, padded entries
    out = []
    for which in ("k", "v"):
        x = _gather_blocks(cache, layer, tables.reshape(-1), which)  # [B * W, bs, kv, D], a scratch copy
        x.view(b * length, cache.num_kv_heads, cache.head_dim).index_fill_(0, bad, 0.0)  # unused slots may
        # hold NaN, and 0 * NaN would poison the weighted sum: zero them before anything reads them
        heads = _scratch(cache, f"{which}.{dtype}", (b, cache.num_kv_heads, length, cache.head_dim), dtype)
        heads.view(b, cache.num_kv_heads, width, cache.block_size, cache.head_dim).copy_(
            x.view(b, width, cache.block_size, cache.num_kv_heads, cache.head_dim).permute(0, 3, 1, 2, 4))
        out.append(heads)
    return out[0], out[1], valid


def _gather_rows(cache: PagedKVCache, layer: int, tables: torch.Tensor, lens: torch.Tensor, max_len: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K, V as ``dtype`` [B, L, kv_heads * D], valid [B, L]) for L = max_len rounded up to whole blocks:
    the blocks as stored, one copy, with unused slots zeroed (scratch buffers of the cache)."""
    width = -(-max_len // cache.block_size)
    tables = tables[:, :width]
    b = tables.shape[0]
    length = width * cache.block_size
    valid = torch.arange(length, device=tables.device)[None, :] < lens[:, None].to(torch.int64)
    bad = torch.nonzero(~valid.reshape(-1)).reshape(-1)
    out = []
    for which in ("k", "v"):
        x = _gather_blocks(cache, layer, tables.reshape(-1), which, name=which)
        x = x.view(b, length, cache.num_kv_heads * cache.head_dim)
        x.view(b * length, -1).index_fill_(0, bad, 0.0)  # unused slots may hold NaN (0 * NaN = NaN)
        out.append(x if x.dtype == dtype else x.to(dtype))
    return out[0], out[1], valid


def _gather_blocks(cache: PagedKVCache, layer: int, blocks: torch.Tensor, which: str,
                   name: str = "blocks") -> torch.Tensor:
    """Copies of ``blocks`` (1-D ids) of layer's K or V: [len(blocks), block_size, kv, D], in the
    cache's dtype (fp8: dequantized to float32), in a scratch buffer kept on the cache.
    """
    store = (cache.k if which == "k" else cache.v)[layer]
    ids = blocks.to(torch.int64)
    shape = (len(ids), cache.block_size, cache.num_kv_heads, cache.head_dim)
    if cache.is_fp8:  # a 256-entry table lookup, then the power-of-two scales (exact)
        out = _scratch(cache, name + ".fp8", shape, torch.float32)
        codes = _scratch(cache, "codes", shape, torch.int32).copy_(store.index_select(0, ids))
        torch.index_select(fp8.decode_table_on(cache.device), 0, codes.view(-1), out=out.view(-1))
        exps = (cache.k_exp if which == "k" else cache.v_exp)[layer].index_select(0, ids)
        return out.mul_(fp8.exp2_int(exps)[:, None, :, None])
    return torch.index_select(store, 0, ids, out=_scratch(cache, name, shape, store.dtype))


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
    """q [B, H, D] (one token per chunk) -> [B, H, D] in q's dtype.

    Memory-bound: each sequence's K and V are read once, straight from the gathered blocks
    ([B, L, kv_heads * D], no per-head transpose). The queries become a block-diagonal matrix
    [B, H, kv_heads * D] (query head h of kv head j holds q in columns j*D .. j*D+D-1, zeros elsewhere),
    so one batched product gives every head's scores; the product with V gives, per head, its own
    kv head's block (the diagonal) and discarded cross terms. The extra products by zero are exact
    and cheap next to reading K/V. Matrix products take q's dtype as inputs (bf16 ones accumulate in
    float32 and round their result to bf16, like transformers' bf16 attention); the softmax is float32.
    """
    b, heads, d = q.shape
    kv = cache.num_kv_heads
    group = heads // kv
    if q.dtype == torch.float32:  # float32 batched products are slow on this CPU: SDPA, no products by zero
        k, v, valid = _gather(cache, layer, step.block_tables, step.seq_lens, step.max_seq_len, q.dtype)
        return _attend(q[:, :, None, :], k, v, valid[:, None, :], scale)[:, :, 0, :]
    k, v, valid = _gather_rows(cache, layer, step.block_tables, step.seq_lens, step.max_seq_len, q.dtype)
    q_diag = torch.zeros((b, kv, group, kv, d), dtype=q.dtype, device=q.device)
    q_diag.diagonal(dim1=1, dim2=3).copy_(q.reshape(b, kv, group, d).permute(0, 2, 3, 1))
    scores = torch.bmm(q_diag.view(b, heads, kv * d), k.transpose(1, 2)).float()  # [B, H, L]
    scores.mul_(scale).masked_fill_(~valid[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.bmm(weights, v).view(b, kv, group, kv, d).diagonal(dim1=1, dim2=3)  # [B, group, D, kv]
    return out.permute(0, 3, 1, 2).reshape(b, heads, d)


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
