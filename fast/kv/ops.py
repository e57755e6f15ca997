"""The KV kernels' entry points, and which implementation runs them.

``backend``: "triton" (the kernels in ``write_triton.py`` / ``attention_triton.py``; CUDA tensors, or CPU
tensors under TRITON_INTERPRET=1), "torch" (``attention_torch.py`` and ``PagedKVCache.write``), or None:
the environment variable ``UNFIRE_KV_BACKEND`` if set, else Triton on CUDA and torch elsewhere.
"""

from __future__ import annotations

import math
import os

import torch

from fast.errors import KernelInputError
from fast.kv.cache import PagedKVCache
from fast.kv.step import KVStep

BACKENDS = ("torch", "triton")


def pick_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend to use for tensors on ``device`` (see the module docstring)."""
    choice = backend or os.environ.get("UNFIRE_KV_BACKEND") or ("triton" if device.type == "cuda" else "torch")
    if choice not in BACKENDS:
        raise KernelInputError(f"KV backend must be one of {BACKENDS}, got {choice!r}")
    return choice


def write_kv(cache: PagedKVCache, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             backend: str | None = None) -> None:
    """Store K and V of new tokens (each [n, kv_heads, head_dim], float32 or bfloat16) at int64 ``slots`` [n]
    of cache layer ``layer``: the Triton kernel (``write_triton.py``) or ``PagedKVCache.write`` (torch)."""
    if pick_backend(cache.device, backend) != "triton":
        cache.write(layer, slots, k, v)
        return
    from fast.kv import write_triton

    cache.check_write(layer, slots, k, v)
    write_triton.write(cache, layer, slots, k, v)
    cache.wrote(layer)


def _check_q(q: torch.Tensor, cache: PagedKVCache, step: KVStep, rows: int) -> None:
    if q.dim() != 3 or q.shape[0] != rows or q.shape[2] != cache.head_dim or q.shape[1] % cache.num_kv_heads:
        raise KernelInputError(f"q must be [{rows}, heads (a multiple of {cache.num_kv_heads}), {cache.head_dim}], "
                               f"got {tuple(q.shape)}")
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise KernelInputError(f"q must be float32 or bfloat16, got {q.dtype}")
    if q.device != cache.device or step.block_tables.device != cache.device:
        raise KernelInputError(f"q ({q.device}), the step's tensors ({step.block_tables.device}) and the cache "
                               f"({cache.device}) must be on one device")


def decode_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, step: KVStep, *, scale: float | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """Paged decode attention with GQA: q [B, H, D] (chunk i's one new token) -> [B, H, D] in q's dtype.

    Chunk i attends to positions [0, seq_lens[i]) of its sequence, read through ``step.block_tables[i]``
    (its own new token included: write it first). Query head h reads kv head h // (H / kv_heads).
    ``scale`` defaults to 1/sqrt(D).
    """
    if not step.is_decode:
        raise KernelInputError(f"decode_attention needs one token per chunk, got query_lens {step.query_lens}")
    _check_q(q, cache, step, step.num_chunks)
    scale = 1.0 / math.sqrt(cache.head_dim) if scale is None else scale
    if pick_backend(cache.device, backend) == "triton":
        from fast.kv import attention_triton

        return attention_triton.decode_attention(q, cache, layer, step, scale)
    from fast.kv import attention_torch

    return attention_torch.decode_attention(q, cache, layer, step, scale)


def prefill_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, step: KVStep, *,
                      scale: float | None = None, backend: str | None = None) -> torch.Tensor:
    """Paged attention over a variable-length batch of chunks: q [T, H, D] -> [T, H, D] in q's dtype.

    Rows ``query_starts[i] .. query_starts[i+1]-1`` of q are chunk i's tokens at positions
    ``starts[i] ..``; each attends to every cached position of its sequence before it and causally
    within the chunk (key position <= query position). Chunks of one token are fine (mixed steps).
    """
    _check_q(q, cache, step, step.num_tokens)
    scale = 1.0 / math.sqrt(cache.head_dim) if scale is None else scale
    if pick_backend(cache.device, backend) == "triton":
        from fast.kv import attention_triton

        return attention_triton.prefill_attention(q, cache, layer, step, scale)
    from fast.kv import attention_torch

    return attention_torch.prefill_attention(q, cache, layer, step, scale)


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, step: KVStep, *, scale: float | None = None,
                    backend: str | None = None) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]: the decode kernel for a pure decode step, else the prefill kernel."""
    if step.is_decode:
        return decode_attention(q, cache, layer, step, scale=scale, backend=backend)
    return prefill_attention(q, cache, layer, step, scale=scale, backend=backend)


def attention_rows(q: torch.Tensor, cache: PagedKVCache, layer: int, step: KVStep, rows: torch.Tensor, *,
                   scale: float | None = None, backend: str | None = None) -> torch.Tensor | None:
    """The attention of some query rows only: q [T, H, D] (the step's rows, their K/V already written), ``rows``
    int64 indices into it -> [len(rows), H, D], each row exactly as ``paged_attention`` computes it (causal within
    its chunk). Only the CPU's C kernel takes rows one by one (``fast/kv/attention_c.py``); elsewhere None:
    the caller runs ``paged_attention`` on every row."""
    from fast.kv import attention_c, attention_torch

    if pick_backend(cache.device, backend) != "torch" or not attention_c.applies(q, cache):
        return None
    _check_q(q, cache, step, step.num_tokens)
    scale = 1.0 / math.sqrt(cache.head_dim) if scale is None else scale
    chunk_of, _, length_of, _ = attention_torch.row_layout(step)
    rows = rows.to(torch.int64).contiguous()
    chunks, lengths = chunk_of[rows], length_of[rows]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # only the chosen rows are written
    attention_c.decode_rows(q.contiguous(), cache, layer, step, chunks, rows, scale, out, lengths)
    return out[rows]
