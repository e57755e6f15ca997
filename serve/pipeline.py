"""The pipeline options of ``python -m serve``: the model split over a chain of stage processes (``fast/pipeline``).

``load_engine`` (``serve/engines.py``) builds the pipelined engine from ``options(args)``; fast.pipeline
itself is imported only then, so the server's command line parses without torch.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline (see fast/pipeline)")
    g.add_argument("--pipeline", metavar="STAGES",
                   help="split the model over stage processes: a number of equal CPU stages (2) or a chain "
                        "cpu:THREADS[xSLOWDOWN],... (e.g. cpu:1,cpu:1x2); layers by the placement's best split")
    g.add_argument("--micro-batches", type=int, default=2, help="pieces a pipeline step is cut into (default 2)")
    g.add_argument("--pipeline-step-timeout", type=float, default=120.0,
                   help="seconds a pipeline step may take before its stages count as hung (default 120)")
    g.add_argument("--pipeline-restarts", type=int, default=2,
                   help="times in a row a failed (dead or hung) pipeline is restarted, its requests recomputed "
                        "from their prompt and the tokens already streamed, before they end with an error "
                        "(default 2; 0: never)")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.micro_batches < 1:
        p.error("--micro-batches must be >= 1")
    if args.pipeline_restarts < 0:
        p.error("--pipeline-restarts must be >= 0")
    if args.pipeline_step_timeout <= 0:
        p.error("--pipeline-step-timeout must be > 0")


def options(args: argparse.Namespace) -> dict[str, Any]:
    """``load_engine``'s pipeline keywords (``pipeline=None``: no pipeline)."""
    return dict(pipeline=args.pipeline, micro_batches=args.micro_batches,
                pipeline_step_timeout_s=args.pipeline_step_timeout, pipeline_restarts=args.pipeline_restarts)
