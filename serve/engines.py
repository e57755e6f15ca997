"""Building the engine the server fronts: the reference (NumPy) one or the fast (torch) one.

The fast engine lives in ``fast.engine`` and is imported only when asked for, so the server runs
without torch; if it is not there, the error says so and how to get the reference engine instead.
Both take the same scheduling options (``num_blocks``, ``block_size``, ``max_num_seqs``, ...).
``kind="auto"`` (what ``python -m serve`` does by default) picks the fast engine when torch imports,
else the reference, and says why (``pick_engine``). ``model`` may be an Unweight container file
(``python -m reference.codec compress``); ``compressed`` names the projection matrices the fast
engine serves in the palette form (``fast.engine.Engine.load``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from typing import Any

from reference.sched import Tenants
from serve.engine_thread import GATHER_GAP_S

# the colocated engine's step: a burst into an idle engine is prefilled in few large steps, while a step
# that carries decodes takes at most PREFILL_CAP prompt tokens (README, "The step budget"; chosen with
# experiments/engine/bench_serve_vllm.py). --pipeline and disaggregated workers keep the earlier 256, and a
# budget given on the command line gets no cap unless one is given too (the scheduler as before).
BUDGET, PREFILL_CAP, OTHER_BUDGET = 2048, 256, 256
AT_LEAST_ONE = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                "max_prefill_tokens_with_decodes", "decode_stall_budget", "threads")


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot be built here (missing module or package)."""


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # what --compressed may name (fast.engine.model.PROJECTIONS)


def pick_engine(kind: str) -> tuple[str, str | None]:
    """The engine ``kind`` means ("auto": fast if torch imports, else reference) and, for auto, why."""
    if kind != "auto":
        return kind, None
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("fast.engine") is None:
        return "reference", "reference engine: torch (or fast.engine) is not installed here, so not the fast engine"
    try:
        importlib.import_module("fast.engine")
    except ImportError as e:
        return "reference", f"reference engine: the fast engine does not import here ({e})"
    return "fast", None


def parse_compressed(value: str | None) -> tuple[str, ...]:
    """``--compressed`` as a tuple of projection names: "" or None -> (), "all" -> every projection."""
    if not value:
        return ()
    names = PROJECTIONS if value == "all" else tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = sorted(set(names) - set(PROJECTIONS))
    if unknown:
        raise ValueError(f"--compressed names unknown matrices {unknown}: choose from {','.join(PROJECTIONS)}")
    return names


def load_engine(model: str, kind: str = "reference", *, tenants: Tenants | None = None, policy: str = "sjf+wfq",
                dtype: str = "bfloat16", compressed: tuple[str, ...] = (), pipeline: str | None = None,
                micro_batches: int = 2, pipeline_step_timeout_s: float = 120.0, pipeline_restarts: int = 2,
                threads: int | None = None,
                **engine_kwargs: Any) -> Any:
    """An engine over ``model`` (a packaged model name, a checkpoint path or a container) with its tokenizer.

    ``threads``: torch threads of the fast engine (None: the cores this process may run on).
    ``pipeline``: a chain of stages (``"2"``, ``"cpu:2,cpu:1x2"``): the torch engine split over stage
    processes by the placement's best split (``fast.pipeline``), whatever ``kind`` says; a stage that dies or
    hangs is restarted and its requests recomputed, up to ``pipeline_restarts`` times in a row."""
    if compressed and kind != "fast" and not pipeline:  # a pipeline's stages are torch's whatever kind says
        raise EngineUnavailable(f"--compressed {','.join(compressed)} needs the fast engine (the reference engine "
                                "decodes a container to float32 and serves it plain)")
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
                                             step_timeout_s=pipeline_step_timeout_s, compressed=tuple(compressed),
                                             restarts=pipeline_restarts,
                                             **options)
        except fast_pipeline.PipelineError as e:
            raise EngineUnavailable(str(e)) from None
    if kind == "reference":
        from reference.engine.engine import Engine
        from reference.model.llama import LlamaModel
        from reference.model.tokenizer import load_tokenizer
        from reference.model.weights import open_weights

        source = open_weights(model)  # opened once: the model and its tokenizer read the same files
        return Engine(LlamaModel.load(source), load_tokenizer(source), **options)
    if kind == "fast":
        try:
            fast_engine = importlib.import_module("fast.engine")
        except ImportError as e:
            raise EngineUnavailable(f"--engine fast needs the fast engine (fast.engine), which cannot be imported "
                                    f"here: {e}. Install the fast extra (pip install -e '.[fast]') on a checkout "
                                    "that has fast/engine, or use --engine reference") from None
        return fast_engine.Engine.load(model=model, dtype=dtype, compressed=tuple(compressed), threads=threads,
                                       **options)
    raise EngineUnavailable(f"unknown engine {kind!r}: use 'reference' or 'fast'")


# -- the command line ------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the engine ``python -m serve`` builds (the model, its runner, the scheduler)."""
    g = p.add_argument_group("engine (see serve/engines.py)")
    g.add_argument("--model", default="smollm2", help="packaged model name or checkpoint path (default smollm2)")
    g.add_argument("--engine", choices=["auto", "reference", "fast"], default="auto",
                   help="auto (default): the fast engine (torch) when torch imports, else the reference (NumPy)")
    g.add_argument("--compressed", nargs="?", const="all", default="",
                   help="projection matrices served compressed (fast engine, pipeline stages, fast workers): "
                        "qkv,o,gate_up,down; bare: all")
    g.add_argument("--dtype", default="bfloat16", help="weights dtype of the fast engine")
    g.add_argument("--policy", default="sjf+wfq", help="scheduling policy: fcfs, sjf, wfq, sjf+wfq (default)")
    g.add_argument("--num-blocks", type=int, default=512, help="KV cache blocks")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    g.add_argument("--max-num-seqs", type=int, default=32, help="sequences in one engine step (default 32)")
    g.add_argument("--max-num-batched-tokens", type=int,
                   help=f"tokens in one engine step, prefill chunks included (default {BUDGET}; {OTHER_BUDGET} "
                        "with --pipeline or disaggregated workers)")
    g.add_argument("--max-prefill-tokens-with-decodes", type=int, metavar="N",
                   help=f"prompt tokens a step may take when it also carries decodes: bounds the inter-token "
                        f"latency a new prompt adds to running streams, while a step without decodes still takes "
                        f"prompts up to the whole budget (default {PREFILL_CAP} with the default budget; none "
                        "with a --max-num-batched-tokens of your own, --pipeline or disaggregated workers)")
    g.add_argument("--decode-stall-budget", type=int, metavar="S",
                   help="a step that carries d decodes takes at most max(1, S // d) prompt tokens (and no more "
                        "than --max-prefill-tokens-with-decodes): a burst's late prompts stall few streams by "
                        "much or many streams by little (the tail of the inter-token latency); default none")
    g.add_argument("--burst-gather-ms", type=float, default=0.0, metavar="MS",
                   help="when requests reach an idle engine, its first step waits while more keep coming "
                        "(each within --burst-gather-gap-ms of the last), for at most MS ms: a burst is prefilled "
                        "together and no early arrival decodes beside the others' prefill chunks (default 0: no "
                        "wait)")
    g.add_argument("--burst-gather-gap-ms", type=float, default=GATHER_GAP_S * 1000, metavar="MS",
                   help=f"with --burst-gather-ms: the longest pause between two arrivals of one burst (default "
                        f"{GATHER_GAP_S * 1000:g}: a burst's requests reach the engine 3-9 ms apart on one busy "
                        "core); a lone request waits this long once")
    g.add_argument("--max-model-len", type=int,
                   help="context length in tokens (default: the model's, capped by the KV cache)")
    g.add_argument("--blas-threads", type=int, default=1, help="BLAS threads of the reference engine")
    g.add_argument("--threads", type=int,
                   help="torch threads of the fast engine (default: the cores this process may run on)")
    g.add_argument("--emulate-step-ms", type=float, default=0.0, metavar="MS",
                   help="emulate a device whose every step takes at least MS ms (the rest slept), so that "
                        "replicas on a machine with few cores scale as devices would (benchmarks of scaling)")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, colocated: bool) -> None:
    """Fill in the step budget's defaults (``colocated``: neither a pipeline nor disaggregated workers) and
    refuse counts below 1."""
    if args.max_num_batched_tokens is None:  # the defaults come as a pair: a budget given alone gets no cap
        args.max_num_batched_tokens = BUDGET if colocated else OTHER_BUDGET
        if args.max_prefill_tokens_with_decodes is None and colocated:
            args.max_prefill_tokens_with_decodes = PREFILL_CAP
    for name in AT_LEAST_ONE:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.emulate_step_ms <= 10_000:
        p.error("--emulate-step-ms must be in 0..10000")
    for name in ("burst_gather_ms", "burst_gather_gap_ms"):
        if not 0 <= getattr(args, name, 0.0) <= 10_000:
            p.error(f"--{name.replace('_', '-')} must be in 0..10000")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """``load_engine``'s keywords from the engine options (the pipeline's come from ``serve.pipeline``)."""
    return dict(policy=args.policy, dtype=args.dtype, compressed=parse_compressed(args.compressed),
                num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                threads=args.threads, max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
                **({"decode_stall_budget": stall} if (stall := getattr(args, "decode_stall_budget", None)) else {}))
