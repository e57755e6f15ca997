"""The fast engine: the reference engine's control plane (``reference/engine/engine.py``) with a torch runner.

    from fast.engine import Engine
    engine = Engine.load("smollm2", dtype="bfloat16", compressed=False, max_num_seqs=64)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=128))

Scheduling, the block manager, the prefix cache, sampling and metrics are the reference's own code:
only the model runner differs (``fast/engine/torch_runner.py``), so both engines make the same decisions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fast.engine.model import TorchLlama
from fast.engine.torch_runner import TorchRunner
from reference.engine.engine import Engine as ReferenceEngine
from reference.model.tokenizer import load_tokenizer
from reference.model.weights import WeightSource, open_weights


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one, else every core)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


class FastModel:
    """What the engine is given: the torch model, and how to make its runner (``make_runner``)."""

    def __init__(self, model: TorchLlama, *, cuda_graphs: bool = True):
        self.torch_model, self.config, self.cuda_graphs = model, model.config, cuda_graphs

    def make_runner(self, num_blocks: int, block_size: int = 16, kv_dtype: str | None = None) -> TorchRunner:
        return TorchRunner(self.torch_model, num_blocks, block_size, kv_dtype, cuda_graphs=self.cuda_graphs)


class Engine(ReferenceEngine):
    """``reference.engine.Engine`` over a ``TorchRunner``; the KV cache dtype defaults to the model's dtype."""

    def __init__(self, model: FastModel, tokenizer: Any = None, *, kv_dtype: str | None = None, **kwargs: Any):
        super().__init__(model, tokenizer, kv_dtype=kv_dtype or model.torch_model.dtype_name, **kwargs)

    @classmethod
    def load(cls, model: str | Path | WeightSource = "smollm2", dtype: str = "bfloat16",
             compressed: bool | tuple[str, ...] = False, *, device: str | None = None, threads: int | None = None,
             tokenizer: bool = True, cuda_graphs: bool = True, **engine_kwargs: Any) -> Engine:
        """Load a checkpoint (whatever ``reference`` loads: an Unweight container too) and build an engine around it.

        dtype: "bfloat16" or "float32". compressed: True serves every projection matrix from the
        palette form (``UnweightLinear``), or name some of ("qkv", "o", "gate_up", "down").
        device: None picks CUDA when present. threads: torch CPU threads (None: every core this process
        may run on, so a process pinned with taskset does not run more threads than its cores).
        Other keywords are the reference ``Engine``'s (num_blocks, max_num_seqs, policy, ...).
        """
        torch.set_num_threads(threads or usable_cores())
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        src = model if isinstance(model, WeightSource) else open_weights(model)  # opened once for both
        torch_model = TorchLlama.load(src, dtype=dtype, device=device, compressed=compressed)
        tok = load_tokenizer(src) if tokenizer else None
        return cls(FastModel(torch_model, cuda_graphs=cuda_graphs), tok, **engine_kwargs)
