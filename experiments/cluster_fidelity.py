"""Calibration and fidelity of the cluster simulator against the real reference engine (SmolLM2, CPU).

Three ShareGPT workloads run on the real NumPy engine, in rounds; within a round the three engines take
turns step by step, each timed by its own CPU clock, so that the shared machine's load hits them alike:

* A, a burst: every request at once, longer prompts (chunked prefill), short answers;
* B, paced below capacity: a request every 0.8 s, prompts of up to 48 tokens, 20-token answers;
* C, paced over capacity: a request every 0.4 s, the same kind of requests: a queue builds up.

Each workload is held out in turn. In every round a ``StepTimeModel`` is fitted to the measured steps of
the *other* workloads of that round (calibrated under the same machine load as the test run), and the
held-out workload is replayed through the cluster simulator, one replica with the engine's scheduler
settings and KV size, each step taking the model's time scattered as the calibration steps scatter around
it (``Scattered``). Per round: the simulated TTFT, inter-token latency (ITL) and end-to-end latency at
p50/p90/p99 against that round's real run, as signed relative errors; the reported error is the median
over the rounds. The real percentiles shown are the median over the runs, and the largest difference of
one run from them is the engine's own run-to-run spread.

Step-level evidence comes with it: the held-out prediction error per kind of step (one-token decodes of
1..4 sequences, prompt-only steps, mixed steps); the steps the simulator took against the steps the engine
took; a replay in which every step takes the time the engine measured for it (``Measured``: the schedule
and the accounting alone, no cost model: it must give the engine's latencies and its very steps); and the
errors of the model's mean alone (no scatter) and of the previous model form (no ``multi_sample`` and
``row_extra``, no scatter) on the same runs.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np

from experiments.engine_bench import CpuClock, Job, one_blas_thread, run_jobs_stepwise, sharegpt_jobs, smollm2
from reference.cluster import Simulator, scenario_from_dict
from reference.engine import Engine, SamplingParams
from reference.engine.cost import StepShape, StepTimeModel

ENGINE = {"num_blocks": 128, "block_size": 16, "max_num_batched_tokens": 64, "max_num_seqs": 4}
PS = (50, 90, 99)
METRICS = ("ttft", "itl", "e2e")
FORM = {"multi_sample": True, "row_extra": 2}  # the model form of the table; {} is the previous one
GAPS = {"B": 0.8, "C": 0.4}  # seconds between arrivals of the paced workloads
DRAWS = 20  # simulated replays per round with scattered step times (5 ms each)
NAMES = {"A": "burst", "B": "paced, below capacity", "C": "paced, over capacity"}


def workloads(tok: Any, n: int) -> dict[str, list[Job]]:
    """A: ``n`` longer prompts at once; B and C: ``n`` other conversations each, paced (``GAPS``)."""
    def paced(skip: int, gap: float) -> list[Job]:
        jobs = sharegpt_jobs(tok, n, 48, 20, skip=skip, output_scale=1 / 4)
        return [Job(j.prompt, j.output_len, gap * i) for i, j in enumerate(jobs)]

    return {"A": sharegpt_jobs(tok, n, 96, 12, output_scale=1 / 8), "B": paced(n, GAPS["B"]),
            "C": paced(2 * n, GAPS["C"])}


def measure_round(jobs: dict[str, list[Job]], model: Any, tok: Any) -> dict[str, tuple[dict, list[Any]]]:
    """Run every workload once on its own real engine, the engines taking turns step by step (each timed by
    its own ``CpuClock``, paused while the others step; the turn goes to the engine whose clock is furthest
    behind): whatever the shared machine's load does during the round, it does to all workloads alike.

    Per workload: its latencies, and every step it logged, with as its duration the whole turn of the engine
    loop that ran it: the intake of requests that arrived, the step, and the work after it (recording and
    detokenizing the new tokens), which the step record's own duration leaves out (~0.15 ms a step; small,
    but without it the simulator's clock runs ahead of the engine's, and a request arriving just as a step
    ends can join another step than in the engine)."""
    engines = {n: Engine(model, tok, clock=CpuClock(), **ENGINE) for n in jobs}
    runs = {n: run_jobs_stepwise(e, jobs[n]) for n, e in engines.items()}
    outs: dict[str, list[Any]] = {}
    for e in engines.values():
        e.clock.pause()
    turns: dict[str, list[float]] = {n: [] for n in jobs}
    at = {n: e.clock() for n, e in engines.items()}  # each engine's clock when it last paused
    while runs:
        n = min(runs, key=lambda name: at[name])  # the one furthest behind: the workloads advance side by side
        engine = engines[n]
        engine.clock.resume()
        started, logged = engine.clock(), len(engine.step_log)
        try:
            next(runs[n])
        except StopIteration as done:
            outs[n] = done.value
            del runs[n]
        if len(engine.step_log) > logged:
            turns[n].append(engine.clock() - started)
        at[n] = engine.clock()
        engine.clock.pause()
    return {n: ({"ttft": [o.metrics.ttft for o in out], "e2e": [o.metrics.e2e_latency for o in out],
                 "itl": [g for o in out for g in o.metrics.inter_token_latencies]},
                [replace(r, duration=t) for r, t in zip(engines[n].step_log, turns[n], strict=True)])
            for n, out in outs.items()}


class Recorder:
    """A step cost model that also keeps the shape of every step it priced once ``on`` is set."""

    def __init__(self, cost: StepTimeModel) -> None:
        self.cost, self.on, self.shapes = cost, False, []

    def __call__(self, s: StepShape) -> float:
        if self.on:
            self.shapes.append(s)
        return self.cost(s)


class Measured:
    """A "cost model" that gives each step the time the engine measured for its step of the same index, and
    notes whether the shapes agree: replaying with it checks the simulator's schedule and accounting alone."""

    def __init__(self, steps: list[Any]) -> None:
        self.steps, self.next, self.same = steps, 0, True

    def __call__(self, s: StepShape) -> float:
        if self.next >= len(self.steps):
            self.same = False
            return self.steps[-1].duration
        r = self.steps[self.next]
        self.same = self.same and r.new_tokens == s.new_tokens and r.context_lens == s.context_lens
        self.next += 1
        return r.duration


def simulated(jobs: list[Job], cost: Any) -> tuple[dict[str, list[float]], list[StepShape]]:
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
    if isinstance(cost, Measured):  # start over after the two reference steps
        cost.next, cost.same = 0, True
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


class Scattered:
    """The fitted model's time for a step, times a ratio (measured / predicted) drawn at random from the
    calibration steps of the same kind (``kind``; from all of them for a kind they lack). The engine's steps
    scatter around the model's prediction (caches, and the neighbours on a shared machine; a short step
    relatively more than a long one), and a percentile of single gaps (ITL p90) lands in that scatter; a
    model of the mean alone puts every such step at the mean."""

    def __init__(self, cost: StepTimeModel, steps: list[Any], seed: int) -> None:
        self.cost, self.rng = cost, np.random.default_rng(seed)
        self.ratios: dict[str, list[float]] = {}
        for r in steps:
            for key in (kind(r.shape()), "all"):
                self.ratios.setdefault(key, []).append(r.duration / cost(r.shape()))

    def __call__(self, s: StepShape) -> float:
        ratios = self.ratios.get(kind(s), self.ratios["all"])
        return self.cost(s) * ratios[int(self.rng.integers(len(ratios)))]


def replay(jobs: list[Job], cost: StepTimeModel, steps: list[Any] | None) -> tuple[dict[str, np.ndarray], list]:
    """Percentiles of the simulated replay: with ``steps`` (the calibration steps), the median over ``DRAWS``
    replays with scattered step times (``Scattered``; each replay has as many requests as the real run, so
    its percentiles are estimated alike), else one replay with the model's times."""
    if steps is None:
        lat, shapes = simulated(jobs, cost)
        return percentile_ms(lat), shapes
    draws = []
    for seed in range(DRAWS):
        lat, shapes = simulated(jobs, Scattered(cost, steps, seed))
        draws.append(percentile_ms(lat))
    return {m: np.median([d[m] for d in draws], axis=0) for m in METRICS}, shapes


def held_out(test: str, jobs: list[Job], runs: dict[str, list[tuple[dict, list]]]) -> dict[str, Any]:
    """Fit on the other workloads round by round, replay ``test``, compare (see the module docstring)."""
    others = [n for n in runs if n != test]
    rounds = len(runs[test])
    real_each = [percentile_ms(lat) for lat, _ in runs[test]]
    real = {m: np.median([e[m] for e in real_each], axis=0) for m in METRICS}
    out: dict[str, Any] = {"fit_on": others}
    for label, form, scatter in (("", FORM, True), ("mean_only_", FORM, False), ("previous_form_", {}, False)):
        calibration = [[r for n in others for r in runs[n][k][1]] for k in range(rounds)]
        models = [fit(steps, form) for steps in calibration]
        sims = [replay(jobs, m, steps if scatter else None) for m, steps in zip(models, calibration, strict=True)]
        errs = [signed_error(p, real_each[k]) for k, (p, _) in enumerate(sims)]
        out[label + "sim_vs_real"] = as_table({m: np.median([e[m] for e in errs], axis=0) for m in METRICS})
        if label:
            continue
        out["sim_vs_real_rounds"] = [as_table(e) for e in errs]
        out["models"] = [m.__dict__ for m in models]
        sim = {m: np.median([p[m] for p, _ in sims], axis=0) for m in METRICS}
        out["real_ms"] = {m: [round(float(v), 2) for v in real[m]] for m in METRICS}
        out["sim_ms"] = {m: [round(float(v), 2) for v in sim[m]] for m in METRICS}
        per_round = [step_errors(m, runs[test][k][1]) for k, m in enumerate(models)]
        out["step_error_by_kind"] = {  # steps over all rounds; the error is the median of the rounds' errors
            key: {"steps": sum(r[key]["steps"] for r in per_round if key in r),
                  "error": round(float(np.median([r[key]["error"] for r in per_round if key in r])), 4)}
            for key in sorted({key for r in per_round for key in r})}
        out["schedule"] = {"real_steps_by_kind": [dict(Counter(kind(r.shape()) for r in log)) for _, log in runs[test]],
                           "sim_steps_by_kind": [dict(Counter(kind(s) for s in shapes)) for _, shapes in sims]}
    replays = []  # each round's run replayed with its own measured step times
    for k in range(rounds):
        measured = Measured(runs[test][k][1])
        lat, shapes = simulated(jobs, measured)
        replays.append((signed_error(percentile_ms(lat), real_each[k]),
                        measured.same and len(shapes) == len(runs[test][k][1])))
    out["measured_steps_sim_vs_real"] = as_table({m: np.median([e[m] for e, _ in replays], axis=0) for m in METRICS})
    out["measured_steps_same_schedule"] = [same for _, same in replays]
    pooled = fit([r for n in others for _, log in runs[n] for r in log], FORM)
    out["pooled_fit_sim_vs_real"] = as_table(signed_error(percentile_ms(simulated(jobs, pooled)[0]), real))
    out["real_run_to_run"] = as_table({m: np.max([np.abs(e[m] - real[m]) / real[m] for e in real_each], axis=0)
                                       for m in METRICS})
    return out


def fidelity(track: Any, requests: int = 10, rounds: int = 3) -> dict[str, Any]:
    """Measure every workload ``rounds`` times (interleaved), then hold each out in turn."""
    model, tok = smollm2()
    jobs = workloads(tok, requests)
    runs: dict[str, list[tuple[dict[str, list[float]], list[Any]]]] = {n: [] for n in jobs}
    load = []
    with one_blas_thread():
        Engine(model, tok, **ENGINE).generate([jobs["A"][0].prompt], SamplingParams(max_tokens=2))  # warm caches
        for _ in track(range(rounds), "E5 real engine rounds (SmolLM2, 3 workloads taking turns)"):
            load.append(round(os.getloadavg()[0], 2))
            for name, run in measure_round(jobs, model, tok).items():
                runs[name].append(run)
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
             f"simulated p50/p90/p99 (ms) | sim error p50/p90/p99 (median of {rounds} rounds) | same, model mean "
             "only | previous model form | real run-to-run p50/p90/p99 (largest of one run) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, v in f["held_out"].items():
        for m in METRICS:
            lines.append(f"| {name} ({f['workloads'][name]['kind']}) | {m.upper()} | "
                         f"{' / '.join(f'{x:.0f}' for x in v['real_ms'][m])} | "
                         f"{' / '.join(f'{x:.0f}' for x in v['sim_ms'][m])} | {pcts(v['sim_vs_real'][m])} | "
                         f"{pcts(v['mean_only_sim_vs_real'][m])} | {pcts(v['previous_form_sim_vs_real'][m])} | "
                         f"{spread(v['real_run_to_run'][m])} |")
    return "\n".join(lines)


def pcts(d: dict[str, float]) -> str:
    """'+1.2% / -0.4% / +3.0%' (p50 / p90 / p99)."""
    return " / ".join(f"{d[p]:+.1%}" for p in ("p50", "p90", "p99"))


def spread(d: dict[str, float]) -> str:
    return " / ".join(f"{d[p]:.1%}" for p in ("p50", "p90", "p99"))


def main() -> None:
    """``python -m experiments.cluster_fidelity [--requests N] [--rounds R] [--json OUT]``: the fidelity part
    of E5 alone (E5's quick run uses 10 requests and 3 rounds, ``--full`` 32 and 5), with a progress bar."""
    import argparse
    import json
    from pathlib import Path

    from rich.progress import Progress

    from experiments.registry import Context
    from reference.provenance import commit, machine, now

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10, help="requests per workload")
    parser.add_argument("--rounds", type=int, default=3, help="real-engine runs of each workload")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    started = {"commit": commit(), "date": now()}
    f = fidelity(Context(progress_factory=Progress).track, requests=args.requests, rounds=args.rounds)
    f = {**started, "machine": machine(), **f}
    print(table(f))
    if args.json:
        args.json.write_text(json.dumps(f, indent=1) + "\n")


if __name__ == "__main__":
    main()
