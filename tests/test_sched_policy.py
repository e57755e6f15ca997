"""Policies: FCFS, SJF with aging, WFQ counters and lifting, SJF inside WFQ, configuration errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.kv import BlockManager
from reference.sched import (
    FCFS,
    SJF,
    WFQ,
    ConfigError,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
    Tenants,
    UnknownTenantError,
    make_policy,
    sjf_wfq,
)
from tests.fake_plane import FakeKV, run_step

TENANTS = Tenants({"acme": "paid", "bob": "free", "eve": "free"})


def make(policy, max_seqs=1, budget=64, num_blocks=256, block_size=4):
    sched = Scheduler(BlockManager(num_blocks, block_size), SchedulerConfig(budget, max_seqs), policy)
    return sched, FakeKV(num_blocks, block_size)


def admission_order(sched, kv, seqs, t0=1.0):
    order, t = [], t0
    while sched.has_unfinished():
        batch, _ = run_step(sched, kv, t)
        order += [e.seq for e in batch.entries if all(e.seq is not o for o in order)]
        t += 1.0
    assert {id(s) for s in order} == {id(s) for s in seqs}
    return order


def test_fcfs_serves_in_arrival_order():
    sched, kv = make(FCFS())
    seqs = [Sequence([1, 2], max_tokens=3, arrival_time=t) for t in (2.0, 0.0, 1.0)]
    for s in seqs:
        sched.add(s)
    assert admission_order(sched, kv, seqs) == [seqs[1], seqs[2], seqs[0]]


def test_sjf_serves_the_shortest_predicted_work_first():
    sched, kv = make(SJF())
    long_ = Sequence([1] * 30, max_tokens=5, arrival_time=0.0)
    mid = Sequence([1] * 4, max_tokens=20, predicted_output_len=10, arrival_time=0.0)
    short = Sequence([1] * 4, max_tokens=20, predicted_output_len=2, arrival_time=0.0)
    for s in (long_, mid, short):
        sched.add(s)
    assert admission_order(sched, kv, [long_, mid, short]) == [short, mid, long_]


@pytest.mark.parametrize("aging,served", [(0.0, False), (2.0, True)])
def test_aging_keeps_a_long_job_from_starving(aging, served):
    """One slot; a stream of short jobs arrives every step. Without aging the long job never runs."""
    sched, kv = make(SJF(aging), budget=64)
    long_ = Sequence([1] * 40, max_tokens=20, arrival_time=0.0)
    sched.add(long_)
    for t in range(1, 120):
        sched.add(Sequence([2], max_tokens=1, arrival_time=float(t)))
        run_step(sched, kv, float(t))
        if long_.status is not SequenceStatus.WAITING:
            break
    assert (long_.status is not SequenceStatus.WAITING) == served
    if served:  # key 60 - 2 t vs ~2 for a new short job: its turn comes at t ~ 29
        assert long_.first_scheduled_time < 40


def test_wfq_charges_tokens_over_weight_and_lifts_a_newly_active_tenant():
    wfq = WFQ(TENANTS)
    sched, kv = make(wfq, max_seqs=2, budget=8)
    for i in range(3):
        sched.add(Sequence([i] * 8, max_tokens=8, tenant="acme", arrival_time=0.0))
    served = sum(run_step(sched, kv, float(t))[0].num_batched_tokens for t in range(1, 6))
    assert served >= 16 and wfq.counters["acme"] == pytest.approx(served / 4.0)  # weight 4
    bob = Sequence([1] * 8, max_tokens=8, tenant="bob", arrival_time=6.0)
    sched.add(bob)
    assert wfq.counters["bob"] == wfq.counters["acme"]  # lifted: no credit for having been idle
    with pytest.raises(UnknownTenantError, match="mallory"):
        sched.add(Sequence([2], max_tokens=1, tenant="mallory", arrival_time=6.0))
    assert len(sched.waiting) + len(sched.running) == 4


def test_wfq_weights_give_the_paid_tenant_four_admissions_per_free_one():
    sched, kv = make(WFQ(TENANTS), max_seqs=1, budget=4)
    seqs = [Sequence([1, 2, 3], max_tokens=1, tenant=t, arrival_time=0.0) for t in ["bob"] * 10 + ["acme"] * 10]
    for s in seqs:
        sched.add(s)
    tenants = [s.tenant for s in admission_order(sched, kv, seqs)][:10]
    assert tenants.count("acme") == 8 and tenants.count("bob") == 2  # 4 : 1 while both are backlogged


def test_sjf_inside_wfq_orders_each_tenant_by_predicted_work():
    sched, kv = make(sjf_wfq(TENANTS), max_seqs=1, budget=64)
    acme = [Sequence([1] * n, max_tokens=1, tenant="acme", arrival_time=0.0) for n in (9, 3, 6)]
    for s in acme:
        sched.add(s)
    order = admission_order(sched, kv, acme)
    assert [s.num_prompt_tokens for s in order] == [3, 6, 9]


def test_wfq_preempts_the_tenant_furthest_ahead():
    wfq = WFQ(TENANTS)
    wfq.counters.update({"acme": 5.0, "bob": 9.0})
    a = Sequence([1], tenant="acme", arrival_time=0.0)
    b = Sequence([1], tenant="bob", arrival_time=1.0)
    assert max([a, b], key=lambda s: wfq.key(s, 2.0)) is b


def test_configuration_errors():
    with pytest.raises(ConfigError, match="aging"):
        SJF(-1.0)
    with pytest.raises(ConfigError, match="unknown policy"):
        make_policy("lottery")
    with pytest.raises(ConfigError, match="Tenants"):
        make_policy("wfq")
    with pytest.raises(ConfigError, match="weight"):
        Tenants({"a": "paid"}, {"paid": 0.0})
    with pytest.raises(UnknownTenantError, match="gold"):
        Tenants({"a": "gold"})
    assert Tenants.open().weight("anyone") == 1.0
    assert Tenants({}, default_plan="free").plan("x") == "free"
    for name in ("fcfs", "sjf", "wfq", "sjf+wfq", "static"):
        assert make_policy(name, TENANTS).name == name


@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20), st.none() | st.integers(0, 25),
                          st.sampled_from(["acme", "bob", "eve"]), st.integers(0, 5)), min_size=1, max_size=12),
       st.sampled_from(["fcfs", "sjf", "wfq", "sjf+wfq", "static"]),
       st.dictionaries(st.sampled_from(["acme", "bob", "eve"]), st.integers(0, 3).map(float)))
def test_pick_is_the_smallest_key(requests, name, counters):
    policy = make_policy(name, TENANTS, aging=0.7)
    seqs = [Sequence([1] * p, max_tokens=m, predicted_output_len=pred, tenant=t, arrival_time=float(a))
            for p, m, pred, t, a in requests]
    for s in seqs:
        policy.on_add(s)
    if isinstance(policy, WFQ):
        policy.counters.update(counters)
    assert policy.pick(seqs, 9.0) is min(seqs, key=lambda s: policy.key(s, 9.0))


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10**6)), min_size=1, max_size=30, unique_by=lambda t: t[1]))
def test_fcfs_fast_pick_is_the_keyed_pick(arrivals: list[tuple[int, int]]) -> None:
    """FCFS.pick reads (arrival_time, seq_id) directly; it must choose what the generic keyed pick chooses."""
    from reference.sched.policy import Policy

    waiting = [Sequence([1], max_tokens=1, arrival_time=float(a), seq_id=i) for a, i in arrivals]
    assert FCFS().pick(waiting, 0.0) is Policy.pick(FCFS(), waiting, 0.0)

    class Latest(FCFS):  # a subclass with its own key keeps the generic pick
        def key(self, seq: Sequence, now: float) -> tuple:
            return (-seq.arrival_time, seq.seq_id)

    assert Latest().pick(waiting, 0.0) is Policy.pick(Latest(), waiting, 0.0)
