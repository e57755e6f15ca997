"""``TorchRunner``: the fast engine's data plane, with the interface of ``reference/engine/model_runner.py``.

Per step it turns the engine's chunks into tensors once (token ids, positions, a ``KVStep`` with the
block tables and cache slots), runs ``TorchLlama.forward`` over all of them together, and hands the
wanted logits back as float32 NumPy rows (one device-to-host copy per step). On a GPU a pure decode
step of up to ``max_graph_batch`` sequences replays a captured CUDA graph (``fast/engine/graphs.py``)
instead of launching each kernel from Python. On a CPU, glibc's malloc is told once to keep freed blocks
for reuse (``fast/engine/host_memory.py``: the step's temporaries no longer fault in fresh pages).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from fast.engine.host_memory import keep_freed_memory
from fast.engine.model import TorchLlama
from fast.kv import KVStep
from reference.model.llama import Chunk, logit_rows, split_logits


class TorchRunner:
    all_logits = True  # honours Chunk.all_logits (prompt logprobs)

    def __init__(self, model: TorchLlama, num_blocks: int, block_size: int = 16, kv_dtype: str | None = None, *,
                 cuda_graphs: bool = True, max_graph_batch: int = 256):
        self.model, self.config = model, model.config
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = model.device
        if self.device.type == "cpu":
            keep_freed_memory()
        use_graphs = cuda_graphs and self.device.type == "cuda"
        # one extra block past the block manager's: where padded rows of a graph-replayed step write
        self.cache = model.new_cache(num_blocks + (1 if use_graphs else 0), block_size, kv_dtype)
        self.max_blocks = min(num_blocks, -(-model.config.max_position // block_size))
        self.prepare_time = 0.0  # seconds of the last step spent laying out its tensors (control-plane work)
        self.clock = time.perf_counter  # what prepare_time is measured with (experiments may use CPU time)
        self.graphs = None
        if use_graphs:
            from fast.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.cache, max_batch=max_graph_batch, max_blocks=self.max_blocks,
                                       pad_block=num_blocks)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.cache.copy_block(src, dst)

    def forward(self, chunks: Sequence[Chunk]) -> list[np.ndarray | None]:
        started = self.clock()
        sizes = np.fromiter((len(ch.tokens) for ch in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter((ch.start for ch in chunks), dtype=np.int64, count=len(chunks))
        tokens = np.fromiter((t for ch in chunks for t in ch.tokens), dtype=np.int64, count=int(sizes.sum()))
        first_row = np.cumsum(sizes) - sizes
        positions = np.arange(len(tokens)) + np.repeat(starts - first_row, sizes)
        rows, spans = logit_rows(chunks)
        if self.graphs is not None and self.graphs.fits(sizes) and not any(ch.all_logits for ch in chunks):
            try:
                self.prepare_time = self.clock() - started
                logits = self.graphs.run(tokens, starts, [ch.block_table for ch in chunks], rows)
                return split_logits(logits.cpu().numpy(), chunks, spans)
            except Exception as e:  # a capture failed: run eagerly from now on, and say so once
                warnings.warn(f"CUDA graphs disabled, decode steps run eagerly: {e}", stacklevel=2)
                self.graphs = None
        step = KVStep.build(query_lens=sizes.tolist(), starts=starts.tolist(),
                            block_tables=[ch.block_table for ch in chunks], block_size=self.block_size,
                            num_blocks=self.num_blocks, device=self.device)

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device)

        tokens_t, positions_t, rows_t = put(tokens), put(positions), put(rows)
        self.prepare_time = self.clock() - started
        logits = self.model.forward(tokens_t, positions_t, step, self.cache, rows_t)
        return split_logits(logits.cpu().numpy(), chunks, spans)
