"""Calibration and fidelity of the cluster simulator against the real reference engine (SmolLM2, CPU).

Three ShareGPT workloads run on the real NumPy engine, in rounds; within a round the three engines take
turns step by step, each timed by its own CPU clock, so that the shared machine's load hits them alike:

* A, a burst: every request at once, longer prompts (chunked prefill), short answers;
* B, paced below capacity: a request every 0.8 s, prompts of up to 48 tokens, 20-token answers;
* C, paced over capacity: a request every 0.4 s, the same kind of requests: a queue builds up.

A fourth engine takes its turns with them: a profiling sweep (``sweep_scenes``, Vidur's method) whose
scenes make the engine take every kind of step shape it can (1..64 tokens, 1..4 sequences, 0..4 sampled,
contexts beyond any the workloads reach), spread over the rounds. A ``StepTimeModel`` is fitted to the
sweep's steps alone, so every workload is held out (none of its steps is fitted) and the model does not
extrapolate (``coverage``). Each workload is replayed through the cluster simulator, one replica with the
engine's scheduler settings and KV size, each step taking the model's time scattered as the sweep's steps
of the same kind scatter around it (``Scattered``). Per round: the simulated TTFT, inter-token latency
(ITL) and end-to-end latency at p50/p90/p99 against that round's real run, as signed relative errors;
the reported error is the median over the rounds. The real percentiles shown are the median over the
runs, and the largest difference of one run from them is the engine's own run-to-run spread.

Step-level evidence comes with it: the held-out prediction error per kind of step (one-token decodes of
1..4 sequences, prompt-only steps, mixed steps); the steps the simulator took against the steps the engine
took; a replay in which every step takes the time the engine measured for it (``Measured``: the schedule
and the accounting alone, no cost model: it must give the engine's latencies and its very steps); and the
errors of the model's mean alone (no scatter), of the previous model form (no ``multi_sample`` and
``row_extra``, no scatter), of the previous calibration (fitted round by round on the *other* workloads'
steps: leave one workload out) and of the sweep and the other workloads together, on the same runs.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Generator
from dataclasses import replace
from typing import Any

import numpy as np

from experiments.engine.stats import CpuClock, Job, one_blas_thread, run_jobs_stepwise, sharegpt_jobs, smollm2
from reference.cluster import Simulator, scenario_from_dict
from reference.engine import Engine, SamplingParams
from reference.engine.cost import StepShape, StepTimeModel
from reference.safe_write import write_text

ENGINE = {"num_blocks": 128, "block_size": 16, "max_num_batched_tokens": 64, "max_num_seqs": 4}
PS = (50, 90, 99)
METRICS = ("ttft", "itl", "e2e")
FORM = {"multi_sample": True, "row_extra": 2}  # the model form of the table; {} is the previous one
GAPS = {"B": 0.8, "C": 0.4}  # seconds between arrivals of the paced workloads
DRAWS = 20  # simulated replays per round with scattered step times (5 ms each)
NAMES = {"A": "burst", "B": "paced, below capacity", "C": "paced, over capacity"}
SWEEP = "sweep"  # the profiling sweep's name among a round's engines


LATE_S = 0.25  # when a scene's late prompts arrive (seconds of engine time): its first requests decode by then


def sweep_scenes() -> list[tuple[tuple[int, ...], int, tuple[int, ...]]]:
    """The profiling sweep (Vidur's idea: profile every shape the engine can take, then never extrapolate):
    scenes run one after the other, each a few requests given as (prompt lengths, output length, prompt
    lengths of requests that arrive ``LATE_S`` later). The engine's own scheduler turns them into steps;
    together they cover

    * prompt-only steps of 2..64 tokens over 1..4 sequences that all sample (one scene per (tokens, sequences)
      of the grid tokens {2, 3, 4, 8, 16, 32, 48, 64} x sequences {1, 2, 3, 4}, where the tokens split evenly),
      each followed by one decode of those sequences;
    * 64-token chunks that sample 0..3 sequences, later chunks at contexts up to 144, and mixed steps (a
      decode riding along a later chunk) from longer prompts;
    * mixed steps of 1..3 decodes and a new prompt of 8..48 tokens (the late requests);
    * decodes of 1..4 sequences at contexts up to ~150 (the workloads reach ~110).
    """
    scenes = [((t // k,) * k, 2, ()) for t in (2, 3, 4, 8, 16, 32, 48, 64) for k in (1, 2, 3, 4)
              if t % k == 0 and t >= k and (k != 3 or t in (3, 48))]
    scenes += [((72,), 6, ()), ((96,), 4, ()), ((128,), 8, ()), ((40,) * 4, 8, ()), ((24,) * 3, 10, ()),
               ((8, 90), 10, ()), ((10, 90, 30, 60), 6, ()), ((100, 100), 6, ()), ((60, 70, 80), 4, ())]
    scenes += [((16,), 8, (8,)), ((20, 20), 8, (24,)), ((10, 10, 10), 8, (48,)), ((30,), 8, (40,)),
               ((12, 12, 12), 8, (8,)), ((40, 40), 8, (16,))]
    return scenes


def sweep_jobs(seed: int = 0, vocab: int = 40000) -> list[list[Job]]:
    """The sweep's scenes as jobs; prompts of random token ids below ``vocab``: with a large vocabulary no two
    prompts share a block (no prefix-cache hits)."""
    rng = np.random.default_rng(seed)

    def job(length: int, out: int, arrival: float) -> Job:
        return Job([int(x) for x in rng.integers(1, vocab, length)], out, arrival)

    return [[job(p, out, 0.0) for p in prompts] + [job(p, out, LATE_S) for p in late]
            for prompts, out, late in sweep_scenes()]


def run_sweep_stepwise(engine: Engine, scenes: list[list[Job]]) -> Generator[None, None, list]:
    """Every scene in turn on one engine, one step at a time (like ``run_jobs_stepwise``): a scene starts
    once the one before has finished."""
    outs: list = []
    for jobs in scenes:
        outs += yield from run_jobs_stepwise(engine, jobs)
    return outs


def workloads(tok: Any, n: int) -> dict[str, list[Job]]:
    """A: ``n`` longer prompts at once; B and C: ``n`` other conversations each, paced (``GAPS``)."""
    def paced(skip: int, gap: float) -> list[Job]:
        jobs = sharegpt_jobs(tok, n, 48, 20, skip=skip, output_scale=1 / 4)
        return [Job(j.prompt, j.output_len, gap * i) for i, j in enumerate(jobs)]

    return {"A": sharegpt_jobs(tok, n, 96, 12, output_scale=1 / 8), "B": paced(n, GAPS["B"]),
            "C": paced(2 * n, GAPS["C"])}


def measure_round(jobs: dict[str, list[Job]], model: Any, tok: Any,
                  sweep: list[list[Job]] | None = None) -> dict[str, tuple[dict, list[Any]]]:
    """Run every workload once on its own real engine, the engines taking turns step by step (each timed by
    its own ``CpuClock``, paused while the others step; the turn goes to the engine whose clock is furthest
    behind): whatever the shared machine's load does during the round, it does to all workloads alike.

    Per workload: its latencies, and every step it logged, with as its duration the whole turn of the engine
    loop that ran it: the intake of requests that arrived, the step, and the work after it (recording and
    detokenizing the new tokens), which the step record's own duration leaves out (~0.15 ms a step; small,
    but without it the simulator's clock runs ahead of the engine's, and a request arriving just as a step
    ends can join another step than in the engine).

    With ``sweep`` (scenes, ``sweep_jobs``), one more engine runs the profiling sweep, taking its turns with
    the others; it comes back under the name ``SWEEP``."""
    names = [*jobs, SWEEP] if sweep is not None else list(jobs)
    engines = {n: Engine(model, tok, clock=CpuClock(), **ENGINE) for n in names}
    runs = {n: run_sweep_stepwise(e, sweep) if n == SWEEP else run_jobs_stepwise(e, jobs[n])
            for n, e in engines.items()}
    outs: dict[str, list[Any]] = {}
    for e in engines.values():
        e.clock.pause()
    turns: dict[str, list[float]] = {n: [] for n in names}
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


def held_out(test: str, jobs: list[Job], runs: dict[str, list[tuple[dict, list]]],
             sweep: list[list[Any]]) -> dict[str, Any]:
    """Replay ``test`` with models fitted on the profiling sweep's steps (``sweep``: each round's; none of any
    workload's), and, as contrasts, on the other workloads' steps round by round (see the module docstring)."""
    others = [n for n in runs if n != test]
    rounds = len(runs[test])
    real_each = [percentile_ms(lat) for lat, _ in runs[test]]
    real = {m: np.median([e[m] for e in real_each], axis=0) for m in METRICS}
    out: dict[str, Any] = {"fit_on": "profiling sweep", "leave_one_out_fit_on": others}
    loo = [[r for n in others for r in runs[n][k][1]] for k in range(rounds)]
    at_load = at_round_load(sweep)
    sources = {"sweep": at_load, "leave_one_out": loo,
               "sweep_and_others": [a + b for a, b in zip(at_load, loo, strict=True)]}
    variants = (("", "sweep", FORM, True), ("mean_only_", "sweep", FORM, False), ("previous_form_", "sweep", {}, False),
                ("leave_one_out_", "leave_one_out", FORM, True), ("sweep_and_others_", "sweep_and_others", FORM, True))
    for label, source, form, scatter in variants:
        calibration = sources[source]
        models = [fit(steps, form) for steps in calibration]
        sims = [replay(jobs, m, steps if scatter else None) for m, steps in zip(models, calibration, strict=True)]
        errs = [signed_error(p, real_each[k]) for k, (p, _) in enumerate(sims)]
        out[label + "sim_vs_real"] = as_table({m: np.median([e[m] for e in errs], axis=0) for m in METRICS})
        if label == "leave_one_out_":
            per_round = [step_errors(m, runs[test][k][1]) for k, m in enumerate(models)]
            out["leave_one_out_step_error_all"] = round(float(np.median([r["all steps"]["error"]
                                                                          for r in per_round])), 4)
        if label:
            continue
        out["sim_vs_real_rounds"] = [as_table(e) for e in errs]
        out["model"] = models[0].__dict__
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
    out["coverage"] = coverage([r for _, log in runs[test] for r in log], [r for steps in sweep for r in steps])
    replays = []  # each round's run replayed with its own measured step times
    for k in range(rounds):
        measured = Measured(runs[test][k][1])
        lat, shapes = simulated(jobs, measured)
        replays.append((signed_error(percentile_ms(lat), real_each[k]),
                        measured.same and len(shapes) == len(runs[test][k][1])))
    out["measured_steps_sim_vs_real"] = as_table({m: np.median([e[m] for e, _ in replays], axis=0) for m in METRICS})
    out["measured_steps_same_schedule"] = [same for _, same in replays]
    out["real_run_to_run"] = as_table({m: np.max([np.abs(e[m] - real[m]) / real[m] for e in real_each], axis=0)
                                       for m in METRICS})
    return out


def at_round_load(sweep: list[list[Any]]) -> list[list[Any]]:
    """The whole sweep (all rounds' steps) as if run at each round's load, one list per round.

    A round's load level is the time its own sweep steps took over a fit to all of them: on a shared machine
    a step's CPU time moves with the neighbours' load (caches, memory bandwidth) from one round to the next
    (levels of 0.95-1.05 measured), and a round runs only part of the sweep. Every step's time is divided
    by its round's level and multiplied by round k's: a fit to those is the sweep's model at round k's load
    (the workloads of a round run at its load, as they take turns with the sweep), from the sweep's steps
    alone."""
    levels = load_levels(sweep)
    flat = [replace(r, duration=r.duration / lv) for steps, lv in zip(sweep, levels, strict=True) for r in steps]
    return [[replace(r, duration=r.duration * lv) for r in flat] for lv in levels]


def load_levels(sweep: list[list[Any]]) -> list[float]:
    """Per round: its sweep steps' measured time over the prediction of a fit to all rounds' sweep steps."""
    base = fit([r for steps in sweep for r in steps], FORM)
    return [round(sum(r.duration for r in steps) / sum(base(r.shape()) for r in steps), 4) for steps in sweep]


def ranges(steps: list[Any]) -> dict[str, int]:
    """The largest new tokens, sequences, sampled sequences, attention pairs and context of any step."""
    shapes = [r.shape() for r in steps]
    return {"tokens": max(s.num_tokens for s in shapes), "sequences": max(len(s.new_tokens) for s in shapes),
            "sampled": max(s.num_sampled for s in shapes), "pairs": max(s.attention_pairs() for s in shapes),
            "context": max(max(s.context_lens) for s in shapes)}


def coverage(steps: list[Any], sweep: list[Any]) -> dict[str, Any]:
    """Whether the sweep spans the held-out steps: their ranges and the sweep's, and the share of held-out
    steps inside the sweep's ranges on every count (the model does not extrapolate for those)."""
    top = ranges(sweep)
    inside = sum(all(v <= top[k] for k, v in ranges([r]).items()) for r in steps)
    return {"held_out": ranges(steps), "sweep": top, "steps_inside": round(inside / len(steps), 4)}


def fidelity(track: Any, requests: int = 10, rounds: int = 3, sweeps: int = 1) -> dict[str, Any]:
    """Measure every workload ``rounds`` times (interleaved) and the profiling sweep ``sweeps`` times, spread
    over the rounds (round k runs the scenes k, k + rounds, ... of the sweeps' scenes, taking turns with the
    workloads), then hold each workload out in turn."""
    model, tok = smollm2()
    jobs = workloads(tok, requests)
    scenes = [scene for seed in range(sweeps) for scene in sweep_jobs(seed)]
    runs: dict[str, list[tuple[dict[str, list[float]], list[Any]]]] = {n: [] for n in jobs}
    sweep: list[list[Any]] = []  # per round, the sweep's steps
    load = []
    with one_blas_thread():
        Engine(model, tok, **ENGINE).generate([jobs["A"][0].prompt], SamplingParams(max_tokens=2))  # warm caches
        for k in track(range(rounds), "E5 real engine rounds (SmolLM2, 3 workloads + profiling sweep taking turns)"):
            load.append(round(os.getloadavg()[0], 2))
            for name, run in measure_round(jobs, model, tok, sweep=scenes[k::rounds]).items():
                if name == SWEEP:
                    sweep.append(run[1])
                else:
                    runs[name].append(run)
    return {"workloads": {n: {"kind": NAMES[n], "requests": len(j), "arrival_gap_s": GAPS.get(n, 0.0),
                              "prompt_tokens": [len(x.prompt) for x in j], "output_tokens": [x.output_len for x in j]}
                          for n, j in jobs.items()},
            "rounds": rounds, "load_average_per_round": load,
            "sweep": {"scenes": [{"prompts": list(p), "output": o, "late_prompts": list(late)}
                                 for p, o, late in sweep_scenes()], "late_s": LATE_S,
                      "times": sweeps, "steps_per_round": [len(steps) for steps in sweep],
                      "cpu_seconds": round(sum(r.duration for steps in sweep for r in steps), 2),
                      "load_level_per_round": load_levels(sweep),
                      "workload_cpu_seconds": round(sum(r.duration for v in runs.values() for _, log in v
                                                        for r in log), 2)},
            "model_form": "base + per token + per attention pair + per sample + multi_token + multi_sample + "
                          "row_extra (2 and 3 tokens)",
            "held_out": {n: held_out(n, jobs[n], runs, sweep) for n in jobs}}


def errors(f: dict[str, Any], key: str = "sim_vs_real") -> list[float]:
    """Every |error| of the table: held-out workloads x metrics x percentiles."""
    return [abs(e) for v in f["held_out"].values() for m in v[key].values() for e in m.values()]


def table(f: dict[str, Any]) -> str:
    rounds = f["rounds"]
    lines = [f"| held out workload | metric | real p50/p90/p99 (ms, median of {rounds} runs) | "
             f"simulated p50/p90/p99 (ms) | sim error p50/p90/p99, fitted on the profiling sweep (median of {rounds} "
             "rounds) | same, model mean only | same, previous model form | fitted on the other workloads instead "
             "(leave one out) | sweep + other workloads | real run-to-run p50/p90/p99 (largest of one run) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in f["held_out"].items():
        for m in METRICS:
            lines.append(f"| {name} ({f['workloads'][name]['kind']}) | {m.upper()} | "
                         f"{' / '.join(f'{x:.0f}' for x in v['real_ms'][m])} | "
                         f"{' / '.join(f'{x:.0f}' for x in v['sim_ms'][m])} | {pcts(v['sim_vs_real'][m])} | "
                         f"{pcts(v['mean_only_sim_vs_real'][m])} | {pcts(v['previous_form_sim_vs_real'][m])} | "
                         f"{pcts(v['leave_one_out_sim_vs_real'][m])} | {pcts(v['sweep_and_others_sim_vs_real'][m])} | "
                         f"{spread(v['real_run_to_run'][m])} |")
    return "\n".join(lines)


def pcts(d: dict[str, float]) -> str:
    """'+1.2% / -0.4% / +3.0%' (p50 / p90 / p99)."""
    return " / ".join(f"{d[p]:+.1%}" for p in ("p50", "p90", "p99"))


def spread(d: dict[str, float]) -> str:
    return " / ".join(f"{d[p]:.1%}" for p in ("p50", "p90", "p99"))


def main() -> None:
    """``python -m experiments.edge.cluster_fidelity [--requests N] [--rounds R] [--json OUT]``: the fidelity part
    of E5 alone (E5's quick run uses 10 requests and 3 rounds, ``--full`` 32 and 5), with a progress bar."""
    import argparse
    import json
    from pathlib import Path

    from rich.progress import Progress

    from experiments.registry import Context
    from reference.provenance import commit, machine, now

    parser = argparse.ArgumentParser(prog="python -m experiments.edge.cluster_fidelity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10, help="requests per workload")
    parser.add_argument("--rounds", type=int, default=3, help="real-engine runs of each workload")
    parser.add_argument("--sweeps", type=int, default=1, help="times the profiling sweep runs, over the rounds")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    started = {"commit": commit(), "date": now()}
    f = fidelity(Context(progress_factory=Progress).track, requests=args.requests, rounds=args.rounds,
                 sweeps=args.sweeps)
    f = {**started, "machine": machine(), **f}
    print(table(f))
    if args.json:
        write_text(args.json, json.dumps(f, indent=1) + "\n")


if __name__ == "__main__":
    main()
