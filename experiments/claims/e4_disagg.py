"""E4: prefill and decode on separate workers; p90 inter-token latency falls (article: ~100 -> 20-30 ms).

Two regimes, both layouts measured in one run on the same arrivals:

* real processes on this CPU: SmolLM2-135M (NumPy, one BLAS thread per process). Colocated = two
  engine replicas, each a worker process that runs prompts (chunked, 256 tokens/step) and decodes
  in the same steps; disaggregated = one prefill and one decode process (``reference/disagg``, fp32
  KV over TCP). The same coordinator routes requests (fewest in-flight tokens). Poisson arrivals,
  ShareGPT prompt and answer lengths (scaled down for the CPU), at several loads. ITL is measured in
  the decode process's CPU seconds between its tokens (what its own steps cost, prefill chunks
  included, not what other jobs on the shared machine took); the wall-clock ITL and the TTFT come
  from the coordinator's clock (token receipt) and carry the machine's other load.
* the article's regime, simulated: Llama-3.1-8B on H100s (two GPUs either way), the real scheduler
  per GPU, step times from a roofline over ``reference/engine/cost.py``'s FLOPs and bytes
  (``experiments/disagg_sim.py``), ShareGPT lengths unscaled, fp8 KV over a 400 Gbit/s link.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.disagg_sim import Gpu, SimReq, colocated, disaggregated
from experiments.engine_bench import pct, sharegpt_jobs, smollm2
from experiments.registry import Context, Experiment, Result, pyplot, save_figure
from reference.disagg.batch import run_requests
from reference.disagg.cluster import ProcessCluster, WorkerOptions
from reference.model.config import LLAMA_3_1_8B

LAYOUTS = {"colocated": (0, 2), "disaggregated": (1, 1)}


def latencies(coordinator: Any, ids: list[str]) -> dict[str, Any]:
    reqs = [coordinator.requests[i] for i in ids]
    ttft = [r.token_times[0] - r.arrival for r in reqs if r.token_times]
    itl = [g for r in reqs for g in np.diff(r.token_times)]
    cpu_itl = [g for r in reqs for g in np.diff(r.token_cpu)]
    errors = sum(r.result is None or r.result["error"] is not None for r in reqs)
    return {"ttft_ms": pct(ttft), "itl_ms": pct(cpu_itl), "itl_wall_ms": pct(itl), "requests": len(reqs),
            "errors": errors}


def real_processes(ctx: Context, jobs: list, rates: list[float], seed: int) -> tuple[dict, dict]:
    """Latencies per load and layout; and per layout, what the workers counted (handoffs, recomputes)."""
    rng = np.random.default_rng(seed)
    arrivals = {rate: np.cumsum(rng.exponential(1 / rate, len(jobs))).tolist() for rate in rates}
    out: dict[str, dict[str, Any]] = {}
    handoffs: dict[str, dict[str, int]] = {}
    opts = WorkerOptions(num_blocks=256, block_size=16, max_num_batched_tokens=256, max_num_seqs=16)
    for layout, (num_prefill, num_decode) in ctx.track(LAYOUTS.items(), "E4 layouts"):
        with ProcessCluster("smollm2", num_prefill, num_decode, opts=opts, restart=False,
                            deadline=lambda p, o: 600.0) as cluster:
            for rate in rates:
                requests = [{"id": f"{layout}-{rate}-{i}", "prompt_token_ids": j.prompt, "max_tokens": j.output_len}
                            for i, j in enumerate(jobs)]
                run_requests(cluster, requests, arrivals=arrivals[rate], timeout=900)
                out.setdefault(f"{rate}/s", {})[layout] = latencies(cluster.coordinator, [r["id"] for r in requests])
            cluster.shutdown()
        counters = [b["counters"] for b in cluster.byes]
        handoffs[layout] = {k: sum(c.get(k, 0) for c in counters) for k in
                            ("handoffs_complete", "prefills_recomputed", "kv_digest_match", "kv_bytes_received")}
    return out, handoffs


def simulated(jobs_lengths: list[tuple[int, int]], rates: list[float], seed: int) -> dict[str, dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, Any]] = {}
    for rate in rates:
        arrivals = np.cumsum(rng.exponential(1 / rate, len(jobs_lengths)))
        for layout, fn in (("colocated", colocated), ("disaggregated", disaggregated)):
            reqs = [SimReq(float(a), p, o) for a, (p, o) in zip(arrivals, jobs_lengths, strict=True)]
            fn(reqs, LLAMA_3_1_8B, Gpu())
            ttft = [r.token_times[0] - r.arrival for r in reqs]
            itl = [g for r in reqs for g in np.diff(r.token_times)]
            out.setdefault(f"{rate}/s", {})[layout] = {"ttft_ms": pct(ttft), "itl_ms": pct(itl), "requests": len(reqs)}
    return out


def run(ctx: Context) -> Result:
    n, min_prompt, max_prompt, max_output, scale, rates = (24, 128, 384, 24, 0.08, [0.25, 0.5, 1.0]) if ctx.full \
        else (8, 128, 384, 12, 0.05, [0.3, 0.6])
    _, tok = smollm2()
    jobs = [j for j in sharegpt_jobs(tok, 6 * n, max_prompt, max_output, output_scale=scale)
            if len(j.prompt) >= min_prompt][:n]
    cpu, handoffs = real_processes(ctx, jobs, rates, seed=0)
    n_sim = 600 if ctx.full else 200
    lengths = [(len(j.prompt), j.output_len) for j in sharegpt_jobs(tok, n_sim, 8192, 1024)]
    sim_rates = [8.0, 16.0, 32.0, 48.0] if ctx.full else [8.0, 32.0]
    sim = simulated(lengths, sim_rates, seed=1)
    long_rates = [4.0, 8.0, 16.0] if ctx.full else [4.0, 8.0]
    sim_long = simulated([(min(8 * p, 16384), o) for p, o in lengths], long_rates, seed=2)
    figure = plot(cpu, sim, sim_long, ctx)

    def cut(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
        return {load: round(r["colocated"]["itl_ms"]["p90"] / r["disaggregated"]["itl_ms"]["p90"], 2)
                for load, r in rows.items()}

    cpu_cut, sim_cut, long_cut = cut(cpu), cut(sim), cut(sim_long)
    p99_cut = {load: round(r["colocated"]["itl_ms"]["p99"] / r["disaggregated"]["itl_ms"]["p99"], 2)
               for load, r in sim.items()}

    def pairs(rows: dict[str, dict[str, Any]], digits: int) -> str:
        p90 = {load: (r["colocated"]["itl_ms"]["p90"], r["disaggregated"]["itl_ms"]["p90"]) for load, r in rows.items()}
        return ", ".join(f"{c:.{digits}f}->{d:.{digits}f} at {load}" for load, (c, d) in p90.items())

    if min(cpu_cut.values()) >= 3 and min(sim_cut.values()) >= 3:
        verdict = "matches"
    elif min(cpu_cut.values()) >= 2 or max(p99_cut.values()) >= 3:
        verdict = "partly matches"
    else:
        verdict = "differs"
    return Result(
        clock="cpu-process",
        clock_detail=('CPU rows: ITL in CPU seconds of the decode process between tokens, TTFT and itl_wall in '
                      'wall-clock seconds at the coordinator; H100/Llama-3.1-8B rows: simulated seconds from the step '
                      'cost model'),
        measured={"cpu_processes": cpu, "cpu_worker_counters": handoffs, "h100_llama8b_sim": sim,
                  "h100_llama8b_sim_long_prompts": sim_long,
                  "p90_itl_cut_cpu": cpu_cut, "p90_itl_cut_sim": sim_cut, "p99_itl_cut_sim": p99_cut,
                  "p90_itl_cut_sim_long_prompts": long_cut},
        summary=(f"p90 ITL colocated->disaggregated (ms): CPU/SmolLM2 {pairs(cpu, 0)}; H100/8B sim {pairs(sim, 1)} "
                 f"(p99 cut up to {max(p99_cut.values())}x; prompts x8: p90 cut up to {max(long_cut.values())}x)"),
        verdict=verdict,
        why=("'matches' needs a >= 3x cut of p90 ITL at every load in both regimes; 'partly' a >= 2x cut at every "
             "CPU load or a >= 3x cut of the simulated p99. Disaggregation removes prefill chunks from "
             "decode steps, so its ITL is the decode step alone; colocated ITL is hurt only by steps that carry "
             "prefill, which ShareGPT's mostly short prompts make a small share of the steps: the p90 moves less "
             "than the p99, and the cut grows with load and prompt length (the x8 rows). On the CPU a SmolLM2 "
             "decode step is memory-bound (~all weights read per step) and a 256-token prefill chunk costs ~10 "
             "of them, so colocated ITL spikes where a chunk lands; the decode-only worker also gathers a larger "
             "batch per step, whose cost grows with it. The worker processes share the CPU's cores with whatever else "
             "runs (load average in setup.machine): even CPU-time ITL moves between runs, so read them with the "
             "counters."),
        setup={"weights": "smollm2 (NumPy float32, 1 BLAS thread per process) for the CPU runs; Llama-3.1-8B "
                          "shapes for the simulation",
               "clock": "ITL: CPU seconds of the decode process between tokens; TTFT and itl_wall: wall clock at "
                        "the coordinator",
               "workload": f"CPU: the first {n} ShareGPT prompts with >= {min_prompt} tokens, truncated to "
                           f"{max_prompt}, outputs = answer x {scale} capped at {max_output}, Poisson at {rates} "
                           f"req/s; sim: {n_sim} ShareGPT requests (prompts <= 8192, outputs <= 1024 tokens), "
                           f"Poisson at {sim_rates} req/s; and the same with prompts 8x longer (<= 16384: "
                           f"long-context traffic without prefix reuse) at {long_rates} req/s",
               "workers": "colocated: 2 replicas; disaggregated: 1 prefill + 1 decode; 256-token step budget "
                          "on the CPU, 2048 on the simulated H100s",
               "gpu": Gpu().__dict__},
        article={"claim": "p90 ITL ~100 ms colocated -> 20-30 ms disaggregated (3-5x)"},
        figures=[figure],
    )


def plot(cpu: dict[str, Any], sim: dict[str, Any], sim_long: dict[str, Any], ctx: Context) -> str:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for ax, rows, title in ((axes[0], cpu, "CPU, SmolLM2-135M, real processes"),
                            (axes[1], sim, "H100 x2, Llama-3.1-8B, ShareGPT (simulated)"),
                            (axes[2], sim_long, "same, prompts x8 (simulated)")):
        loads = list(rows)
        x = np.arange(len(loads))
        for off, layout in ((-0.2, "colocated"), (0.2, "disaggregated")):
            p90 = [rows[ld][layout]["itl_ms"]["p90"] for ld in loads]
            p99 = [rows[ld][layout]["itl_ms"]["p99"] for ld in loads]
            bars = ax.bar(x + off, p90, 0.4, label=f"{layout} p90")
            ax.scatter(x + off, p99, marker="_", s=200, color=bars.patches[0].get_facecolor(), label=f"{layout} p99")
        ax.set_xticks(x, loads)
        ax.set_xlabel("arrival rate")
        ax.set_ylabel("inter-token latency (ms)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    return save_figure(fig, ctx, "E4.png")


EXPERIMENT = Experiment(claim="E4", title="Prefill/decode disaggregation", run=run, quick_minutes=2)
