"""E5: cluster utilization with prefill/decode disaggregation, and the simulator's fidelity.

1. Disaggregation at the same GPU count. One site of 8 H100s serves a Llama-8B-shaped model either as
   8 colocated replicas (chunked prefill mixed with decodes, the engine's scheduler) or as P prefill
   + (8 - P) decode replicas (KV handed over at the site's 400 Gbit/s). Traffic: ShareGPT lengths,
   Poisson, at a ladder of rates. A rate is *sustained* under an SLO when TTFT p90 <= 1 s and the p99 gap
   between consecutive tokens (ITL) <= 25 ms (strict) or 50 ms (loose): a colocated step that carries
   a long prefill chunk stalls every decode in it. Utilization is measured while requests arrive (not during the drain).
   For each layout, at its highest sustained rate: GPU busy share and compute
   utilization (FLOPs done / peak), and the prefill pool's compute utilization while busy.
2. Fidelity (``experiments.edge.cluster_fidelity``): three ShareGPT workloads on the real SmolLM2 engine (a burst,
   paced below capacity, paced over capacity), in interleaved rounds with a profiling sweep of every step
   shape the engine can take; the step cost model is fitted on the sweep alone (every workload held out)
   and each workload replayed in the simulator; fitting on the other workloads instead is a contrast column.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.edge.cluster_fidelity import errors, fidelity, table
from experiments.edge.common import ASSUMPTIONS, SHARED_MACHINE, scenario, site
from experiments.edge.common import GPUS as GPU_TYPES
from experiments.engine.stats import CLOCK
from experiments.registry import Context, Experiment, Result, pyplot, save_figure
from reference.cluster import scenario_from_dict, simulate
from reference.cluster.lengths import sharegpt_lengths

GPUS = 8
SLOS = {"strict": {"ttft_p90_ms": 1000.0, "itl_p99_ms": 25.0},  # interactive chat: first token within 1 s,
        "loose": {"ttft_p90_ms": 1000.0, "itl_p99_ms": 50.0}}  # and no stall longer than the ITL bound


def fleet(prefill: int, rate: float, duration_s: float) -> dict[str, Any]:
    model = {"model": "llama-8b", "gpu": "H100"}
    replicas = [{**model, "count": GPUS}] if prefill == 0 else \
        [{**model, "count": prefill, "role": "prefill"}, {**model, "count": GPUS - prefill, "role": "decode"}]
    traffic = [{"name": "chat", "origins": ["dc"], "rate_per_s": rate, "models": ["llama-8b"], "allowed": ["W"],
                "max_prompt": 2048, "max_output": 512, "output_scale": 1.0}]
    return scenario([site("dc", "central", "W", replicas)], [], traffic, duration_s=duration_s, models=("llama-8b",),
                    max_wait_s=60.0)


def run(ctx: Context) -> Result:
    duration = 10.0 if ctx.full else 3.0
    rates = [50.0, 100.0, 150.0, 200.0, 250.0, 300.0, 350.0] if ctx.full else [100.0, 200.0, 300.0]
    layouts = {"colocated": 0, "disagg 2P+6D": 2, "disagg 3P+5D": 3} if ctx.full else \
        {"colocated": 0, "disagg 2P+6D": 2}
    lengths = sharegpt_lengths()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in layouts}
    for name, rate in ctx.track([(n, r) for n in layouts for r in rates], "E5 layouts x rates"):
        s = simulate(scenario_from_dict(fleet(layouts[name], rate, duration)), seed=5, lengths=lengths,
                     record_gaps=True).summary()
        runs[name].append({"rate": rate, "ttft_ms": s["ttft_ms"], "itl_ms": s["itl_ms"],
                           "tpot_ms": s["tpot_ms"], "utilization": s["utilization"], "requests": s["requests"],
                           "refused": s["refused"]})
    fid = fidelity(ctx.track, requests=32 if ctx.full else 10, rounds=5 if ctx.full else 3, sweeps=2 if ctx.full else 1)
    figure = plot(runs, ctx)
    by_slo = {slo: compare_at(runs, limits) for slo, limits in SLOS.items()}
    measured: dict[str, Any] = {"slos": SLOS, "runs": runs, "by_slo": by_slo, "fidelity": fid}
    strict, loose = by_slo["strict"], by_slo["loose"]
    if "gain_compute" in strict and "gain_compute" in loose:
        pre = strict["disaggregated"]["utilization"]["prefill"]
        summary = summarize({"measured": measured})
        verdict = "partly matches" if strict["gain_compute"] > 0.2 else "differs"
        why = (f"On the same {GPUS} GPUs, disaggregation keeps decode steps free of prefill chunks, so under a strict "
               f"ITL SLO it sustains {strict['disaggregated']['rate']:g} vs {strict['colocated']['rate']:g} req/s "
               f"({strict['gain_compute']:+.0%} compute utilization; article ~+40%); under a loose one "
               f"{loose['disaggregated']['rate']:g} vs {loose['colocated']['rate']:g} req/s "
               f"({loose['gain_compute']:+.0%}): the gain is a latency-SLO effect more than raw capacity (as vLLM's "
               "documentation warns). The prefill pool's compute utilization while busy "
               f"is {pre['compute_utilization_while_busy']:.0%}: below the assumed achievable MFU of 0.7, so the "
               "article's >= 85% is out of reach by construction. " + fidelity_sentence(fid))
    else:
        summary, verdict = "a layout met no SLO at the tried rates", "inconclusive"
        why = "No rate on the ladder met the SLO for one of the layouts; widen the ladder."
    return Result(
        measured=measured, summary=summary, verdict=verdict, why=why,
        setup={"weights": "none for part 1 (Llama-8B shape); SmolLM2-135M (NumPy engine, 1 BLAS thread) for fidelity",
               "workload": (f"ShareGPT lengths (prompts <= 2048, answers <= 512), Poisson, {duration:g} s per run, "
                            f"rates {rates} req/s; fidelity: three {fid['workloads']['A']['requests']}-request "
                            f"ShareGPT workloads (burst; one every {fid['workloads']['B']['arrival_gap_s']:g} s; "
                            f"one every {fid['workloads']['C']['arrival_gap_s']:g} s), each run {fid['rounds']} times "
                            "on the real engine, interleaved"),
               "fleet": f"{GPUS} H100, layouts {list(layouts)}", "assumptions": ASSUMPTIONS,
               "clock": CLOCK + " (fidelity part)", "time": SHARED_MACHINE},
        article={"claim": "~40% higher cluster GPU utilization than colocated; prefill GPUs >= 85% compute (H100)"},
        clock="simulated",
        clock_detail=("part 1 in simulated seconds (roofline); the fidelity table compares the real engine, "
                      "timed in CPU seconds of its process (1 BLAS thread), with the simulator replaying the same "
                      "workload in simulated seconds"),
        figures=[figure], tables=[table(fid)],
    )


def summarize(record: dict[str, Any]) -> str:
    """The table cell from an E5 record. The article's ">= 85% compute" on prefill GPUs is above what the
    simulated H100 can reach (a step reaches the assumed MFU of peak, cluster_common.GPUS), so the cell names
    that ceiling; the fidelity part names the real engine the simulator is compared with."""
    m = record["measured"]
    strict, loose, fid = m["by_slo"]["strict"], m["by_slo"]["loose"], m["fidelity"]
    if "gain_compute" not in strict or "gain_compute" not in loose:
        return "a layout met no SLO at the tried rates"
    pre = strict["disaggregated"]["utilization"]["prefill"]
    return (f"{GPUS} H100s in the cluster simulator: compute utilization at the highest rate meeting the SLO "
            f"{strict['gain_compute']:+.0%} (ITL p99 <= {m['slos']['strict']['itl_p99_ms']:g} ms), "
            f"{loose['gain_compute']:+.0%} (<= {m['slos']['loose']['itl_p99_ms']:g} ms) vs colocated; prefill pool "
            f"{pre['compute_utilization_while_busy']:.0%} of peak FLOP/s while busy (the simulated H100's ceiling is "
            f"its assumed MFU, {GPU_TYPES['H100']['mfu']:.0%}, below the article's 85%), busy {pre['busy_share']:.0%}; "
            f"simulator vs the real NumPy reference engine (SmolLM2, 1 BLAS thread; every workload held out, fitted "
            f"on a profiling sweep) median {np.median(errors(fid)):.1%}, largest {max(errors(fid)):.1%} at "
            f"p50/p90/p99")


def fidelity_sentence(fid: dict[str, Any]) -> str:
    """The fidelity verdict in words: errors against the 5% goal, next to the real engine's own spread."""
    err, spread = errors(fid), errors(fid, "real_run_to_run")
    where = max(((abs(e), n, m, p) for n, v in fid["held_out"].items() for m, ps in v["sim_vs_real"].items()
                 for p, e in ps.items()), key=lambda x: x[0])
    held = fid["held_out"].values()
    same = sum(s for v in held for s in v["measured_steps_same_schedule"])
    runs = sum(len(v["measured_steps_same_schedule"]) for v in held)
    steps = ", ".join(f"{n} {v['step_error_by_kind']['all steps']['error']:+.1%}" for n, v in fid["held_out"].items())
    sweep = fid["sweep"]
    cover = min(v["coverage"]["steps_inside"] for v in held)
    loo = errors(fid, "leave_one_out_sim_vs_real")
    return (f"Fidelity (table): the step model is fitted on a profiling sweep alone ({len(sweep['scenes'])} scenes "
            f"that make the engine take every kind of step: 1..64 tokens, 1..4 sequences, 0..4 sampled; "
            f"{sum(sweep['steps_per_round'])} steps, {sweep['cpu_seconds']:.0f} CPU-s against the workloads' "
            f"{sweep['workload_cpu_seconds']:.0f}), run as a fourth engine taking turns with the workloads and "
            f"brought to each round's load; every workload is held out, and {cover:.0%} of their steps lie within "
            f"the sweep's ranges (no extrapolation). TTFT/ITL/e2e at p50/p90/p99: median error {np.median(err):.1%}, "
            f"largest {max(err):.1%} ({where[2].upper()} {where[3]}, workload {where[1]}), "
            f"{sum(e > 0.05 for e in err)} of {len(err)} above 5%; the goal of <= 5% is "
            f"{'met' if max(err) <= 0.05 else 'not met'}. The real "
            f"engine's own run-to-run difference is up to {max(spread):.1%} (median {np.median(spread):.1%}) on this "
            f"shared machine. Fitted on the other two workloads instead (leave one out, the previous calibration), "
            f"median {np.median(loo):.1%}, largest {max(loo):.1%}; on the sweep and the other workloads together, "
            f"largest {max(errors(fid, 'sweep_and_others_sim_vs_real')):.1%}. Replayed with the engine's own "
            f"measured step times, the simulator took the engine's very steps in {same} of {runs} runs and its "
            f"latencies are within {max(errors(fid, 'measured_steps_sim_vs_real')):.2%}: what is left is the step "
            f"model's error (held-out step time over all steps: {steps}) and the machine's noise. Found step by step "
            "and fixed: a burst's first request started a step alone in the simulator (the engine takes in every "
            "request that has arrived first); the engine's time outside its step records (intake, detokenizing, "
            "~0.15 ms a step) was not charged, so arrivals near a step's end joined other steps; the step model "
            "priced the output head alike for one or several sampled rows (one CPU core: matrix-vector vs "
            "matrix-matrix) and put 2- and 3-token steps on a straight line they are not on; the model's mean "
            "alone cannot place a percentile that lands in the steps' scatter; and a model fitted on other "
            "workloads extrapolates to step shapes they never took. With the model's mean alone the "
            f"largest error is {max(errors(fid, 'mean_only_sim_vs_real')):.1%}, with the previous model form "
            f"{max(errors(fid, 'previous_form_sim_vs_real')):.1%}, on the same runs.")


def compare_at(runs: dict[str, list[dict[str, Any]]], limits: dict[str, float]) -> dict[str, Any]:
    """Each layout's highest rate meeting ``limits``, and disaggregation's utilization gain there."""
    best = {}
    for name, rows in runs.items():
        ok = [r for r in rows
              if r["ttft_ms"]["p90"] <= limits["ttft_p90_ms"] and r["itl_ms"]["p99"] <= limits["itl_p99_ms"]]
        best[name] = max(ok, key=lambda r: r["rate"]) if ok else None
    out: dict[str, Any] = {"colocated": best.pop("colocated")}
    disagg = [b for b in best.values() if b is not None]
    out["disaggregated"] = max(disagg, key=lambda r: r["rate"]) if disagg else None
    col, dis = out["colocated"], out["disaggregated"]
    if col and dis:
        u = {k: v["utilization"]["all"] for k, v in (("c", col), ("d", dis))}
        out["gain_compute"] = round(u["d"]["compute_utilization"] / u["c"]["compute_utilization"] - 1, 3)
        out["gain_busy"] = round(u["d"]["busy_share"] / u["c"]["busy_share"] - 1, 3)
    return out


def plot(runs: dict[str, list[dict[str, Any]]], ctx: Context) -> str:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for name, rows in runs.items():
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["itl_ms"]["p99"] for r in rows], "o-", label=name)
        axes[1].plot(rates, [r["ttft_ms"]["p90"] for r in rows], "o-", label=name)
        axes[2].plot(rates, [r["utilization"]["all"]["compute_utilization"] for r in rows], "o-", label=name)
    for limits in SLOS.values():
        axes[0].axhline(limits["itl_p99_ms"], color="k", ls=":", lw=1)
    axes[1].axhline(SLOS["strict"]["ttft_p90_ms"], color="k", ls=":", lw=1)
    for ax, label in zip(axes, ("inter-token latency p99 (ms)", "TTFT p90 (ms)", "cluster compute utilization"),
                         strict=True):
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(label)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    return save_figure(fig, ctx, "E5.png")


EXPERIMENT = Experiment(claim="E5", title="Disaggregation: utilization at the same GPU count; simulator fidelity",
                        run=run, quick_minutes=1.75, summarize=summarize)
