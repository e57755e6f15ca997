"""The fast engine's model runner under the disaggregated workers of ``reference/disagg``.

The prefill and decode workers are the engine's control plane (scheduler, block manager, prefix cache)
over a model runner (``reference/disagg/worker_base.py``); on the NumPy runner they read and write its
``KVCache`` to move KV over the wire. ``WorkerRunner`` is the fast engine's ``TorchRunner`` (the same
runner the colocated fast engine steps on) with what the workers add to it:

* ``cache``: the torch paged cache seen as the workers see a cache (``HostCache``: NumPy float32 in and
  out, the slot rule of ``reference/kv/cache.py``), so the wire code is the reference's, byte for byte;
* ``forward(chunks, on_layer=hook)``: ``hook(i)`` runs as soon as layer i's K/V of the step are written
  (the prefill worker sends them then, while layer i + 1 computes). The torch model has no hook of its
  own, so the runner's cache announces its writes (``PagedKVCache.on_write``, also called by the fused CPU
  RoPE write) for the length of that one step (steps with a hook run eagerly, never as a replayed CUDA graph,
  which would write without telling).

``load_worker_model`` loads a checkpoint (a container too; ``compressed`` as ``fast.engine.Engine.load``)
and names it by a digest that folds in the runner and dtype, so a decode worker refuses KV from a prefill
worker that computes with other numbers (and computes the prompt itself) instead of mixing them.
Conformance: a bf16 model's bf16 cache holds exactly the values that fp32 and bf16 on the wire carry, so
with either the decode worker continues from the very bytes the prefill worker computed (bit-exact).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fast.engine.engine import FastModel
from fast.engine.model import DTYPES, PROJECTIONS, TorchLlama, stored_projections
from fast.engine.torch_runner import TorchRunner
from fast.kv import PagedKVCache, write_kv
from reference.disagg.models import load_model
from reference.disagg.wire import model_digest
from reference.kv.errors import KVCacheError
from reference.model.llama import Chunk
from reference.model.loader import load_llama
from reference.model.weights import open_weights


class HostCache:
    """A torch ``PagedKVCache`` with the NumPy face of ``reference.kv.cache.KVCache`` that the workers use."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.torch_cache = cache
        self.num_layers, self.num_blocks, self.block_size = cache.num_layers, cache.num_blocks, cache.block_size
        self.dtype = cache.dtype

    def slots(self, block_table: Sequence[int], start: int, count: int) -> np.ndarray:
        """Slot ids of positions [start, start + count) (the rule of ``KVCache.slots``)."""
        pos = np.arange(start, start + count)
        table = np.asarray(block_table, dtype=np.int64)
        if count and pos[-1] // self.block_size >= len(table):
            raise KVCacheError(f"position {pos[-1]} needs block {pos[-1] // self.block_size} but the table "
                               f"has {len(table)} blocks")
        if table.size and (table.min() < 0 or table.max() >= self.num_blocks):
            raise KVCacheError(f"block table has ids outside [0, {self.num_blocks})")
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store float32 K, V [n, kv_heads, head_dim] (from the wire) at ``slots``, in the cache's dtype."""
        device = self.torch_cache.device

        def put(a: np.ndarray, dtype: type) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype)).to(device)

        write_kv(self.torch_cache, layer, put(slots, np.int64), put(k, np.float32), put(v, np.float32))

    def read(self, layer: int, block_table: Sequence[int], length: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of positions [0, length) as float32 NumPy arrays [length, kv_heads, head_dim]."""
        k, v = self.torch_cache.read(layer, block_table, length)
        return k.cpu().numpy(), v.cpu().numpy()

    def copy_block(self, src: int, dst: int) -> None:
        self.torch_cache.copy_block(src, dst)

    def nbytes(self) -> int:
        return self.torch_cache.nbytes()


class WorkerRunner:
    """``TorchRunner`` for a disaggregated worker: a ``HostCache`` and the per-layer hook (module docstring)."""

    def __init__(self, runner: TorchRunner) -> None:
        self.runner, self.config = runner, runner.config
        self.cache = HostCache(runner.cache)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    def forward(self, chunks: Sequence[Chunk],
                on_layer: Callable[[int], None] | None = None) -> list[np.ndarray | None]:
        if on_layer is None:
            return self.runner.forward(chunks)
        cache, graphs = self.runner.cache, self.runner.graphs
        cache.on_write, self.runner.graphs = on_layer, None  # this step only: every K/V write announces itself
        try:
            return self.runner.forward(chunks)
        finally:
            cache.on_write = None
            self.runner.graphs = graphs


class WorkerModel(FastModel):
    """What a worker is given: the torch model's config and ``make_runner`` (a ``WorkerRunner``)."""

    def make_runner(self, num_blocks: int, block_size: int = 16, kv_dtype: str | None = None) -> WorkerRunner:  # type: ignore[override]
        return WorkerRunner(super().make_runner(num_blocks, block_size, kv_dtype))


def load_worker_model(spec: str, *, dtype: str = "bfloat16", compressed: Sequence[str] = (),
                      device: str | None = None) -> tuple[WorkerModel, str]:
    """(model, digest) for a worker: ``spec`` as ``reference.disagg.models`` names models (``tiny[:SEED]``,
    a packaged name, a checkpoint path or a container), served in ``dtype`` with ``compressed`` matrices."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    unknown = sorted(set(compressed) - set(PROJECTIONS))
    if unknown:
        raise ValueError(f"--compressed names unknown matrices {unknown}: choose from {','.join(PROJECTIONS)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    stored: dict[Any, Any] = {}
    if spec == "tiny" or spec.startswith("tiny:"):
        ref = load_model(spec)
        config, weights = ref.config, ref.weights
    else:
        src = open_weights(spec)
        config, weights = load_llama(src)
        stored = stored_projections(src, config.num_layers, tuple(compressed), DTYPES[dtype], device)
    h = hashlib.blake2b(digest_size=32, person=b"unfire-model-v1")
    h.update(f"{model_digest(config, weights)}|torch runner|{dtype}".encode())
    model = TorchLlama(config, weights, dtype=dtype, device=device, compressed=tuple(compressed), stored=stored)
    return WorkerModel(model, cuda_graphs=device.startswith("cuda")), h.hexdigest()

