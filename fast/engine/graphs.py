"""CUDA graphs for decode steps: capture the whole forward pass once per batch size, replay it each step.

A decode step of B sequences launches hundreds of small kernels (30 layers x norms, matmuls, RoPE,
cache writes, attention); at small B, launching them from Python costs more than running them.
A CUDA graph records the launches once and replays them with one call. Graphs need fixed shapes and
fixed addresses, so each bucket size (1, 2, 4, ... max_batch) has its own graph over static input
buffers; a step of B sequences pads to the next bucket. Padded rows are one-token sequences whose
block table is the spare ``pad_block`` (one block past the block manager's), so they write there and
read only themselves; their logits are dropped. Block tables are ``max_blocks`` wide (the context
length), so no step needs more. Attention reads sequence lengths from the device, so one graph serves
every length; the step's host-side lengths (which size the decode kernel's split-KV grid) are set to
the full table width, so the captured grid covers every block a sequence may reach.

Not tested on this project's CI (no GPU there): ``TorchRunner`` falls back to eager steps, with a
warning, if a capture fails.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fast.engine.model import TorchLlama
from fast.kv import KVStep, PagedKVCache


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch (max_batch itself included)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class DecodeGraphs:
    def __init__(self, model: TorchLlama, cache: PagedKVCache, *, max_batch: int, max_blocks: int, pad_block: int):
        self.model, self.cache = model, cache
        self.max_batch, self.max_blocks, self.pad_block = max_batch, max_blocks, pad_block
        dev = model.device
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.tables = torch.full((max_batch, max_blocks), pad_block, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.slots = torch.full((max_batch,), pad_block * cache.block_size, dtype=torch.int64, device=dev)
        self.query_starts = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(max_batch, dtype=torch.int64, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def fits(self, sizes: np.ndarray) -> bool:
        """True for a pure decode step small enough for a graph."""
        return 0 < len(sizes) <= self.max_batch and bool((sizes == 1).all())

    def _step(self, b: int) -> KVStep:
        """The KV layout of bucket ``b`` over the static buffers (host lengths: the whole table)."""
        width = self.max_blocks * self.cache.block_size
        return KVStep(query_lens=(1,) * b, starts=(width - 1,) * b, block_size=self.cache.block_size,
                      block_tables=self.tables[:b], seq_lens=self.seq_lens[:b], context_lens=self.seq_lens[:b] - 1,
                      query_starts=self.query_starts[:b + 1], slots=self.slots[:b])

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        step, args = self._step(b), (self.tokens[:b], self.positions[:b])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (autotuning, allocations) outside the capture
            self.model.forward(*args, step, self.cache, self.rows[:b])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model.forward(*args, step, self.cache, self.rows[:b])
        self.pool = graph.pool()
        return graph, out

    def run(self, tokens: np.ndarray, starts: np.ndarray, block_tables: Sequence[Sequence[int]],
            rows: np.ndarray) -> torch.Tensor:
        """Logits [len(rows), vocab] of a decode step (one token per sequence at position ``starts[i]``)."""
        b = self.fill(tokens, starts, block_tables)
        if b not in self.graphs:
            self.graphs[b] = self._capture(b)
        graph, out = self.graphs[b]
        graph.replay()
        return out[torch.from_numpy(rows).to(out.device)]

    def fill(self, tokens: np.ndarray, starts: np.ndarray, block_tables: Sequence[Sequence[int]]) -> int:
        """Write a decode step into the static buffers, padded to its bucket; returns the bucket size."""
        n = len(tokens)
        b = next(size for size in buckets(self.max_batch) if size >= n)
        table = np.full((b, self.max_blocks), self.pad_block, dtype=np.int32)
        for i, t in enumerate(block_tables):
            table[i, :len(t)] = t[:self.max_blocks]
        slots = np.full(b, self.pad_block * self.cache.block_size, dtype=np.int64)
        slots[:n] = table[np.arange(n), starts // self.cache.block_size] * self.cache.block_size \
            + starts % self.cache.block_size
        seq_lens = np.ones(b, dtype=np.int32)
        seq_lens[:n] = starts + 1
        padded = np.zeros(b, dtype=np.int64)
        self.tables[:b].copy_(torch.from_numpy(table), non_blocking=False)
        self.slots[:b].copy_(torch.from_numpy(slots))
        self.seq_lens[:b].copy_(torch.from_numpy(seq_lens))
        padded[:n] = tokens
        self.tokens[:b].copy_(torch.from_numpy(padded))
        padded[:n] = starts
        padded[n:] = 0
        self.positions[:b].copy_(torch.from_numpy(padded))
        return b
