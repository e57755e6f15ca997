"""Building the engine the server fronts: the reference (NumPy) one or the fast (torch) one.

The fast engine lives in ``fast.engine`` and is imported only when asked for, so the server runs
without torch; if it is not there, the error says so and how to get the reference engine instead.
Both take the same scheduling options (``num_blocks``, ``block_size``, ``max_num_seqs``, ...).
"""

from __future__ import annotations

import importlib
from typing import Any

from reference.sched import Tenants


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot be built here (missing module or package)."""


def load_engine(model: str, kind: str = "reference", *, tenants: Tenants | None = None, policy: str = "sjf+wfq",
                dtype: str = "bfloat16", pipeline: str | None = None, micro_batches: int = 2,
                pipeline_step_timeout_s: float = 120.0, **engine_kwargs: Any) -> Any:
    """An engine over ``model`` (a packaged model name or a checkpoint path) with its tokenizer.

    ``pipeline``: a chain of stages (``"2"``, ``"cpu:2,cpu:1x2"``): the torch engine split over stage
    processes by the placement's best split (``fast.pipeline``), whatever ``kind`` says."""
    if tenants is None:
        tenants = Tenants.open()
    options = dict(policy=policy, tenants=tenants, **engine_kwargs)
    if pipeline:
        try:
            fast_pipeline = importlib.import_module("fast.pipeline")
        except ImportError as e:
            raise EngineUnavailable(f"--pipeline needs torch (fast.pipeline cannot be imported here: {e})") from None
        try:
            return fast_pipeline.load_engine(model, pipeline, dtype=dtype, micro_batches=micro_batches,
                                             step_timeout_s=pipeline_step_timeout_s, **options)
        except fast_pipeline.PipelineError as e:
            raise EngineUnavailable(str(e)) from None
    if kind == "reference":
        from reference.engine.engine import Engine
        from reference.model.llama import LlamaModel
        from reference.model.tokenizer import load_tokenizer

        return Engine(LlamaModel.load(model), load_tokenizer(model), **options)
    if kind == "fast":
        try:
            fast_engine = importlib.import_module("fast.engine")
        except ImportError as e:
            raise EngineUnavailable(f"--engine fast needs the fast engine (fast.engine), which cannot be imported "
                                    f"here: {e}. Install the fast extra (pip install -e '.[fast]') on a checkout "
                                    "that has fast/engine, or use --engine reference") from None
        return fast_engine.Engine.load(model=model, dtype=dtype, compressed=False, **options)
    raise EngineUnavailable(f"unknown engine {kind!r}: use 'reference' or 'fast'")
