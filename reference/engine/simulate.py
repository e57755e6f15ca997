"""The real scheduler and block manager driven in simulated time, with a step-time model.

For workloads too large to run through the NumPy model on a CPU: every step is planned by the real
``Scheduler`` exactly as in the engine, but instead of running the model the clock advances by
``cost_model(step shape)`` (fitted to measured engine steps, ``reference.engine.cost``) and each
sampled token is a placeholder. Requests have fixed output lengths (no end token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from reference.engine.cost import StepShape
from reference.kv.block_manager import BlockManager
from reference.sched import Scheduler, SchedulerConfig, Tenants
from reference.sched import Sequence as SchedSequence


@dataclass
class SimRequest:
    arrival: float
    prompt_len: int
    output_len: int
    tenant: str = "default"
    predicted_output_len: int | None = None  # what SJF sees; None: the true length
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival


@dataclass
class SimStep:
    start: float
    end: float
    tokens_by_tenant: dict[str, int]


def simulate(requests: Sequence[SimRequest], policy: object,
             cost_model: Callable[[StepShape], float], *,
             num_blocks: int, block_size: int = 16, max_num_batched_tokens: int = 256,
             max_num_seqs: int = 32,
             tenants: Tenants | None = None, seed: int = 0) -> list[SimStep]:
    """Run every request to completion; fills each request's token_times/finish; returns the
    steps."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_cache=False)
    sched = Scheduler(bm, SchedulerConfig(max_num_batched_tokens, max_num_seqs), policy, tenants)
    rng = np.random.default_rng(seed)
    order = sorted(requests, key=lambda r: r.arrival)
    steps: list[SimStep] = []
    now, i = 0.0, 0
    while i < len(order) or sched.has_unfinished():
        while i < len(order) and order[i].arrival <= now:
            r = order[i]
            prompt = rng.integers(0, 30000, size=r.prompt_len).tolist()
            sched.add(SchedSequence(prompt, max_tokens=r.output_len, tenant=r.tenant,
                                    arrival_time=r.arrival,
                                    predicted_output_len=r.predicted_output_len, request=r),
                      r.arrival)
            i += 1
        if not sched.has_unfinished():
            now = order[i].arrival
            continue
        batch = sched.schedule(now)
        shape = StepShape(tuple(e.num_new_tokens for e in batch.entries),
                          tuple(e.context_len for e in batch.entries),
                          sum(e.needs_sample for e in batch.entries))
        end = now + cost_model(shape)
        served: dict[str, int] = {}
        for e in batch.entries:
            served[e.seq.tenant] = served.get(e.seq.tenant, 0) + e.num_new_tokens
        sched.postprocess(batch, [0 if e.needs_sample else None for e in batch.entries], end)
        for e in batch.entries:
            if e.needs_sample:
                e.seq.request.token_times.append(end)
                if e.seq.is_finished:
                    e.seq.request.finish = end
        steps.append(SimStep(now, end, served))
        now = end
    return steps


def service_share(steps: Sequence[SimStep], start: float, end: float) -> dict[str, float]:
    """Each tenant's share of the tokens computed by steps that began in [start, end)."""
    totals: dict[str, int] = {}
    for s in steps:
        if start <= s.start < end:
            for tenant, n in s.tokens_by_tenant.items():
                totals[tenant] = totals.get(tenant, 0) + n
    grand = sum(totals.values()) or 1
    return {t: n / grand for t, n in sorted(totals.items())}
