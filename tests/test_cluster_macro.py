"""Macro steps (reference/cluster/macro.py) change how many events the simulator queues, never the run.

Every test runs the same scenario twice, one step per event (``macro_steps=False``) and with macro
steps, and compares everything a user can see: each request's outcome, first/last token and finish
times, every inter-token gap, the sites it visited, its retries and reason; each replica's busy time,
FLOPs and load counters; the event-log hash and the event count.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.cluster import Simulator, scenario_from_dict
from reference.cluster.macro import MacroStep, plan_macro
from reference.cluster.randomized import random_scenario_dict
from reference.sched import Scheduler, Sequence


def run(d: dict[str, Any], seed: int, macro: bool, **kwargs: Any) -> tuple[Any, dict, list, Simulator]:
    sim = Simulator(scenario_from_dict(d), seed, macro_steps=macro, record_gaps=True, **kwargs)
    requests: dict[int, tuple] = {}
    done = sim._done

    def record(r: Any, outcome: str) -> None:
        requests[r.rid] = (outcome, r.first_token, r.last_token, r.finish, tuple(r.gaps), tuple(r.visited),
                           r.retries, r.reason)
        done(r, outcome)

    sim._done = record
    result = sim.run()
    replicas = [(r.busy_s, r.flops_done, r.prefill_busy_s, r.pending_decode, r.pending_prefill, r.kv_recomputed,
                 r.scheduler.num_unfinished) for r in sim.replicas]
    return result, requests, replicas, sim


def assert_same(d: dict[str, Any], seed: int, **kwargs: Any) -> tuple[Any, Any]:
    a, req_a, rep_a, _ = run(d, seed, False, **kwargs)
    b, req_b, rep_b, _ = run(d, seed, True, **kwargs)
    assert req_a == req_b
    assert rep_a == rep_b
    assert (a.event_hash, a.events, sorted(a.ttft), sorted(a.e2e)) == (b.event_hash, b.events, sorted(b.ttft),
                                                                        sorted(b.e2e))
    return a, b


def longer(seed: int) -> tuple[dict[str, Any], int | None]:
    """A random scenario (failures, disaggregation, residency) with answers long enough for macro steps,
    and every other time a KV cache small enough that preemption and prefix-cache eviction happen."""
    rng = np.random.default_rng(seed)
    d = random_scenario_dict(rng)
    for t in d["traffic"]:
        t.update(output_tokens=int(rng.integers(1, 90)), rate_per_s=float(rng.uniform(10, 60)))
    return d, (int(rng.integers(14, 24)) if seed % 2 else None)


@settings(max_examples=25)
@given(st.integers(0, 2**32 - 1))
def test_macro_steps_give_the_same_run(seed: int) -> None:
    d, num_blocks = longer(seed)
    assert_same(d, seed, num_blocks=num_blocks)


def test_the_property_covers_cuts_finishes_preemption_and_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The random scenarios above really exercise the hard cases (else the property proves little)."""
    seen: Counter[str] = Counter()

    def counting(name: str, f: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = f(*args, **kwargs)
            seen[name] += out is not False
            return out
        return wrapped

    monkeypatch.setattr(Scheduler, "_preempt", counting("preempted", Scheduler._preempt))
    monkeypatch.setattr(Scheduler, "finish_running", counting("finished inside a macro step", Scheduler.finish_running))
    monkeypatch.setattr(MacroStep, "cut", counting("cut short", MacroStep.cut))
    for seed in range(10):
        d, num_blocks = longer(seed)
        a, b = assert_same(d, seed, num_blocks=num_blocks)
        seen["fewer events queued"] += b.queue_events < a.queue_events
        seen["failures"] += a.failures > 0
    assert seen["fewer events queued"] >= 7 and seen["failures"] >= 3, seen
    assert min(seen["preempted"], seen["finished inside a macro step"], seen["cut short"]) >= 10, seen


def test_arrivals_exactly_at_step_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evenly spaced arrivals and a constant step time, all dyadic (exact in floating point): requests
    reach a replica at the very time one of its steps ends. They join the next step in both modes
    (events at a time come before a step ending then)."""
    d, _ = longer(3)
    d["failures"] = []
    for t in d["traffic"]:
        t.update(arrival="uniform", rate_per_s=16.0, output_tokens=30, system_prompts=0, allowed=["EU"])
    for site in d["sites"]:
        site["jurisdiction"] = "EU"
    d["links"] = [{**link, "rtt_ms": 0.0} for link in d["links"]]
    ties = Counter()
    advance = MacroStep.advance

    def watch(self: MacroStep, t: float, sched: Scheduler) -> Any:
        ties["at a step end"] += t in self.ends[:self.k]
        return advance(self, t, sched)

    monkeypatch.setattr(MacroStep, "advance", watch)
    a, b = assert_same(d, 0, cost_override=lambda s: 1 / 64)
    assert b.queue_events < a.queue_events and ties["at a step end"] >= 5, ties


def test_plan_refuses_what_it_cannot_prove() -> None:
    """No macro step while a request waits for admission, or under a policy whose order moves (WFQ)."""
    d, _ = longer(5)
    d["simulation"]["policy"] = "wfq"
    a, b = assert_same(d, 5)
    assert a.queue_events == b.queue_events  # WFQ: one event per step either way
    d["simulation"]["policy"] = "fcfs"
    sim = Simulator(scenario_from_dict(d), 0)
    rep = next(r for r in sim.replicas if r.role == "colocated")
    seq = Sequence([1, 2, 3], max_tokens=50)
    rep.add(seq, 0.0)
    batch, _ = rep.start_step(0.0)
    rep.finish_step(batch, 0.01)
    assert plan_macro(rep.scheduler, rep.cost, 0.01, 64) is not None  # one decoding sequence: its next steps are plain
    rep.add(Sequence([4, 5], max_tokens=5), 0.01)
    assert plan_macro(rep.scheduler, rep.cost, 0.01, 64) is None  # a request waits: the next step admits it
    assert plan_macro(rep.scheduler, rep.cost, 0.01, 1) is None  # fewer than 2 steps: not worth a plan


@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 4000)), min_size=1, max_size=40), st.integers(0, 1))
def test_costs_from_sums_equal_costs_from_shapes(chunks: list[tuple[int, int]], sample_last: int) -> None:
    """A macro step prices its steps from the shape's sums: the same float as from the whole shape."""
    from reference.cluster.costs import RooflineCost
    from reference.cluster.macro import DecodeShape
    from reference.engine.cost import StepShape, StepTimeModel

    d, _ = longer(0)
    s = scenario_from_dict(d)
    roofline = RooflineCost(next(iter(s.models.values())), next(iter(s.gpu_types.values())), 2)
    fitted = StepTimeModel(0.04, 0.0025, 2e-6, 0.004, 0.05)
    new = tuple(n for n, _ in chunks)
    shape = StepShape(new, tuple(n + c for n, c in chunks), sum(1 for _ in chunks) - 1 + sample_last)
    sums = (shape.num_tokens, shape.attention_pairs(), shape.num_sampled, sum(shape.context_lens) - shape.num_tokens)
    for model in (roofline, fitted):
        assert model.seconds_of(*sums) == model(shape)
    assert roofline.flops_of(*sums[:3]) == roofline.flops(shape)
    decode = StepShape((1,) * len(chunks), tuple(c + 1 for _, c in chunks), len(chunks))
    fast = DecodeShape(new_tokens=decode.new_tokens, context_lens=decode.context_lens, num_sampled=len(chunks),
                       pairs=sum(decode.context_lens))
    assert fast.attention_pairs() == decode.attention_pairs() and roofline(fast) == roofline(decode)
