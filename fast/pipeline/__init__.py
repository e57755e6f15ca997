"""Pipeline parallelism, executed: a model split by layer ranges over a chain of stage processes.

    from fast.pipeline import load_engine
    engine = load_engine("smollm2", "cpu:1,cpu:1x2", dtype="bfloat16", micro_batches=2)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=32))
    engine.runner.close()

or ``python -m serve --model smollm2 --pipeline cpu:1,cpu:1x2``. The split is ``best_split``'s
(``reference/cluster/placement.py``) for the chain (``chain.py``); the engine is the reference engine
loop (the one control plane) over a ``PipelineRunner`` (``pipeline_runner.py``), whose stage 0 runs in the
engine's process and the others as processes (``stage.py``) joined by torch.distributed (gloo on
loopback); ``wire.py`` is what travels between them; ``restart.py`` restarts failed stages and
recomputes the requests in flight (``load_engine(..., restarts=N)``, what ``python -m serve`` runs).
"""

from fast.pipeline.chain import Node, PipelineError, Plan, parse_chain, plan
from fast.pipeline.pipeline_runner import PipelineModel, PipelineRunner, load_engine

__all__ = ["Node", "PipelineError", "PipelineModel", "PipelineRunner", "Plan", "load_engine", "parse_chain", "plan"]
