"""A pipeline stage in NumPy: a contiguous range of a model's layers and the KV cache of those
layers.

Pipeline parallelism cuts a model into stages by layer: stage 0 holds the embedding and layers
``0 .. b1 - 1``, stage 1 layers ``b1 .. b2 - 1``, ..., the last stage also the final norm and the
output head. What flows from one stage to the next is the residual stream, one float32 row of
``hidden`` numbers per token. Each stage keeps the K/V of its own layers, in the same block ids the
engine's block manager hands out, so the engine's block tables mean the same thing on every stage.

    stage = NumpyStage(model, first=0, last=15, num_blocks=512)
    x = stage.compute(chunks)            # stage 0: tokens in, residual stream out
    logits = last_stage.compute(chunks, x)   # the last stage: the wanted rows' logits

``fast/pipeline`` runs stages like this one (or its torch twin) in separate processes and sends the
residual stream between them; this class is the same computation without the processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from reference.kv.cache import KVCache
from reference.model.llama import Chunk, LlamaModel, logit_rows


class NumpyStage:
    """Layers ``first .. last - 1`` of ``model`` and a KV cache of ``num_blocks`` blocks for
    them."""

    def __init__(self, model: LlamaModel, first: int, last: int, *, num_blocks: int,
                 block_size: int = 16, kv_dtype: str = "float32"):
        n = model.config.num_layers
        if not 0 <= first < last <= n:
            raise ValueError(f"stage layers {first}..{last - 1} are not a range of the model's {n} "
                             "layers")
        self.first, self.last = first, last
        self.is_first, self.is_last = first == 0, last == n
        config = dataclasses.replace(model.config, num_layers=last - first)
        weights = dataclasses.replace(model.weights, layers=list(model.weights.layers[first:last]))
        # a model of just these layers (cache layer i = layer first + i)
        self.part = LlamaModel(config, weights)
        self.cache: KVCache = self.part.new_cache(num_blocks, block_size, kv_dtype)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.cache.copy_block(src, dst)

    def compute(self, chunks: Sequence[Chunk], x: np.ndarray | None = None) -> np.ndarray:
        """The first stage embeds the chunks' tokens (``x`` None); every stage runs its layers; the
        last one returns the logits of the rows ``logit_rows`` names (the last row of each chunk
        that wants logits, every row of one with ``all_logits``), the others the residual stream
        [tokens, hidden]."""
        if self.is_first:
            x = self.part.embed(chunks)
        x = self.part.run_layers(np.asarray(x, dtype=np.float32), chunks, self.cache)
        return self.part.head(x[logit_rows(chunks)[0]]) if self.is_last else x
