"""The model runner: the one part of the engine that differs between the NumPy and the fast engine.

The engine's control plane (scheduler, block manager, prefix cache, request bookkeeping) is one
implementation, ``reference/engine/engine.py``. What it asks of the data plane each step is small:

  1. apply the copy-on-write block copies the scheduler asked for (``copy_blocks``);
  2. run the step's chunks (new tokens of each scheduled sequence, with its block table) over the
     paged KV cache, and return the float32 logits of each chunk's last token where asked (``forward``).

A runner owns its KV cache, created when the runner is made (``model.make_runner(num_blocks,
block_size, kv_dtype)``). ``NumpyRunner`` below is the reference one; ``fast/engine`` has a torch
runner with the same interface, so the fast engine is the same engine loop with another runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from reference.kv.cache import KVCache
from reference.model.config import LlamaConfig
from reference.model.llama import Chunk, LlamaModel


class ModelRunner(Protocol):
    """What the engine needs from a data plane."""

    config: LlamaConfig

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy each block ``src`` into ``dst`` (every layer, K and V, fp8 scales included)."""

    def forward(self, chunks: Sequence[Chunk]) -> list[np.ndarray | None]:
        """Run one step; per chunk, the float32 logits [vocab] of its last token, or None if not wanted."""


class RunnableModel(Protocol):
    """What ``Engine`` is given: a model that knows its config and makes its runner (and KV cache)."""

    config: LlamaConfig

    def make_runner(self, num_blocks: int, block_size: int, kv_dtype: str) -> ModelRunner:
        """A runner owning a new KV cache of ``num_blocks`` blocks of ``block_size`` tokens."""


class NumpyRunner:
    """The reference runner: ``LlamaModel.forward`` over a NumPy ``KVCache``."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16, kv_dtype: str = "float32"):
        self.model, self.config = model, model.config
        self.cache: KVCache = model.new_cache(num_blocks, block_size, kv_dtype)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.cache.copy_block(src, dst)

    def forward(self, chunks: Sequence[Chunk],
                on_layer: Callable[[int], None] | None = None) -> list[np.ndarray | None]:
        """``on_layer(i)``: called once layer i's K/V of this step are in the cache (the disaggregated
        prefill worker sends them then)."""
        return self.model.forward(chunks, self.cache, on_layer=on_layer)
