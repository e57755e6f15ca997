"""The placement model against an executed pipeline: the optimal and the uniform split on real stage processes.

    python -m experiments.edge.pipeline_exec [--chain cpu:1,cpu:1x2] [--rounds 3] [--prompts 16] [--out FILE]

Two drivers start side by side, each the engine of its own pipeline (``fast.pipeline``) over the same
chain: one with ``best_split``'s layers, one with the uniform split. They take turns (alternating which
goes first) running the same ShareGPT workload (greedy, fixed output length, prefix cache off, so
every round is the same work), so both splits see the same machine load. Per round and split: tokens
per second, each stage's busy time per micro-batch on decode steps, the bubble share, bytes sent
between stages per token. Beside them, the placement model's predictions for the same splits
(``fast/pipeline/chain.py``: the roofline of ``reference.engine.cost`` at nominal CPU rates): per-stage
time, the bubble of a step cut into micro-batches, and the throughput ratio. R2
(``experiments/claims/r2_pipeline_placement.py``) runs this and stores it with the modelled numbers.

The chain's slower nodes are emulated: the stage sleeps (slowdown - 1) x its compute time after each
micro-batch (``cpu:1x2``: half as fast), which does not load the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.engine.stats import spread, spread_text

ROOT = Path(__file__).resolve().parents[2]
CHAIN = "cpu:1,cpu:1x2"


def _workload(n: int, max_prompt: int) -> list[list[int]]:
    from reference.model.tokenizer import load_tokenizer
    from reference.workload import iter_sharegpt

    tok = load_tokenizer("smollm2")
    return [tok.encode(c.prompt)[:max_prompt] for c in iter_sharegpt(limit=n)]


def drive(args: argparse.Namespace) -> int:
    """A driver: build the pipeline engine, then answer 'run' lines on stdin with one JSON line each."""
    from fast.pipeline import load_engine
    from fast.pipeline.chain import predicted_bubble
    from reference.engine.params import SamplingParams

    engine = load_engine(args.model, args.chain, dtype=args.dtype, micro_batches=args.micro_batches, split=args.split,
                         max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks, block_size=16,
                         max_num_batched_tokens=args.max_num_batched_tokens, prefix_cache=False)
    runner = engine.runner
    p = runner.plan
    prompts = _workload(args.prompts, args.max_prompt)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    times = p.stage_times()
    cal = engine.model.calibration
    print(json.dumps({"ready": True, "bounds": list(p.bounds), "layers": list(p.split.layers),
                      "calibration_s": {"layer": cal[0], "head": cal[1]} if cal else None,
                      "optimal_layers": list(p.optimal.layers), "uniform_layers": list(p.uniform.layers),
                      "model_stage_s": times, "model_bottleneck_s": p.split.bottleneck_s,
                      "model_uniform_stage_s": p.stage_times(p.uniform),
                      "model_uniform_bottleneck_s": p.uniform.bottleneck_s,
                      "model_bubble": predicted_bubble(times, args.micro_batches)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        engine.step_log.clear()
        runner.stats.steps.clear()
        runner.stats.bytes_between_stages = runner.stats.tokens = 0
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - started
        print(json.dumps(summarise(engine, outs, wall, load_before, args.micro_batches)), flush=True)
    runner.close()
    return 0


def summarise(engine: Any, outs: list[Any], wall: float, load_before: float, micro_batches: int) -> dict[str, Any]:
    """One round: throughput, per-stage busy per micro-batch on decode steps, bubble share, bytes per token."""
    from fast.pipeline.chain import micro_batch_shape, placement_problem

    runner = engine.runner
    steps, log = runner.stats.steps, engine.step_log
    is_decode = [not any(rec.is_prefill) for rec in log]
    decode = [s for s, d in zip(steps, is_decode, strict=True) if d]
    k = len(runner.plan.nodes)
    per_piece = [[float(np.mean([e - b for s in decode for b, e in s.stage_busy[j]]))] for j in range(k)]
    step_wall = sum(s.end - s.begin for s in steps)
    busy = sum(e - b for s in steps for stage in s.stage_busy for b, e in stage)
    # the model at the decode steps' mean shape (sequences per piece, context)
    seqs = float(np.mean([len(rec.new_tokens) for rec, d in zip(log, is_decode, strict=True) if d]))
    ctx = int(np.mean([c for rec, d in zip(log, is_decode, strict=True) if d for c in rec.context_lens]))
    shape = micro_batch_shape(int(round(seqs)), micro_batches, ctx)
    problem = placement_problem(runner.config, list(runner.plan.nodes), shape, runner.stage.model.dtype_name)
    b = runner.plan.bounds
    generated = sum(len(o.output_token_ids) for o in outs)
    return {"wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall,
            "computed_tokens": runner.stats.tokens, "steps": len(steps), "decode_steps": len(decode),
            "stage_busy_per_piece_s": [v[0] for v in per_piece],
            "roofline_stage_s_at_shape": [problem.stage_time(j, b[j], b[j + 1]) for j in range(k)],
            "decode_seqs_per_step": seqs, "decode_context": ctx,
            "bubble_share": 1.0 - busy / (k * step_wall),
            "step_share_of_wall": step_wall / wall,
            "bytes_between_stages_per_token": runner.stats.bytes_between_stages / runner.stats.tokens,
            # the nominal placement model's (reference/cluster/pipeline.py): bf16 activations, hidden x 2 bytes a hop
            "model_bytes_between_stages_per_token": (k - 1) * runner.config.hidden_size * 2,
            "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
            "output_tokens": [o.output_token_ids for o in outs]}


def measure(*, model: str = "smollm2", chain: str = CHAIN, rounds: int = 3, prompts: int = 16, max_prompt: int = 48,
            max_tokens: int = 24, max_num_seqs: int = 16, micro_batches: int = 2,
            dtype: str = "bfloat16") -> dict[str, Any]:
    """Both splits side by side in ``rounds`` alternating rounds; returns every round and the summary."""
    common = ["--model", model, "--chain", chain, "--prompts", str(prompts), "--max-prompt", str(max_prompt),
              "--max-tokens", str(max_tokens), "--max-num-seqs", str(max_num_seqs), "--micro-batches",
              str(micro_batches), "--dtype", dtype]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    drivers = {split: subprocess.Popen([sys.executable, "-m", "experiments.edge.pipeline_exec", "--driver", "--split",
                                        split,
                                        *common], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                       cwd=ROOT)
               for split in ("optimal", "uniform")}
    try:
        ready = {split: _line(d, split) for split, d in drivers.items()}
        runs: dict[str, list[dict[str, Any]]] = {"optimal": [], "uniform": []}
        for r in range(rounds):
            for split in (("optimal", "uniform") if r % 2 == 0 else ("uniform", "optimal")):
                drivers[split].stdin.write("run\n")
                drivers[split].stdin.flush()
                runs[split].append(_line(drivers[split], split))
        for d in drivers.values():
            d.stdin.write("quit\n")
            d.stdin.close()
            d.wait(timeout=60)
    finally:
        for d in drivers.values():
            if d.poll() is None:
                d.kill()
    same = all(a["output_tokens"] == b["output_tokens"] for a in runs["optimal"] for b in runs["uniform"])
    for rs in runs.values():
        for x in rs:
            del x["output_tokens"]
    ratios = [o["tokens_per_s"] / u["tokens_per_s"] for o, u in zip(runs["optimal"], runs["uniform"], strict=True)]
    o = ready["optimal"]  # both splits in the optimal driver's (calibrated) problem
    model_ratio = o["model_uniform_bottleneck_s"] / o["model_bottleneck_s"]

    def makespan(times: list[float]) -> float:
        return sum(times) + (micro_batches - 1) * max(times)

    step_ratio = makespan(o["model_uniform_stage_s"]) / makespan(o["model_stage_s"])
    per_split = {}
    for split, rs in runs.items():
        busy = np.mean([x["stage_busy_per_piece_s"] for x in rs], axis=0)
        modelled = np.asarray(ready[split]["model_stage_s"])
        roofline = np.mean([x["roofline_stage_s_at_shape"] for x in rs], axis=0)
        per_split[split] = {
            "layers": ready[split]["layers"], "tokens_per_s": spread([x["tokens_per_s"] for x in rs]),
            "calibration_ms": {k: round(1000 * v, 2) for k, v in (ready[split]["calibration_s"] or {}).items()},
            "stage_busy_per_piece_ms": [round(1000 * float(v), 2) for v in busy],
            "model_stage_ms": [round(1000 * float(v), 2) for v in modelled],
            "measured_over_model": [round(float(a / m), 3) for a, m in zip(busy, modelled, strict=True)],
            "roofline_stage_ms": [round(1000 * float(v), 2) for v in roofline],
            "bubble_share": spread([x["bubble_share"] for x in rs]),
            "model_bubble_share": round(ready[split]["model_bubble"], 3),
            "bytes_between_stages_per_token": round(float(np.mean([x["bytes_between_stages_per_token"] for x in rs])),
                                                    1),
            "model_bytes_between_stages_per_token": rs[0]["model_bytes_between_stages_per_token"]}
    loads = [x[k] for rs in runs.values() for x in rs for k in ("load_average_before", "load_average_after")]
    return {"chain": chain, "model": model, "dtype": dtype, "micro_batches": micro_batches, "rounds": rounds,
            "workload": f"{prompts} ShareGPT prompts cut to {max_prompt} tokens, {max_tokens} output tokens each "
                        f"(greedy), up to {max_num_seqs} sequences per step, prefix cache off",
            "optimal": per_split["optimal"], "uniform": per_split["uniform"],
            "throughput_ratio": spread(ratios), "model_ratio_steady_state": round(model_ratio, 3),
            "model_ratio_one_step": round(step_ratio, 3), "same_tokens_both_splits": same,
            "load_average": {"min": round(min(loads), 2), "max": round(max(loads), 2)}, "runs": runs}


def _line(d: subprocess.Popen, split: str) -> dict[str, Any]:
    line = d.stdout.readline()
    if not line:
        raise RuntimeError(f"the {split} driver exited (code {d.wait()}) before answering")
    return json.loads(line)


def text(m: dict[str, Any]) -> str:
    o, u = m["optimal"], m["uniform"]
    return (f"executed on {m['chain']} ({m['model']}, {m['dtype']}): optimal {o['layers']} vs uniform {u['layers']} "
            f"layers: {spread_text(m['throughput_ratio'])} tokens/s (model: {m['model_ratio_one_step']:.2f}x per step, "
            f"{m['model_ratio_steady_state']:.2f}x steady state)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.edge.pipeline_exec", description=__doc__.splitlines()[0])
    p.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--split", default="optimal", help=argparse.SUPPRESS)
    p.add_argument("--model", default="smollm2", help="model to split")
    p.add_argument("--chain", default=CHAIN, help="the chain of stages")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    p.add_argument("--prompts", type=int, default=16, help="prompts per round")
    p.add_argument("--max-prompt", type=int, default=48, help="longest prompt in tokens")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per prompt")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens in one step")
    p.add_argument("--num-blocks", type=int, default=256, help="KV cache blocks")
    p.add_argument("--micro-batches", type=int, default=2, help="pieces a step is cut into")
    p.add_argument("--dtype", default="bfloat16", help="weights dtype")
    p.add_argument("--out", type=Path, help="write the measurement here (JSON)")
    args = p.parse_args(argv)
    if args.driver:
        return drive(args)
    m = measure(model=args.model, chain=args.chain, rounds=args.rounds, prompts=args.prompts,
                max_prompt=args.max_prompt, max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs,
                micro_batches=args.micro_batches, dtype=args.dtype)
    print(text(m))
    if args.out:
        from reference.safe_write import write_text

        write_text(args.out, json.dumps(m, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
