"""The simulator replays the engine's own schedule: what the fidelity experiment (E5) rests on.

A real engine (a tiny random model) runs a workload on a clock that advances, inside each forward pass,
by a step-time model's price for that step; the simulator replays the same workload with the same model.
Nothing then separates them but the simulator's scheduling and accounting, so every latency must agree.
Also: the step-time model's CPU terms are recovered by its fit, and the engines of a fidelity round
take turns with each clock counting only its own turns.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.edge.cluster_fidelity import (
    ENGINE,
    SWEEP,
    Measured,
    coverage,
    kind,
    measure_round,
    simulated,
    sweep_jobs,
)
from experiments.engine.stats import CpuClock, Job, run_jobs
from reference.disagg.models import tiny_llama
from reference.engine import Engine
from reference.engine.cost import StepShape, StepTimeModel

COST = StepTimeModel(0.04, 0.0025, 1e-6, 0.003, multi_token=0.05, multi_sample=0.015, row_extra=(-0.007, 0.012))
MODEL = tiny_llama(3, vocab_size=96)


class PricedClock(CpuClock):
    """Engine time that advances only when a forward pass is priced (``charge``), plus skipped idle time."""

    def __init__(self) -> None:
        super().__init__()
        self.t = 0.0

    def __call__(self) -> float:
        return self.t + self.offset


def priced_engine(cost: StepTimeModel) -> Engine:
    """An engine whose forward pass takes exactly ``cost`` of its step's shape on its clock."""
    clock = PricedClock()
    engine = Engine(MODEL, clock=clock, **ENGINE)
    forward = engine.runner.forward

    def timed(chunks: list) -> list:
        shape = StepShape(tuple(len(c.tokens) for c in chunks), tuple(c.start + len(c.tokens) for c in chunks),
                          sum(1 for c in chunks if c.wants_logits))
        clock.t += cost(shape)
        return forward(chunks)

    engine.runner.forward = timed
    return engine


workload = st.lists(st.tuples(st.integers(1, 90), st.integers(1, 12), st.sampled_from([0.0, 0.0, 0.1, 0.37, 0.8])),
                    min_size=1, max_size=7)


@settings(max_examples=12, deadline=None)
@given(workload, st.integers(0, 10**6))
def test_simulator_replays_the_engine_schedule_exactly(spec: list[tuple[int, int, float]], seed: int) -> None:
    """Bursts (equal arrival times) included: the simulator takes in every request due at that time first."""
    rng = np.random.default_rng(seed)
    jobs, t = [], 0.0
    for prompt_len, output_len, gap in spec:
        t += gap
        jobs.append(Job([int(x) for x in rng.integers(1, 96, prompt_len)], output_len, round(t, 6)))
    engine = priced_engine(COST)
    outs = run_jobs(engine, jobs)
    lat, shapes = simulated(jobs, COST)
    assert [s.new_tokens for s in shapes] == [r.new_tokens for r in engine.step_log]
    assert np.allclose(sorted(lat["ttft"]), sorted(o.metrics.ttft for o in outs), rtol=0, atol=1e-9)
    assert np.allclose(sorted(lat["e2e"]), sorted(o.metrics.e2e_latency for o in outs), rtol=0, atol=1e-9)
    assert np.allclose(sorted(lat["itl"]), sorted(g for o in outs for g in o.metrics.inter_token_latencies),
                       rtol=0, atol=1e-9)


def test_a_burst_joins_one_step() -> None:
    jobs = [Job([5] * 20, 3), Job([6] * 10, 3), Job([7] * 5, 3)]
    _, shapes = simulated(jobs, COST)
    assert shapes[0].new_tokens == (20, 10, 5)


def test_fit_recovers_the_cpu_terms_and_keeps_them_opt_in() -> None:
    rng = np.random.default_rng(2)
    shapes = [StepShape((1,) * k, tuple(int(c) for c in rng.integers(10, 100, k)), k) for k in rng.integers(1, 5, 60)]
    shapes += [StepShape((int(n),), (int(n),), 1) for n in rng.integers(2, 64, 30)]  # one prompt, one sample
    shapes += [StepShape((1, 1, int(n)), (40, 50, int(n) + 10), 2 + int(rng.integers(0, 2)))
               for n in rng.integers(5, 60, 30)]
    fitted = StepTimeModel.fit(shapes, [COST(s) for s in shapes], multi_sample=True, row_extra=2)
    assert np.allclose([fitted.base, fitted.per_token, fitted.multi_token, fitted.multi_sample, *fitted.row_extra],
                       [COST.base, COST.per_token, COST.multi_token, COST.multi_sample, *COST.row_extra], rtol=1e-6)
    plain = StepTimeModel.fit(shapes, [COST(s) for s in shapes])
    assert plain.multi_sample == 0 and plain.row_extra == ()  # other users of fit() see the model they had
    one_sample = [s for s in shapes if s.num_sampled <= 1]  # multi_sample cannot be told from the rest: not fitted
    assert StepTimeModel.fit(one_sample, [COST(s) for s in one_sample], multi_sample=True).multi_sample == 0


def test_engines_take_turns_and_measured_steps_replay_exactly() -> None:
    """A real fidelity round on the tiny model: each engine's steps are timed by its own clock (paused during
    the others' turns), and replaying a run with its measured step times gives its very steps and latencies."""
    # bursts, and a request long after the others (the engine idles until it): no arrival can fall within the
    # few microseconds by which a turn's clock readings and the engine's own may differ
    jobs = {"x": [Job([3] * 30, 6), Job([4] * 12, 5), Job([5] * 9, 3, 30.0)], "y": [Job([9] * 8, 8), Job([8] * 40, 4)]}
    runs = measure_round(jobs, MODEL, None)
    for name, (lat, steps) in runs.items():
        assert len(lat["ttft"]) == len(jobs[name]) and all(r.duration > 0 for r in steps)
        measured = Measured(steps)
        sim, _ = simulated(jobs[name], measured)
        assert measured.same and measured.next == len(steps)
        assert np.allclose(sorted(sim["e2e"]), sorted(lat["e2e"]), rtol=0.05, atol=2e-3)


def test_the_profiling_sweep_covers_every_step_shape_of_the_grid() -> None:
    """The sweep's scenes, scheduled as the engine schedules them, take prompt-only steps of every (tokens,
    sequences) of the grid, decodes of 1..4 sequences, mixed steps, and 64-token chunks sampling 0..4 rows."""
    shapes = [s for jobs in sweep_jobs() for s in simulated(jobs, COST)[1]]
    prompt_only = {(s.num_tokens, len(s.new_tokens)) for s in shapes if kind(s) == "prompt only"}
    for t in (2, 3, 4, 8, 16, 32, 48, 64):
        for k in (1, 2, 4):
            assert t <= k or t % k or (t, k) in prompt_only, (t, k)  # t == k: one-token prompts, decode-shaped
    assert (48, 3) in prompt_only
    kinds = {kind(s) for s in shapes}
    assert {"decode x1", "decode x2", "decode x3", "decode x4", "mixed"} <= kinds
    decodes_with_a_prompt = {s.new_tokens.count(1) for s in shapes if kind(s) == "mixed"}
    assert {1, 2, 3} <= decodes_with_a_prompt  # the late requests join running decodes
    assert {s.num_sampled for s in shapes if s.num_tokens == 64} == {0, 1, 2, 3, 4}
    assert max(max(s.context_lens) for s in shapes) > 128  # beyond the workloads' longest context (~110)
    prompts = [tuple(j.prompt) for jobs in sweep_jobs() for j in jobs]
    assert len(set(prompts)) == len(prompts)  # no prefix-cache hits between scenes


def test_the_sweep_takes_turns_with_the_workloads_and_its_coverage_is_reported() -> None:
    scenes = sweep_jobs(vocab=96)[:2]
    jobs = {"x": [Job([3] * 30, 4), Job([4] * 12, 3)]}
    runs = measure_round(jobs, MODEL, None, sweep=scenes)
    assert set(runs) == {"x", SWEEP}
    steps = runs[SWEEP][1]
    assert [r.new_tokens for r in steps] == [s.new_tokens for sc in scenes for s in simulated(sc, COST)[1]]
    assert all(r.duration > 0 for r in steps)
    cov = coverage(runs["x"][1], steps)
    assert cov["held_out"]["tokens"] == 42 and cov["sweep"]["tokens"] == 2
    assert cov["steps_inside"] < 1  # the 42-token step lies outside a sweep of 2-token prompts
