"""E1: continuous batching refills a finished sequence's slot at once; static batching waits for the batch.

The same ShareGPT requests run through our NumPy engine (SmolLM2-135M, float32, this CPU) twice:
with the continuous batcher (FCFS, chunked prefill, token budget) and with static batching (a
batch is admitted only into an empty engine and runs until its longest member finishes). All
requests arrive at once (a burst); both runs use the same batch size limit and token budget.
Measured on the engine clock: throughput (generated tokens / s), TTFT, and every inter-token gap. The
headline is the ratio of the two policies measured back to back, repeated; absolute times are context.
"""

from __future__ import annotations

from typing import Any

from experiments.engine.stats import (
    CLOCK,
    CpuClock,
    against,
    inconclusive,
    one_blas_thread,
    pct,
    run_jobs,
    sharegpt_jobs,
    smollm2,
    spread,
    spread_text,
)
from experiments.registry import Context, Experiment, Result, pyplot, save_figure
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
    n, max_prompt, max_output, scale = (64, 256, 256, 0.25) if ctx.full else (16, 96, 32, 0.125)
    repeats = 5 if ctx.full else 3
    max_seqs, budget = 8, 128
    _, tok = smollm2()
    jobs = sharegpt_jobs(tok, n, max_prompt, max_output, output_scale=scale)
    # each repeat measures both policies back to back (order alternating), so a ratio is from one run
    pairs = [(k, name) for k in range(repeats) for name in (list(POLICIES) if k % 2 == 0 else list(POLICIES)[::-1])]
    repeat_runs: list[dict[str, dict[str, Any]]] = [{} for _ in range(repeats)]
    with one_blas_thread():
        for k, name in ctx.track(pairs, f"E1 policies x {repeats} repeats"):
            repeat_runs[k][name] = measure(POLICIES[name], jobs, max_seqs, budget)
    runs = repeat_runs[0]
    figure = plot(runs, ctx)
    for rr in repeat_runs:
        for r in rr.values():
            r.pop("_ttft")
            r.pop("_itl")
    ratios = ratios_of(repeat_runs)
    ttft_p50_abs = {name: spread([rr[name]["ttft_ms"]["p50"] for rr in repeat_runs], 1) for name in POLICIES}
    c, s = runs["continuous"], runs["static"]
    verdict = verdict_of(ratios)
    return Result(
        measured={"runs": runs, "repeats": repeats, "ratios": ratios, "ttft_p50_ms_by_repeat": ttft_p50_abs,
                  "repeat_runs": repeat_runs[1:],
                  "throughput_ratio": ratios["throughput_continuous_over_static"]["median"]},
        summary=(f"reference NumPy engine (SmolLM2, 1 thread), continuous vs static, ratios within one run: TTFT p50 "
                 f"{spread_text(ratios['ttft_p50_static_over_continuous'])} lower, tok/s "
                 f"{spread_text(ratios['throughput_continuous_over_static'])}, ITL p99 "
                 f"{spread_text(ratios['itl_p99_static_over_continuous'])} lower; absolute (first run, CPU time): "
                 f"TTFT p50 {c['ttft_ms']['p50']:.0f} vs {s['ttft_ms']['p50']:.0f} ms, ITL p50 "
                 f"{c['itl_ms']['p50']:.0f} vs {s['itl_ms']['p50']:.0f} ms"),
        verdict=verdict,
        headline={"name": "TTFT p50 static/continuous", "value": ratios["ttft_p50_static_over_continuous"]["median"],
                  "min": ratios["ttft_p50_static_over_continuous"]["min"],
                  "max": ratios["ttft_p50_static_over_continuous"]["max"]},
        why=("'matches' needs lower TTFT (p50, p90) and ITL (p50, p99) with continuous batching in every repeat "
             "(ratio static/continuous > 1 for TTFT and >= 1 for ITL at its minimum over the repeats); 'partly "
             "matches' lower TTFT in every repeat but an ITL ratio below 1 in every repeat; 'differs' a TTFT ratio "
             "below 1 in every repeat; where a ratio's spread over the repeats straddles its threshold, the "
             "verdict is 'inconclusive' and names that spread (the rule depends on the min and max only, so not "
             "on the order of the repeats). ITL under continuous batching includes steps that also "
             "carry other requests' prefill chunks, which static batching never mixes into a running batch."),
        clock="cpu-process",
        clock_detail=CLOCK,
        setup={"weights": "smollm2 (Q4_1 GGUF dequantized, float32 NumPy engine, 1 BLAS thread)",
               "workload": (f"first {n} ShareGPT first-turn prompts, truncated to {max_prompt} tokens; output "
                            f"length = answer tokens x {scale} (rounded up) capped at {max_output}, end token "
                            f"ignored; all arriving at t=0; output lengths {[j.output_len for j in jobs]}"),
               "engine": f"max_num_seqs={max_seqs}, token budget {budget}/step, block 16, prefix cache off",
               "repeats": f"{repeats} repeats, each running both policies back to back (order alternating)"},
        article={"claim": "continuous batching lowers TTFT and ITL vs static batching (qualitative)"},
        figures=[figure],
    )


RATIOS = {  # the ratio, its numerator and denominator policy, the figure
    "throughput_continuous_over_static": ("continuous", "static", "throughput_tok_s", None),
    "ttft_p50_static_over_continuous": ("static", "continuous", "ttft_ms", "p50"),
    "ttft_p90_static_over_continuous": ("static", "continuous", "ttft_ms", "p90"),
    "itl_p50_static_over_continuous": ("static", "continuous", "itl_ms", "p50"),
    "itl_p99_static_over_continuous": ("static", "continuous", "itl_ms", "p99"),
}
# the verdict's criteria: the ratio, its threshold, whether it must exceed it (TTFT) or may equal it (ITL)
CRITERIA = {"TTFT p50 ratio": ("ttft_p50_static_over_continuous", 1.0, True),
            "TTFT p90 ratio": ("ttft_p90_static_over_continuous", 1.0, True),
            "ITL p50 ratio": ("itl_p50_static_over_continuous", 1.0, False),
            "ITL p99 ratio": ("itl_p99_static_over_continuous", 1.0, False)}


def ratios_of(repeat_runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each ratio of RATIOS over the repeats (each repeat ran both policies back to back), as a spread."""
    def value(r: dict[str, Any], key: str, pct_: str | None) -> float:
        return r[key] if pct_ is None else r[key][pct_]

    return {name: spread([value(rr[a], key, p) / value(rr[b], key, p) for rr in repeat_runs])
            for name, (a, b, key, p) in RATIOS.items()}


def verdict_of(ratios: dict[str, dict[str, Any]]) -> str:
    """The verdict from the ratios' spreads: see ``why`` in ``run``."""
    where = {name: against(ratios[key], thr, strict) for name, (key, thr, strict) in CRITERIA.items()}
    ttft, itl = [n for n in where if n.startswith("TTFT")], [n for n in where if n.startswith("ITL")]
    if any(where[n] == "fails" for n in ttft):
        return "differs"
    if all(where[n] == "clears" for n in ttft + itl):
        return "matches"
    if all(where[n] == "clears" for n in ttft) and any(where[n] == "fails" for n in itl):
        return "partly matches"
    name = next(n for n in ttft + itl if where[n] == "straddles")
    key, thr, _ = CRITERIA[name]
    return inconclusive(name, ratios[key], thr) + "; TTFT lower in every repeat" * all(
        where[n] == "clears" for n in ttft)


def plot(runs: dict[str, dict[str, Any]], ctx: Context) -> str:
    plt = pyplot()
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
    return save_figure(fig, ctx, "E1.png")


EXPERIMENT = Experiment(claim="E1", title="Continuous batching vs static batching", run=run, quick_minutes=1.25,
                        alone=True)
