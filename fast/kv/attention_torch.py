"""Paged attention in plain torch (gather + ``scaled_dot_product_attention``): the CPU path.

Keys and values are gathered through the block tables into padded per-chunk tensors, dequantized
to float32 (fp8 codes times their block's power-of-two scale: exact), and positions past each
chunk's length are zeroed, so unused cache slots (which may hold anything, NaN included) never
reach a result. Attention runs in float32 whatever the query dtype; the output has q's dtype.
Decode chunks (one token) are batched into one call; longer chunks run one call each, with the
mask ``key position <= query position`` (causal within the chunk, everything of the prefix).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    out = []
    for which in ("k", "v"):
        x = cache.blocks_as_float(layer, tables, which).reshape(b, length, cache.num_kv_heads, cache.head_dim)
        x = torch.where(valid[:, :, None, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
        out.append(x.transpose(1, 2))
    return out[0], out[1], valid


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, n, D], k/v [B, kv, L, D], mask [B, 1, n, L] (True = attend) -> [B, H, n, D] float32."""
    return F.scaled_dot_product_attention(q.to(torch.float32), k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def decode_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, step: KVStep, scale: float) -> torch.Tensor:
    """q [B, H, D] (one token per chunk) -> [B, H, D] in q's dtype."""
    k, v, valid = _gather(cache, layer, step.block_tables, step.seq_lens, step.max_seq_len)
    out = _sdpa(q[:, :, None, :], k, v, valid[:, None, None, :], scale)
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
        lens = step.seq_lens[idx]
        k, v, valid = _gather(cache, layer, step.block_tables[idx], lens, max(step.starts[i] + 1 for i in single))
        out[rows] = _sdpa(q[rows][:, :, None, :], k, v, valid[:, None, None, :], scale)[:, :, 0, :].to(q.dtype)
    for i, n in enumerate(step.query_lens):
        if n == 1:
            continue
        start = step.starts[i]
        k, v, _ = _gather(cache, layer, step.block_tables[i:i + 1], step.seq_lens[i:i + 1], start + n)
        key_pos = torch.arange(k.shape[2], device=q.device)
        query_pos = start + torch.arange(n, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # also excludes every position past the chunk
        qi = q[offsets[i]:offsets[i] + n].transpose(0, 1)[None]  # [1, H, n, D]
        out[offsets[i]:offsets[i] + n] = _sdpa(qi, k, v, mask[None, None], scale)[0].transpose(0, 1).to(q.dtype)
    return out
