"""Paged attention in plain torch: the CPU path.

Keys and values are gathered through the block tables into padded tensors (one copy into scratch
buffers kept on the cache, which saves allocating and page-faulting megabytes per layer), fp8
codes dequantized (times their block's power-of-two scale: exact), and positions past each
chunk's length are zeroed, so unused cache slots (which may hold anything, NaN included) never
reach a result.

* bf16 queries on a bf16 cache, on a CPU with AVX-512: the C kernel of ``fast/kv/attention_c.py``,
  for every row of a step (decode rows, and each row of a prefill chunk up to its own position), which
  reads each sequence's blocks in place (no gather, no padding); 2-6x faster than what follows, which
  remains the path for every other case (and with ``UNFIRE_NATIVE_ATTENTION=0``).
* Otherwise chunks of one token run in batches:
  sequences of similar length together (``length_groups``), so little is padded. With bf16
  queries a batch is two batched bf16 matrix products straight over the gathered blocks (see
  ``_decode_bf16``); with float32 queries, float32 SDPA. Decode is memory-bound: what matters is
  reading K/V few times.
* Longer chunks (prefill) run one at a time with the mask ``key position <= query position``
  (causal within the chunk, everything of the prefix): with bf16 queries as bf16 matrix products per
  kv head (``_chunk_bf16``), with float32 queries one float32 SDPA call.
Grouped-query attention folds each kv head's query heads into rows of that head, so K/V are never
repeated per query head. The output has q's dtype. What is derived from the step alone (batches,
masks) is computed once per step and kept in ``step.memo`` for every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fast.kv import attention_c
from fast.kv import fp8_torch as fp8
from fast.kv.cache import PagedKVCache
from fast.kv.step import KVStep

# A batch's fixed cost per layer (about a dozen small torch calls), in padded key positions' worth of
# work. Estimated from a profile on this project's 2-core EPYC (bf16, 60 sequences): ~0.1 ms of fixed
# calls per batch and layer against ~0.2 us per padded position.
BATCH_COST_POSITIONS = 512


@dataclass(frozen=True)
class _Batch:
    """Sequences of ``width`` blocks at most whose attention runs together (padded to ``width``)."""

    rows: torch.Tensor  # int64 [n]: their rows in the step's queries
    blocks: torch.Tensor  # int64 [n * width]: each one's first ``width`` block ids (padding past its table)
    bad: torch.Tensor  # int64: flat positions in [0, n * width * block_size) past each one's length
    valid: torch.Tensor  # bool [n, width * block_size]
    width: int
    bias: torch.Tensor  # float32 [n, 1, width * block_size]: 0 where valid, -inf past each one's length


def length_groups(lengths: list[int], block_size: int, cost: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` in groups (shortest first) minimising the padded positions (each member
    padded to its group's longest, in whole blocks) plus ``cost`` per group (default
    ``BATCH_COST_POSITIONS``): exact dynamic programming over the distinct widths in blocks (with
    more than 64 widths, only 64 evenly spaced ones are candidate cuts)."""
    if not lengths:
        return []
    cost = BATCH_COST_POSITIONS if cost is None else cost
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    blocks = [-(-lengths[i] // block_size) for i in order]
    widths = sorted(set(blocks))
    if len(widths) > 64:
        widths = sorted({widths[round(j * (len(widths) - 1) / 63)] for j in range(64)})
    counts = [0] * len(widths)  # counts[j]: sequences padded to widths[j] if a group ends there
    j = 0
    for w in blocks:
        while w > widths[j]:
            j += 1
        counts[j] += 1
    best = [0.0] + [float("inf")] * len(widths)  # best[e]: cheapest split of the first e widths' sequences
    cut = [0] * (len(widths) + 1)
    for end in range(1, len(widths) + 1):
        n = 0
        for start in range(end, 0, -1):
            n += counts[start - 1]
            c = best[start - 1] + n * widths[end - 1] * block_size + cost
            if c < best[end]:
                best[end], cut[end] = c, start - 1
    groups, end, stop = [], len(widths), len(order)
    while end > 0:
        size = sum(counts[cut[end]:end])
        groups.append(order[stop - size:stop])
        stop, end = stop - size, cut[end]
    return groups[::-1]


def _batches(step: KVStep, chunks: list[int], rows: list[int], device: torch.device) -> list[_Batch]:
    """One-token ``chunks`` of ``step`` (query rows ``rows``) as length-grouped batches. The host
    lengths (``starts``) size and group them; the device ``seq_lens`` say which positions are read
    (a CUDA-graph step's host lengths are only an upper bound)."""
    bs = step.block_size
    lengths = [step.starts[c] + 1 for c in chunks]
    out = []
    for group in length_groups(lengths, bs):
        width = -(-max(lengths[i] for i in group) // bs)
        members = torch.tensor([chunks[i] for i in group], dtype=torch.int64, device=device)
        lens = step.seq_lens.index_select(0, members).to(torch.int64)
        valid = torch.arange(width * bs, device=device)[None, :] < lens[:, None]
        out.append(_Batch(rows=torch.tensor([rows[i] for i in group], dtype=torch.int64, device=device),
                          blocks=step.block_tables[members, :width].reshape(-1).to(torch.int64),
                          bad=torch.nonzero(~valid.reshape(-1)).reshape(-1), valid=valid, width=width,
                          bias=_bias(valid)))
    return out


def _chunk_batch(step: KVStep, i: int, device: torch.device) -> _Batch:
    """Chunk ``i`` alone (a prefill chunk): its blocks up to its last new token."""
    length = step.starts[i] + step.query_lens[i]
    width = -(-length // step.block_size)
    valid = torch.arange(width * step.block_size, device=device)[None, :] < length
    return _Batch(rows=torch.zeros(0, dtype=torch.int64, device=device),
                  blocks=step.block_tables[i, :width].to(torch.int64),
                  bad=torch.nonzero(~valid.reshape(-1)).reshape(-1), valid=valid, width=width, bias=_bias(valid))


def _bias(valid: torch.Tensor) -> torch.Tensor:
    """0 where ``valid`` [n, L], -inf elsewhere, as float32 [n, 1, L] (added to scores before the softmax)."""
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    return bias.masked_fill_(~valid, float("-inf"))[:, None, :]


def _gather_rows(cache: PagedKVCache, layer: int, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a batch as [n, L, kv_heads * D] in the cache's dtype (fp8: float32): the blocks as
    stored, one copy into scratch buffers. Unused slots of both are zeroed: they may hold NaN or inf,
    and neither a zero weight times NaN nor NaN plus a -inf mask is zero."""
    n, length = batch.valid.shape
    shape = (n, length, cache.num_kv_heads * cache.head_dim)
    k = _gather_blocks(cache, layer, batch.blocks, "k").view(shape)
    v = _gather_blocks(cache, layer, batch.blocks, "v").view(shape)
    if batch.bad.numel():
        k.view(n * length, -1).index_fill_(0, batch.bad, 0.0)
        v.view(n * length, -1).index_fill_(0, batch.bad, 0.0)
    return k, v


def _gather_heads(cache: PagedKVCache, layer: int, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a batch as float32 [n, kv_heads, L, D], contiguous (scratch buffers of the cache),
    unused slots of both zeroed (SDPA adds its mask to the scores, and NaN - inf is NaN)."""
    n, length = batch.valid.shape
    kv, d, bs = cache.num_kv_heads, cache.head_dim, cache.block_size
    k, v = _gather_rows(cache, layer, batch)
    out = []
    for which, x in (("k", k), ("v", v)):
        heads = _scratch(cache, which + ".heads", (n, kv, length, d), torch.float32)
        heads.view(n, kv, batch.width, bs, d).copy_(x.view(n, batch.width, bs, kv, d).permute(0, 3, 1, 2, 4))
        out.append(heads)
    return out[0], out[1]


def _gather_blocks(cache: PagedKVCache, layer: int, blocks: torch.Tensor, which: str) -> torch.Tensor:
    """Copies of ``blocks`` (1-D int64 ids) of layer's K or V: [len(blocks), block_size, kv, D], in the
    cache's dtype (fp8: dequantized to float32), in a scratch buffer kept on the cache."""
    store = (cache.k if which == "k" else cache.v)[layer]
    shape = (len(blocks), cache.block_size, cache.num_kv_heads, cache.head_dim)
    if cache.is_fp8:  # a 256-entry table lookup, then the power-of-two scales (exact)
        out = _scratch(cache, which + ".fp8", shape, torch.float32)
        codes = _scratch(cache, "codes", shape, torch.int32).copy_(store.index_select(0, blocks))
        torch.index_select(fp8.decode_table_on(cache.device), 0, codes.view(-1), out=out.view(-1))
        exps = (cache.k_exp if which == "k" else cache.v_exp)[layer].index_select(0, blocks)
        return out.mul_(fp8.exp2_int(exps)[:, None, :, None])
    return torch.index_select(store, 0, blocks, out=_scratch(cache, which, shape, store.dtype))


def _scratch(cache: PagedKVCache, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` carved from a buffer on the cache that only ever grows."""
    n = 1
    for size in shape:
        n *= size
    buf = cache.scratch.get(name)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        buf = cache.scratch[name] = torch.empty(n, dtype=dtype, device=cache.device)
    return buf[:n].view(shape)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 SDPA with grouped-query attention, K/V not repeated: q [B, H, n, D], k/v [B, kv, L, D],
    mask [B, n, L]. The GROUP query heads sharing a kv head become GROUP * n query rows of that kv
    head, so SDPA runs as plain multi-head attention over kv heads. Returns float32 [B, H, n, D]."""
    b, heads, n, d = q.shape
    kv = k.shape[1]
    group = heads // kv
    qg = q.to(torch.float32).reshape(b, kv, group * n, d)
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device).masked_fill_(~mask, float("-inf"))
    if n == 1:  # one row per query head: the same mask for all of them, broadcast
        bias = bias[:, None]
    else:
        bias = bias[:, None, None].expand(b, 1, group, n, mask.shape[-1]).reshape(b, 1, group * n, mask.shape[-1])
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=scale).reshape(b, heads, n, d)


def _decode_bf16(q: torch.Tensor, cache: PagedKVCache, layer: int, batch: _Batch, scale: float,
                 out: torch.Tensor) -> None:
    """One batch of one-token chunks with bf16 queries: q [n, H, D] -> ``out`` [n, kv_heads, H / kv_heads, D].

    Each sequence's K and V are read straight from the gathered blocks ([n, L, kv_heads * D], no
    per-head transpose). The queries become a block-diagonal matrix [n, H, kv_heads * D] (query head h
    of kv head j holds q in columns j*D .. j*D+D-1, zeros elsewhere), so one batched product gives
    every head's scores; the product with V gives, per head, its own kv head's block (the diagonal)
    and discarded cross terms. The extra products by zero are exact and cheap next to reading K/V
    (exact for finite keys: an inf or NaN stored in a used slot of one kv head would also spoil the other
    heads' scores at that position; unused slots are zeroed and masked whatever they held).
    The products take bf16 inputs, accumulate in float32 and round their result to bf16 (as
    transformers' bf16 attention does); scaling, mask and softmax are float32 (one ``add`` does the
    first two). The block-diagonal matrix lives in a scratch buffer whose zeros are never overwritten.
    """
    n, heads, d = q.shape
    kv = cache.num_kv_heads
    group = heads // kv
    k, v = (x.to(torch.bfloat16) for x in _gather_rows(cache, layer, batch))  # no copy unless fp8
    q_diag = _zeros_scratch(cache, "q_diag", (n, kv, group, kv, d), q.dtype)
    q_diag.diagonal(dim1=1, dim2=3).copy_(q.view(n, kv, group, d).permute(0, 2, 3, 1))
    scores = torch.bmm(q_diag.view(n, heads, kv * d), k.transpose(1, 2))  # [n, H, L] bf16
    weights = torch.softmax(torch.add(batch.bias, scores, alpha=scale), dim=-1).to(q.dtype)
    both = torch.bmm(weights, v).view(n, kv, group, kv, d)
    out.copy_(both.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2))


def _zeros_scratch(cache: PagedKVCache, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Like ``_scratch``, but the buffer starts as zeros: callers write only entries that they always write
    (the diagonal of ``_decode_bf16``'s query matrix), so every other entry stays zero."""
    n = 1
    for size in shape:
        n *= size
    key = "zeros." + name
    buf = cache.scratch.get(key)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        buf = cache.scratch[key] = torch.zeros(max(n, 0 if buf is None else buf.numel()), dtype=dtype,
                                               device=cache.device)
    return buf[:n].view(shape)


def _one_token_rows(q: torch.Tensor, cache: PagedKVCache, layer: int, batches: list[_Batch], scale: float,
                    out: torch.Tensor) -> None:
    """Attention of one-token chunks, batch by batch, into their rows of ``out`` ([T, H, D])."""
    for batch in batches:
        rows = q.index_select(0, batch.rows)
        if q.dtype == torch.bfloat16:
            n, heads, d = rows.shape
            kv = cache.num_kv_heads
            result = _scratch(cache, "decode.out", (n, kv, heads // kv, d), q.dtype)
            _decode_bf16(rows, cache, layer, batch, scale, result)
            out.index_copy_(0, batch.rows, result.view(n, heads, d))
        else:  # float32 batched products are slow on this CPU (MKL): SDPA, and no products by zero
            k, v = _gather_heads(cache, layer, batch)
            result = _attend(rows[:, :, None, :], k, v, batch.valid[:, None, :], scale)[:, :, 0, :]
            out.index_copy_(0, batch.rows, result.to(out.dtype))


def decode_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, step: KVStep, scale: float) -> torch.Tensor:
    """q [B, H, D] (one token per chunk) -> [B, H, D] in q's dtype."""
    if attention_c.applies(q, cache):  # bf16 on a CPU: the C kernel, straight over the block tables
        chunks, rows, lengths, longest = native_rows(step)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        attention_c.decode_rows(q, cache, layer, step, chunks, rows, scale, out, lengths, longest)
        return out
    if "decode" not in step.memo:
        every = list(range(step.num_chunks))
        step.memo["decode"] = _batches(step, every, every, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _one_token_rows(q, cache, layer, step.memo["decode"], scale, out)
    return out


def row_layout(step: KVStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The C kernel's view of every row of a step, each up to its own position (causal), worked out once per step:
    each row's chunk (int64), the rows (int64), each row's length (int32, its position + 1), the longest."""
    got = step.memo.get("rows.native")
    if got is None:
        chunk = torch.repeat_interleave(torch.arange(step.num_chunks, dtype=torch.int64),
                                        torch.tensor(step.query_lens, dtype=torch.int64))
        lengths = torch.tensor([s + j + 1 for s, n in zip(step.starts, step.query_lens, strict=True)
                                for j in range(n)], dtype=torch.int32)
        got = step.memo["rows.native"] = (chunk, torch.arange(len(chunk), dtype=torch.int64), lengths,
                                          step.max_seq_len)
    return got


def native_rows(step: KVStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """What ``decode_attention`` / ``prefill_attention`` hand the C kernel for a step: in a decode step one row per
    sequence, each over its whole sequence (lengths None); otherwise ``row_layout``."""
    if not step.is_decode:
        return row_layout(step)
    got = step.memo.get("decode.native")
    if got is None:
        every = torch.arange(step.num_chunks, dtype=torch.int64)
        got = step.memo["decode.native"] = (every, every, None, max(step.max_seq_len, 1))
    return got


def prefill_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, step: KVStep, scale: float) -> torch.Tensor:
    """q [T, H, D] for the step's chunks concatenated -> [T, H, D] in q's dtype."""
    if attention_c.applies(q, cache):  # bf16 on a CPU: every row by the C kernel, each up to its position
        chunk, rows, lengths, longest = row_layout(step)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        attention_c.decode_rows(q, cache, layer, step, chunk, rows, scale, out, lengths, longest)
        return out
    if "prefill" not in step.memo:
        offsets = [0]
        for n in step.query_lens:
            offsets.append(offsets[-1] + n)
        single = [i for i, n in enumerate(step.query_lens) if n == 1]
        longer = []
        for i, n in enumerate(step.query_lens):
            if n > 1:
                batch = _chunk_batch(step, i, q.device)
                key_pos = torch.arange(batch.width * step.block_size, device=q.device)
                query_pos = step.starts[i] + torch.arange(n, device=q.device)
                mask = key_pos[None, :] <= query_pos[:, None]  # also excludes every position past the chunk
                longer.append((offsets[i], n, batch, mask[None], _bias(mask)[:, 0]))
        step.memo["prefill"] = (_batches(step, single, [offsets[i] for i in single], q.device), longer)
    singles, longer = step.memo["prefill"]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _one_token_rows(q, cache, layer, singles, scale, out)
    for row, n, batch, mask, bias in longer:
        if q.dtype == torch.bfloat16:
            _chunk_bf16(q[row:row + n], cache, layer, batch, bias, scale, out[row:row + n])
            continue
        k, v = _gather_heads(cache, layer, batch)
        qi = q[row:row + n].transpose(0, 1)[None]  # [1, H, n, D]
        out[row:row + n] = _attend(qi, k, v, mask, scale)[0].transpose(0, 1).to(q.dtype)
    return out


def _chunk_bf16(q: torch.Tensor, cache: PagedKVCache, layer: int, batch: _Batch, bias: torch.Tensor, scale: float,
                out: torch.Tensor) -> None:
    """One prefill chunk with bf16 queries: q [n, H, D] -> ``out`` [n, H, D] (bias [n, L]: the causal mask).

    Per kv head, its GROUP query heads' n rows are one [GROUP * n, D] matrix, so the scores are
    kv_heads matrix products of many rows (efficient, unlike one-token decode rows) over K laid out
    head by head. Like ``_decode_bf16``: bf16 products accumulated in float32, scores and weights
    rounded to bf16, scaling, mask and softmax in float32.
    """
    n, heads, d = q.shape
    kv = cache.num_kv_heads
    group = heads // kv
    k, v = (x.to(torch.bfloat16) for x in _gather_rows(cache, layer, batch))  # [1, L, kv * D], no copy unless fp8
    length = k.shape[1]
    k_heads = _scratch(cache, "k.heads16", (kv, length, d), torch.bfloat16)
    k_heads.copy_(k.view(length, kv, d).transpose(0, 1))
    v_heads = _scratch(cache, "v.heads16", (kv, length, d), torch.bfloat16)
    v_heads.copy_(v.view(length, kv, d).transpose(0, 1))
    q_heads = _scratch(cache, "q.heads16", (kv, group, n, d), torch.bfloat16)
    q_heads.copy_(q.view(n, kv, group, d).permute(1, 2, 0, 3))
    scores = torch.bmm(q_heads.view(kv, group * n, d), k_heads.transpose(1, 2)).view(kv, group, n, length)
    weights = torch.softmax(torch.add(bias, scores, alpha=scale), dim=-1).to(torch.bfloat16)
    both = torch.bmm(weights.view(kv, group * n, length), v_heads).view(kv, group, n, d)
    out.view(n, kv, group, d).copy_(both.permute(2, 0, 1, 3))


def bound(cache: PagedKVCache, step: KVStep, heads: int,
          scale: float) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
    """The C kernel bound to one step for all its layers (``attention_c.bind``): every row of the step, as
    ``decode_attention`` / ``prefill_attention`` run it; None where they would not take the C kernel."""
    return attention_c.bind(cache, step, heads, scale, *native_rows(step))
