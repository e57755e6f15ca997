"""Pipeline parallelism (``fast/pipeline``) against one process, on the tiny random Llama (3 layers).

* ``pipeline.fp32_vs_reference`` (bit-exact on integers): the NumPy reference engine and the model
  split over 3 stage processes (fp32, gloo on loopback, 3 micro-batches per step) make the same
  scheduling decisions step by step, serve the same prompt tokens from the prefix cache and give the
  same greedy tokens. The workload preempts (few KV blocks), chunks prompts and shares a prefix.
* ``pipeline.bf16_vs_single_process`` (bit-exact on integers): the fast engine in bf16 in one process
  and the same weights over 2 stage processes give the same decisions and greedy tokens.

The stages always run on the CPU (gloo), whatever ``--device`` says; each case starts its stage
processes and stops them (a few seconds).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.cases.engine_cases import _run
from conformance.registry import Case, Gen, Level, register

OPTIONS = dict(num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=24)


def _inputs(gen: Gen) -> dict[str, Any]:
    shared = gen.rng.integers(1, 128, size=12).tolist()
    prompts = [gen.rng.integers(1, 128, size=int(gen.rng.integers(3, 40))).tolist() for _ in range(4)]
    import torch

    return {"prompts": prompts + [shared + [5, 6], shared + [7]], "max_tokens": 8, "device": torch.device("cpu")}


def _tiny() -> Any:
    from reference.disagg.models import load_model

    return load_model("tiny")


def _reference(inputs: dict[str, Any]) -> dict[str, np.ndarray]:
    from reference.engine import Engine

    return _run(Engine(_tiny(), **OPTIONS), inputs)


def _single_process_bf16(inputs: dict[str, Any]) -> dict[str, np.ndarray]:
    from fast.engine import Engine, FastModel, TorchLlama

    m = _tiny()
    return _run(Engine(FastModel(TorchLlama(m.config, m.weights, dtype="bfloat16")), **OPTIONS), inputs)


def _pipeline(stages: str, dtype: str, micro_batches: int):
    def run(inputs: dict[str, Any]) -> dict[str, np.ndarray]:
        from fast.pipeline import load_engine

        engine = load_engine("tiny", stages, dtype=dtype, micro_batches=micro_batches, **OPTIONS)
        try:
            return _run(engine, inputs)
        finally:
            engine.runner.close()
    return run


register(Case(
    name="pipeline.fp32_vs_reference", level=Level.BIT_EXACT, inputs=_inputs, reference=_reference,
    fast=_pipeline("3", "float32", 3),
    about="3 stage processes (fp32) vs the reference engine: scheduling decisions, prefix hits, greedy tokens"))

register(Case(
    name="pipeline.bf16_vs_single_process", level=Level.BIT_EXACT, inputs=_inputs, reference=_single_process_bf16,
    fast=_pipeline("2", "bfloat16", 2),
    about="2 stage processes (bf16) vs the fast engine in one process: decisions and greedy tokens"))
