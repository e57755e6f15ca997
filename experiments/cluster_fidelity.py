"""Calibration and fidelity of the cluster simulator against the real reference engine (SmolLM2, CPU).

Two small ShareGPT workloads run on the real NumPy engine, three times each, interleaved; the real
percentiles are the median over the runs, and the largest difference of one run from it is the
engine's own run-to-run spread. A ``StepTimeModel`` is fitted to the measured steps of all runs of
one workload; the other (held out) is replayed through the cluster simulator, one replica with the
engine's exact scheduler settings and KV size, stepping by the fitted model; and the other way
round. Reported: TTFT, inter-token latency (ITL) and end-to-end latency at p50/p90/p99, simulated
vs measured, as relative errors, next to the real engine's run-to-run differences.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.engine_bench import CpuClock, Job, one_blas_thread, run_jobs, sharegpt_jobs, smollm2
from reference.cluster import Simulator, scenario_from_dict
from reference.engine import Engine
from reference.engine.cost import StepTimeModel

ENGINE = {"num_blocks": 128, "block_size": 16, "max_num_batched_tokens": 64, "max_num_seqs": 4}
PS = (50, 90, 99)
METRICS = ("ttft", "itl", "e2e")
RUNS = 3  # real-engine runs of each workload


def workloads(tok: Any) -> dict[str, list[Job]]:
    """A: a burst of longer prompts; B: shorter prompts, longer answers, arriving every 0.4 s."""
    a = sharegpt_jobs(tok, 8, 96, 12, output_scale=1 / 8)
    b = [Job(j.prompt, j.output_len, 0.4 * i) for i, j in enumerate(sharegpt_jobs(tok, 8, 48, 20, skip=20,
                                                                                   output_scale=1 / 4))]
    return {"A": a, "B": b}


def measure(jobs: list[Job]) -> tuple[dict[str, list[float]], list[Any]]:
    """Run the real engine once: its latencies, and its logged steps (the first, which warms caches, left out)."""
    model, tok = smollm2()
    engine = Engine(model, tok, clock=CpuClock(), **ENGINE)
    outs = run_jobs(engine, jobs)
    lat = {"ttft": [o.metrics.ttft for o in outs], "e2e": [o.metrics.e2e_latency for o in outs],
           "itl": [g for o in outs for g in o.metrics.inter_token_latencies]}
    return lat, engine.step_log[1:]


def simulated(jobs: list[Job], cost: StepTimeModel) -> dict[str, list[float]]:
    """The same jobs replayed through the cluster simulator with ``cost`` as every step's time."""
    s = scenario_from_dict({
        "simulation": {"duration_s": 1.0, "block_size": ENGINE["block_size"],
                       "max_num_batched_tokens": ENGINE["max_num_batched_tokens"],
                       "max_num_seqs": ENGINE["max_num_seqs"]},
        "gpu_types": [{"name": "cpu", "memory_gb": 4, "peak_tflops": 0.1, "bandwidth_tbps": 0.01}],
        "models": [{"name": "smollm2", "layers": 30, "hidden": 576, "intermediate": 1536, "heads": 9,
                    "kv_heads": 3, "head_dim": 64, "vocab": 49152}],
        "sites": [{"name": "host", "tier": "edge", "jurisdiction": "X", "gpus": {"cpu": 1},
                   "replicas": [{"model": "smollm2", "gpu": "cpu"}]}],
        "traffic": [{"name": "w", "origins": ["host"], "rate_per_s": 1.0, "models": ["smollm2"], "allowed": ["X"],
                     "lengths": "fixed"}]})
    sim = Simulator(s, 0, cost_override=cost, num_blocks=ENGINE["num_blocks"], record_gaps=True,
                    replay=[(j.arrival, j.prompt, j.output_len) for j in jobs])
    result = sim.run()
    return {"ttft": result.ttft, "e2e": result.e2e, "itl": result.gaps}


def percentile_ms(lat: dict[str, list[float]]) -> dict[str, np.ndarray]:
    """Each metric's p50/p90/p99, in milliseconds."""
    return {m: np.percentile(lat[m], PS) * 1000 for m in METRICS}


def compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Relative error |a - b| / b of each metric's percentiles."""
    return {m: {f"p{p}": round(float(abs(x - y) / y), 4) for p, x, y in zip(PS, a[m], b[m], strict=True)}
            for m in METRICS}


def fidelity(track: Any, repeats: int = RUNS) -> dict[str, Any]:
    """Measure, fit, replay both ways; returns errors, spreads and the fitted models.

    Each workload runs ``repeats`` times, interleaved (A, B, A, B, ...): a change in the shared machine's
    load then hits both alike. The real engine's percentiles are the median over its runs; its run-to-run
    spread is the largest difference of one run from that median."""
    _, tok = smollm2()
    jobs = workloads(tok)
    runs: dict[str, list[tuple[dict[str, list[float]], list[Any]]]] = {"A": [], "B": []}
    with one_blas_thread():
        for name, _ in track([(n, r) for r in range(repeats) for n in ("A", "B")], "E5 real engine runs (SmolLM2)"):
            runs[name].append(measure(jobs[name]))
    out: dict[str, Any] = {"workloads": {n: {"requests": len(j), "prompt_tokens": [len(x.prompt) for x in j],
                                             "output_tokens": [x.output_len for x in j]} for n, j in jobs.items()},
                           "real_runs_per_workload": repeats}
    for fit_on, test_on in (("A", "B"), ("B", "A")):
        steps = [r for _, log in runs[fit_on] for r in log]  # every run of the fitting workload
        cost = StepTimeModel.fit([r.shape() for r in steps], [r.duration for r in steps])
        sim = percentile_ms(simulated(jobs[test_on], cost))
        each = [percentile_ms(lat) for lat, _ in runs[test_on]]
        real = {m: np.median([e[m] for e in each], axis=0) for m in METRICS}
        spread = {m: {f"p{p}": max(v[f"p{p}"] for v in (compare(e, real)[m] for e in each)) for p in PS}
                  for m in METRICS}
        out[f"fit {fit_on} -> test {test_on}"] = {
            "model": cost.__dict__, "sim_vs_real": compare(sim, real), "real_run_to_run": spread,
            "real_ms": {m: [round(float(v), 2) for v in real[m]] for m in METRICS},
            "sim_ms": {m: [round(float(v), 2) for v in sim[m]] for m in METRICS}}
    return out


def table(f: dict[str, Any]) -> str:
    runs = f.get("real_runs_per_workload", 2)
    lines = [f"| fit -> held-out | metric | real p50/p90/p99 (ms, median of {runs} runs) | simulated p50/p90/p99 (ms) "
             "| sim error p50/p90/p99 | real run-to-run p50/p90/p99 (largest of one run) |",
             "|---|---|---|---|---|---|"]
    for key, v in f.items():
        if not key.startswith("fit"):
            continue
        for m in ("ttft", "itl", "e2e"):
            err, spread = v["sim_vs_real"][m], v["real_run_to_run"][m]
            lines.append(f"| {key[4:]} | {m.upper()} | {' / '.join(f'{x:.0f}' for x in v['real_ms'][m])} | "
                         f"{' / '.join(f'{x:.0f}' for x in v['sim_ms'][m])} | "
                         f"{' / '.join(f'{err[p]:.1%}' for p in ('p50', 'p90', 'p99'))} | "
                         f"{' / '.join(f'{spread[p]:.1%}' for p in ('p50', 'p90', 'p99'))} |")
    return "\n".join(lines)
