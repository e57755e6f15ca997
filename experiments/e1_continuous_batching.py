"""E1: continuous batching refills a finished sequence's slot at once; static batching waits for the batch.

The same ShareGPT requests run through our NumPy engine (SmolLM2-135M, float32, this CPU) twice:
with the continuous batcher (FCFS, chunked prefill, token budget) and with static batching (a
batch is admitted only into an empty engine and runs until its longest member finishes). All
requests arrive at once (a burst); both runs use the same batch size limit and token budget.
Measured on the engine clock: throughput (generated tokens / s), TTFT, and every inter-token gap.
"""

from __future__ import annotations

from typing import Any

from experiments.engine_bench import CLOCK, CpuClock, one_blas_thread, pct, run_jobs, sharegpt_jobs, smollm2
from experiments.registry import Context, Experiment, Result
from reference.engine import Engine

POLICIES = {"continuous": "fcfs", "static": "static"}


def measure(policy: str, jobs: list, max_seqs: int, budget: int) -> dict[str, Any]:
    model, tok = smollm2()
    engine = Engine(model, tok, clock=CpuClock(),
                    num_blocks=256, block_size=16, max_num_batched_tokens=budget,
                    max_num_seqs=max_seqs, policy=policy, prefix_cache=False)
    t0 = engine.clock()
    outs = run_jobs(engine, jobs)
    wall = engine.clock() - t0
    generated = sum(len(o.output_token_ids) for o in outs)
    ttft = [o.metrics.ttft for o in outs]
    itl = [g for o in outs for g in o.metrics.inter_token_latencies]
    e2e = [o.metrics.e2e_latency for o in outs]
    return {"policy": policy, "wall_s": round(wall, 2), "generated_tokens": generated,
            "throughput_tok_s": round(generated / wall, 2), "steps": len(engine.step_log),
            "ttft_ms": pct(ttft), "itl_ms": pct(itl), "e2e_ms": pct(e2e),
            "mean_batch": round(sum(len(r.new_tokens) for r in engine.step_log) / len(engine.step_log), 2),
            "_ttft": ttft, "_itl": itl}


def run(ctx: Context) -> Result:
    n, max_prompt, max_output, scale = (64, 256, 256, 0.25) if ctx.full else (24, 96, 64, 0.125)
    max_seqs, budget = 8, 128
    _, tok = smollm2()
    jobs = sharegpt_jobs(tok, n, max_prompt, max_output, output_scale=scale)
    with one_blas_thread():
        runs = {name: measure(policy, jobs, max_seqs, budget) for name, policy in ctx.track(POLICIES.items(),
                                                                                            "E1 policies")}
    figure = plot(runs, ctx)
    for r in runs.values():
        r.pop("_ttft")
        r.pop("_itl")
    c, s = runs["continuous"], runs["static"]
    speedup = c["throughput_tok_s"] / s["throughput_tok_s"]
    ttft_better = c["ttft_ms"]["p50"] < s["ttft_ms"]["p50"] and c["ttft_ms"]["p90"] < s["ttft_ms"]["p90"]
    itl_better = c["itl_ms"]["p50"] <= s["itl_ms"]["p50"] and c["itl_ms"]["p99"] <= s["itl_ms"]["p99"]
    verdict = "matches" if ttft_better and itl_better else "partly matches" if ttft_better else "differs"
    return Result(
        measured={"runs": runs, "throughput_ratio": round(speedup, 3)},
        summary=(f"continuous vs static: {speedup:.2f}x tok/s; TTFT p50 {c['ttft_ms']['p50']:.0f} vs "
                 f"{s['ttft_ms']['p50']:.0f} ms; ITL p50/p99 {c['itl_ms']['p50']:.0f}/{c['itl_ms']['p99']:.0f} vs "
                 f"{s['itl_ms']['p50']:.0f}/{s['itl_ms']['p99']:.0f} ms"),
        verdict=verdict,
        why=("'matches' needs lower TTFT (p50, p90) and ITL (p50, p99) with continuous batching. ITL under "
             "continuous batching includes steps that also carry other requests' prefill chunks, which "
             "static batching never mixes into a running batch."),
        setup={"clock": CLOCK,
               "weights": "smollm2 (Q4_1 GGUF dequantized, float32 NumPy engine, 1 BLAS thread)",
               "workload": (f"first {n} ShareGPT first-turn prompts, truncated to {max_prompt} tokens; output "
                            f"length = answer tokens x {scale} (rounded up) capped at {max_output}, end token "
                            f"ignored; all arriving at t=0; output lengths {[j.output_len for j in jobs]}"),
               "engine": f"max_num_seqs={max_seqs}, token budget {budget}/step, block 16, prefix cache off"},
        article={"claim": "continuous batching lowers TTFT and ITL vs static batching (qualitative)"},
        figures=[figure],
    )


def plot(runs: dict[str, dict[str, Any]], ctx: Context) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for name, r in runs.items():
        for ax, key in zip(axes[:2], ["_ttft", "_itl"], strict=True):
            v = np.sort(np.asarray(r[key]) * 1000)
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
    axes[0].set_xlabel("TTFT (ms)")
    axes[1].set_xlabel("inter-token latency (ms)")
    axes[1].set_xscale("log")
    for ax in axes[:2]:
        ax.set_ylabel("fraction of requests / gaps")
        ax.legend()
    names = list(runs)
    axes[2].bar(names, [runs[n]["throughput_tok_s"] for n in names], color=["tab:blue", "tab:orange"])
    axes[2].set_ylabel("generated tokens / s")
    axes[2].set_title("throughput (SmolLM2, NumPy, 1 CPU thread)", fontsize=9)
    fig.tight_layout()
    ctx.results_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(ctx.results_dir / "E1.png", dpi=110)
    plt.close(fig)
    return "E1.png"


EXPERIMENT = Experiment(claim="E1", title="Continuous batching vs static batching", run=run, quick_minutes=1.5)
