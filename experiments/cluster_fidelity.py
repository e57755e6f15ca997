"""Calibration and fidelity of the cluster simulator against the real reference engine (SmolLM2, CPU).

Three ShareGPT workloads run on the real NumPy engine, in interleaved rounds (A, B, C, A, B, C, ...):

* A, a burst: every request at once, longer prompts (chunked prefill), short answers;
* B, paced below capacity: a request every 0.8 s, 48-token prompts, 20-token answers;
* C, paced over capacity: a request every 0.4 s, the same kind of requests: a queue builds up.

Each workload is held out in turn. In every round a ``StepTimeModel`` is fitted to the measured steps of
the *other* workloads of that round (calibrated under the same machine load as the test run: the machine
is shared and its load moves between rounds), and the held-out workload is replayed through the cluster
simulator, one replica with the engine's scheduler settings and KV size, stepping by that model. Per
round: the simulated TTFT, inter-token latency (ITL) and end-to-end latency at p50/p90/p99 against that
round's real run, as signed relative errors; the reported error is the median over the rounds. The real
percentiles shown are the median over the runs, and the largest difference of one run from them is the
engine's own run-to-run spread.

Step-level evidence comes with it: the held-out prediction error per kind of step (one-token decodes of
1..4 sequences, prompt-only steps, mixed steps), the steps the simulator took against the steps the engine
took (same scheduler: the same kinds in about the same numbers), and the errors of the previous model
form (without ``multi_sample`` and ``row_extra``) on the same runs.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np

from experiments.engine_bench import CpuClock, Job, one_blas_thread, run_jobs, sharegpt_jobs, smollm2
from reference.cluster import Simulator, scenario_from_dict
from reference.engine import Engine, SamplingParams
from reference.engine.cost import StepShape, StepTimeModel

ENGINE = {"num_blocks": 128, "block_size": 16, "max_num_batched_tokens": 64, "max_num_seqs": 4}
PS = (50, 90, 99)
METRICS = ("ttft", "itl", "e2e")
FORM = {"multi_sample": True, "row_extra": 2}  # the model form of the table; {} is the previous one
GAPS = {"B": 0.8, "C": 0.4}  # seconds between arrivals of the paced workloads
NAMES = {"A": "burst", "B": "paced, below capacity", "C": "paced, over capacity"}


def workloads(tok: Any, n: int) -> dict[str, list[Job]]:
    """A: ``n`` longer prompts at once; B and C: ``n`` other conversations each, paced (``GAPS``)."""
    def paced(skip: int, gap: float) -> list[Job]:
        jobs = sharegpt_jobs(tok, n, 48, 20, skip=skip, output_scale=1 / 4)
        return [Job(j.prompt, j.output_len, gap * i) for i, j in enumerate(jobs)]

    return {"A": sharegpt_jobs(tok, n, 96, 12, output_scale=1 / 8), "B": paced(n, GAPS["B"]),
            "C": paced(2 * n, GAPS["C"])}


def measure(jobs: list[Job]) -> tuple[dict[str, list[float]], list[Any]]:
    """Run the real engine once: its latencies, and every step it logged."""
    model, tok = smollm2()
    engine = Engine(model, tok, clock=CpuClock(), **ENGINE)
    outs = run_jobs(engine, jobs)
    lat = {"ttft": [o.metrics.ttft for o in outs], "e2e": [o.metrics.e2e_latency for o in outs],
           "itl": [g for o in outs for g in o.metrics.inter_token_latencies]}
    return lat, engine.step_log


class Recorder:
    """A step cost model that also keeps the shape of every step it priced once ``on`` is set."""

    def __init__(self, cost: StepTimeModel) -> None:
        self.cost, self.on, self.shapes = cost, False, []

    def __call__(self, s: StepShape) -> float:
        if self.on:
            self.shapes.append(s)
        return self.cost(s)


def simulated(jobs: list[Job], cost: StepTimeModel) -> tuple[dict[str, list[float]], list[StepShape]]:
    """The same jobs replayed through the cluster simulator with ``cost`` as every step's time; the
    latencies and the shapes of the steps it took."""
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
    rec = Recorder(cost)
    sim = Simulator(s, 0, cost_override=rec, num_blocks=ENGINE["num_blocks"], record_gaps=True, macro_steps=False,
                    replay=[(j.arrival, j.prompt, j.output_len) for j in jobs])
    rec.on = True  # the replica priced two reference steps for its load estimates while it was built
    result = sim.run()
    return {"ttft": result.ttft, "e2e": result.e2e, "itl": result.gaps}, rec.shapes


def percentile_ms(lat: dict[str, list[float]]) -> dict[str, np.ndarray]:
    """Each metric's p50/p90/p99, in milliseconds."""
    return {m: np.percentile(lat[m], PS) * 1000 for m in METRICS}


def signed_error(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """(a - b) / b for each metric's percentiles."""
    return {m: (a[m] - b[m]) / b[m] for m in METRICS}


def as_table(e: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    return {m: {f"p{p}": round(float(x), 4) for p, x in zip(PS, e[m], strict=True)} for m in METRICS}


def kind(s: StepShape) -> str:
    """A step's kind by its shape: one-token decodes of k sequences, prompt tokens only, or both."""
    if all(n == 1 for n in s.new_tokens):
        return f"decode x{len(s.new_tokens)}"
    return "prompt only" if all(n > 1 for n in s.new_tokens) else "mixed"


def step_errors(cost: StepTimeModel, steps: list[Any]) -> dict[str, dict[str, float]]:
    """Per kind of step (and over all steps): how many, and (predicted - measured) / measured of their sum."""
    by: dict[str, list[float]] = {}
    for r in steps:
        for key in (kind(r.shape()), "all steps"):
            acc = by.setdefault(key, [0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += cost(r.shape()) - r.duration
            acc[2] += r.duration
    return {k: {"steps": v[0], "error": round(v[1] / v[2], 4)} for k, v in sorted(by.items())}


def fit(steps: list[Any], form: dict[str, Any]) -> StepTimeModel:
    return StepTimeModel.fit([r.shape() for r in steps], [r.duration for r in steps], **form)


def held_out(test: str, jobs: list[Job], runs: dict[str, list[tuple[dict, list]]]) -> dict[str, Any]:
    """Fit on the other workloads round by round, replay ``test``, compare (see the module docstring)."""
    others = [n for n in runs if n != test]
    rounds = len(runs[test])
    real_each = [percentile_ms(lat) for lat, _ in runs[test]]
    real = {m: np.median([e[m] for e in real_each], axis=0) for m in METRICS}
    out: dict[str, Any] = {"fit_on": others}
    for label, form in (("", FORM), ("previous_form_", {})):
        models = [fit([r for n in others for r in runs[n][k][1]], form) for k in range(rounds)]
        sims = [simulated(jobs, m) for m in models]
        errs = [signed_error(percentile_ms(lat), real_each[k]) for k, (lat, _) in enumerate(sims)]
        out[label + "sim_vs_real"] = as_table({m: np.median([e[m] for e in errs], axis=0) for m in METRICS})
        if label:
            continue
        out["sim_vs_real_rounds"] = [as_table(e) for e in errs]
        out["models"] = [m.__dict__ for m in models]
        sim = {m: np.median([percentile_ms(lat)[m] for lat, _ in sims], axis=0) for m in METRICS}
        out["real_ms"] = {m: [round(float(v), 2) for v in real[m]] for m in METRICS}
        out["sim_ms"] = {m: [round(float(v), 2) for v in sim[m]] for m in METRICS}
        per_round = [step_errors(m, runs[test][k][1]) for k, m in enumerate(models)]
        out["step_error_by_kind"] = {  # steps over all rounds; the error is the median of the rounds' errors
            key: {"steps": sum(r[key]["steps"] for r in per_round if key in r),
                  "error": round(float(np.median([r[key]["error"] for r in per_round if key in r])), 4)}
            for key in sorted({key for r in per_round for key in r})}
        out["schedule"] = {"real_steps_by_kind": [dict(Counter(kind(r.shape()) for r in log)) for _, log in runs[test]],
                           "sim_steps_by_kind": [dict(Counter(kind(s) for s in shapes)) for _, shapes in sims]}
    pooled = fit([r for n in others for _, log in runs[n] for r in log], FORM)
    out["pooled_fit_sim_vs_real"] = as_table(signed_error(percentile_ms(simulated(jobs, pooled)[0]), real))
    out["real_run_to_run"] = as_table({m: np.max([np.abs(e[m] - real[m]) / real[m] for e in real_each], axis=0)
                                       for m in METRICS})
    return out


def fidelity(track: Any, requests: int = 12, rounds: int = 3) -> dict[str, Any]:
    """Measure every workload ``rounds`` times (interleaved), then hold each out in turn."""
    model, tok = smollm2()
    jobs = workloads(tok, requests)
    runs: dict[str, list[tuple[dict[str, list[float]], list[Any]]]] = {n: [] for n in jobs}
    load = []
    with one_blas_thread():
        Engine(model, tok, **ENGINE).generate([jobs["A"][0].prompt], SamplingParams(max_tokens=2))  # warm caches
        for name, _ in track([(n, k) for k in range(rounds) for n in jobs], "E5 real engine runs (SmolLM2)"):
            if name == "A":
                load.append(round(os.getloadavg()[0], 2))
            runs[name].append(measure(jobs[name]))
    return {"workloads": {n: {"kind": NAMES[n], "requests": len(j), "arrival_gap_s": GAPS.get(n, 0.0),
                              "prompt_tokens": [len(x.prompt) for x in j], "output_tokens": [x.output_len for x in j]}
                          for n, j in jobs.items()},
            "rounds": rounds, "load_average_per_round": load,
            "model_form": "base + per token + per attention pair + per sample + multi_token + multi_sample + "
                          "row_extra (2 and 3 tokens)",
            "held_out": {n: held_out(n, jobs[n], runs) for n in jobs}}


def errors(f: dict[str, Any], key: str = "sim_vs_real") -> list[float]:
    """Every |error| of the table: held-out workloads x metrics x percentiles."""
    return [abs(e) for v in f["held_out"].values() for m in v[key].values() for e in m.values()]


def table(f: dict[str, Any]) -> str:
    rounds = f["rounds"]
    lines = [f"| held out (fitted on the others) | metric | real p50/p90/p99 (ms, median of {rounds} runs) | "
             f"simulated p50/p90/p99 (ms) | sim error p50/p90/p99 (median of {rounds} rounds) | "
             "previous model form | real run-to-run p50/p90/p99 (largest of one run) |",
             "|---|---|---|---|---|---|---|"]
    for name, v in f["held_out"].items():
        for m in METRICS:
            lines.append(f"| {name} ({f['workloads'][name]['kind']}) | {m.upper()} | "
                         f"{' / '.join(f'{x:.0f}' for x in v['real_ms'][m])} | "
                         f"{' / '.join(f'{x:.0f}' for x in v['sim_ms'][m])} | {pcts(v['sim_vs_real'][m])} | "
                         f"{pcts(v['previous_form_sim_vs_real'][m])} | "
                         f"{spread(v['real_run_to_run'][m])} |")
    return "\n".join(lines)


def pcts(d: dict[str, float]) -> str:
    """'+1.2% / -0.4% / +3.0%' (p50 / p90 / p99)."""
    return " / ".join(f"{d[p]:+.1%}" for p in ("p50", "p90", "p99"))


def spread(d: dict[str, float]) -> str:
    return " / ".join(f"{d[p]:.1%}" for p in ("p50", "p90", "p99"))
