"""Weighted fair queuing under a permanent backlog: each tenant's service tracks its weight.

The bound (derived in reference/sched/policy.py, computed by ``wfq_fairness_bound``): with every
tenant backlogged from the start and no preemption, at every step, for any two tenants a, b

    |S_a / w_a - S_b / w_b| <= B = (max_num_seqs * L_max + max_num_batched_tokens) / w_min

where S_t is the number of tokens computed for tenant t and L_max the largest prompt + max_tokens.
It follows that each tenant's share of all service S stays within ``w_a * B / S`` of its weight share
``w_a / W`` (W = the sum of weights): the deviation shrinks like 1/S. The same check fails for FCFS,
which serves tenants by arrival and ignores weights (so this test can tell the two apart).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.kv import BlockManager
from reference.sched import FCFS, Scheduler, SchedulerConfig, Sequence, Tenants, sjf_wfq
from reference.sched.policy import WFQ, wfq_fairness_bound
from tests.fake_plane import FakeKV, run_step

TENANTS = Tenants({"paid-a": "paid", "free-b": "free", "free-c": "free"})  # weights 4 : 1 : 1
MAX_PROMPT, MAX_TOKENS, MAX_SEQS, BUDGET = 8, 8, 4, 16
BOUND = wfq_fairness_bound(MAX_SEQS, MAX_PROMPT + MAX_TOKENS, BUDGET, w_min=1.0)


def backlogged_run(policy, seed: int, steps: int):
    """Every tenant always has 3 waiting requests of random size; returns tokens served per tenant, per step."""
    rng = random.Random(seed)
    sched = Scheduler(BlockManager(1024, 4), SchedulerConfig(BUDGET, MAX_SEQS), policy, tenants=TENANTS)
    kv = FakeKV(1024, 4)
    served = dict.fromkeys(TENANTS.plan_of, 0)
    history = []
    for t in range(steps):
        for tenant in TENANTS.plan_of:
            while sum(s.tenant == tenant for s in sched.waiting) < 3:
                prompt = [rng.randrange(1000) for _ in range(rng.randint(1, MAX_PROMPT))]
                sched.add(Sequence(prompt, max_tokens=rng.randint(1, MAX_TOKENS), tenant=tenant), float(t))
        batch, _ = run_step(sched, kv, float(t))
        assert not batch.preempted  # the bound assumes no recomputation
        for e in batch.entries:
            served[e.seq.tenant] += e.num_new_tokens
        history.append(dict(served))
    return history


def normalized_gap(served: dict[str, int]) -> float:
    norm = [served[t] / TENANTS.weight(t) for t in served]
    return max(norm) - min(norm)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), sjf=st.booleans())
def test_wfq_service_stays_within_the_bound_of_the_weights(seed, sjf):
    policy = sjf_wfq(TENANTS, aging=0.5) if sjf else WFQ(TENANTS)
    history = backlogged_run(policy, seed, steps=300)
    for served in history:
        assert normalized_gap(served) <= BOUND
    final = history[-1]
    total = sum(final.values())
    weight_sum = sum(TENANTS.weight(t) for t in final)
    for tenant, s in final.items():
        w = TENANTS.weight(tenant)
        assert abs(s / total - w / weight_sum) <= w * BOUND / total
    assert abs(final["paid-a"] / total - 4 / 6) < 0.1  # a concrete reading of the bound after 300 steps


def test_fcfs_breaks_the_bound():
    history = backlogged_run(FCFS(), seed=1, steps=300)
    assert normalized_gap(history[-1]) > BOUND
    final = history[-1]
    assert final["paid-a"] / sum(final.values()) < 0.45  # ~1/3: weights ignored


@pytest.mark.parametrize("policy", ["wfq", "sjf+wfq"])
def test_late_tenant_cannot_bank_idle_time(policy):
    """A tenant joining after 200 steps gets its weight share from then on, not a catch-up burst."""
    wfq = WFQ(TENANTS) if policy == "wfq" else sjf_wfq(TENANTS)
    sched = Scheduler(BlockManager(1024, 4), SchedulerConfig(BUDGET, MAX_SEQS), wfq)
    kv, rng = FakeKV(1024, 4), random.Random(7)
    window = dict.fromkeys(TENANTS.plan_of, 0)
    for t in range(400):
        active = ["paid-a", "free-b"] + (["free-c"] if t >= 200 else [])
        for tenant in active:
            while sum(s.tenant == tenant for s in sched.waiting) < 3:
                prompt = [rng.randrange(1000) for _ in range(rng.randint(1, MAX_PROMPT))]
                sched.add(Sequence(prompt, max_tokens=rng.randint(1, MAX_TOKENS), tenant=tenant), float(t))
        batch, _ = run_step(sched, kv, float(t))
        if t >= 200:
            for e in batch.entries:
                window[e.seq.tenant] += e.num_new_tokens
    share_c = window["free-c"] / sum(window.values())
    assert abs(share_c - 1 / 6) < 0.08  # without the lift it would take everything until it caught up
