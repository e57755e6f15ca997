"""The model runner: the one part of the engine that differs between the NumPy and the fast engine.

The engine's control plane (scheduler, block manager, prefix cache, request bookkeeping) is one
implementation, ``engine.py`` beside this file. What it asks of the data plane each step is small:

  1. apply the copy-on-write block copies the scheduler asked for (``copy_blocks``);
  2. run the step's chunks (new tokens of each scheduled sequence, with its block table) over the
     paged KV cache, and return the float32 logits of each chunk's last token where asked
     (``forward``).

A runner owns its KV cache, created when the runner is made (``model.make_runner(num_blocks,
block_size, kv_dtype)``). ``NumpyRunner`` (``reference/model/llama.py``) is the reference one;
``fast/engine/torch_runner.py`` has a torch runner with the same interface, so the fast engine is
the same engine loop with another runner. These protocols live here, beside the engine that consumes
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from reference.model.config import LlamaConfig
from reference.model.llama import Chunk


class ModelRunner(Protocol):
    """What the engine needs from a data plane."""

    config: LlamaConfig

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy each block ``src`` into ``dst`` (every layer, K and V, fp8 scales included)."""

    def forward(self, chunks: Sequence[Chunk]) -> list[np.ndarray | None]:
        """Run one step; per chunk, the float32 logits [vocab] of its last token, or None if not
        wanted."""


class RunnableModel(Protocol):
    """What ``Engine`` is given: a model that knows its config and makes its runner (and KV
    cache)."""

    config: LlamaConfig

    def make_runner(self, num_blocks: int, block_size: int, kv_dtype: str) -> ModelRunner:
        """A runner owning a new KV cache of ``num_blocks`` blocks of ``block_size`` tokens."""
