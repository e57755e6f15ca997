"""Build a scenario's replicas, and draw its requests, with one seeded RNG.

Each replica gets the real ``Scheduler`` + ``BlockManager`` sized from its GPUs' memory: the blocks
that fit in ``kv_fraction`` of the memory after the weights, capped at what ``max_num_seqs`` of the
scenario's longest requests could ever hold twice over (more would only be idle prefix cache, and
would cost the simulator memory at 1,000 GPUs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from reference.cluster.costs import RooflineCost, kv_bytes_per_token, weight_bytes
from reference.cluster.replica import Replica
from reference.cluster.scenario import Scenario, ScenarioError
from reference.engine.cost import StepShape
from reference.kv.prefix_hash import prefix_keys
from reference.sched import SchedulerConfig, Tenants, make_policy
from reference.sched.tenants import DEFAULT_PLAN_WEIGHTS

AFFINITY_BLOCKS = 8  # the router looks at the keys of a prompt's first 8 full blocks
VOCAB_FOR_TOKENS = 30_000  # placeholder token ids are drawn below this


def longest_request(s: Scenario) -> int:
    return max(t.max_prompt + t.system_prompt_tokens + t.max_output + 1 for t in s.traffic)


def build_replicas(s: Scenario, cost_override: Callable[[StepShape], float] | None = None,
                   num_blocks: int | None = None) -> list[Replica]:
    """Every replica of every site, in file order. ``cost_override``: one step-time model for all;
    ``num_blocks``: this many KV blocks each (to mirror a real engine's cache), instead of from
    memory."""
    plans = sorted({t.plan for t in s.traffic})
    tenants = Tenants({p: p for p in plans}, {p: DEFAULT_PLAN_WEIGHTS.get(p, 1.0) for p in plans})
    config = SchedulerConfig(max_num_batched_tokens=s.max_num_batched_tokens,
                             max_num_seqs=s.max_num_seqs)
    cap = 2 * s.max_num_seqs * -(-longest_request(s) // s.block_size)
    replicas = []
    for site in s.sites.values():
        for spec in site.replicas:
            model, gpu = s.models[spec.model], s.gpu_types[spec.gpu]
            roofline = RooflineCost(model, gpu, spec.gpus)
            free = spec.gpus * gpu.memory_gb * 1e9 * s.kv_fraction - weight_bytes(model)
            blocks = int(free // (s.block_size * kv_bytes_per_token(model)))
            if blocks < -(-longest_request(s) // s.block_size):
                raise ScenarioError(f"sites[{site.name}]: model {model.name} on {spec.gpus} x "
                                    f"{gpu.name} leaves room "
                                    f"for {max(blocks, 0)} KV blocks, less than the longest "
                                    "request needs")
            for _ in range(spec.count):
                replicas.append(Replica(
                    index=len(replicas), site=site.name, jurisdiction=site.jurisdiction,
                    tier=site.tier,
                    model=model.name, role=spec.role, cost=cost_override or roofline,
                    flops=roofline.flops,
                    flops_of=roofline.flops_of, peak_flops_per_s=roofline.peak_flops_per_s,
                    num_blocks=num_blocks or min(blocks, cap),
                    block_size=s.block_size, config=config, policy=make_policy(s.policy, tenants),
                    measure_until=s.duration_s))
    if not replicas:
        raise ScenarioError("the scenario has no replicas: add [[sites.replicas]] entries")
    return replicas


@dataclass(eq=False)
class Request:
    """One request and what happened to it."""

    rid: int
    traffic: int
    origin: str
    allowed: tuple[str, ...]
    models: tuple[str, ...]
    plan: str
    arrival: float
    prompt: list[int]
    output_len: int
    access_s: float  # one-way last-mile delay
    back_s: float = 0.0  # one-way delay from the replica now computing it back to its origin site
    prefix_keys: tuple[bytes, ...] = ()
    first_token: float | None = None  # client-side times
    last_token: float | None = None
    finish: float | None = None
    gaps: list[float] = field(default_factory=list)  # inter-token gaps seen by the client
    visited: list[str] = field(default_factory=list)  # every site that computed or held its data
    retries: int = 0
    decision: object = None
    reason: str = ""
    outcome: str = ""


class RequestSource:
    """Arrivals of every traffic class, drawn lazily from one RNG (so a million requests fit in
    memory)."""

    def __init__(self, s: Scenario, rng: np.random.Generator, lengths: np.ndarray | None) -> None:
        self.s, self.rng, self.lengths = s, rng, lengths
        self.next_id = 0
        self.system = [[rng.integers(0, VOCAB_FOR_TOKENS, t.system_prompt_tokens).tolist()
                        for _ in range(t.system_prompts)] for t in s.traffic]

    def gap(self, k: int) -> float:
        t = self.s.traffic[k]
        return (
            float(self.rng.exponential(1 / t.rate_per_s))
            if t.arrival == "poisson"
            else 1 / t.rate_per_s
        )

    def make(self, k: int, now: float) -> Request:
        t, rng = self.s.traffic[k], self.rng
        if t.lengths == "fixed":
            prompt_len, answer = t.prompt_tokens, t.output_tokens
        else:
            prompt_len, answer = (int(x) for x in self.lengths[rng.integers(len(self.lengths))])
        prompt_len = max(1, min(prompt_len, t.max_prompt))
        output_len = max(1, min(int(np.ceil(answer * t.output_scale)), t.max_output))
        prompt = rng.integers(0, VOCAB_FOR_TOKENS, prompt_len).tolist()
        if t.system_prompts:
            prompt = self.system[k][int(rng.integers(t.system_prompts))] + prompt
        return self.make_from(k, now, prompt, output_len)

    def make_from(self, k: int, now: float, prompt: list[int], output_len: int) -> Request:
        """A request of traffic class ``k`` with the given prompt and output length (also for
        replays)."""
        t, rng = self.s.traffic[k], self.rng
        origin = t.origins[int(rng.integers(len(t.origins)))]
        keys = prefix_keys(prompt[:AFFINITY_BLOCKS * self.s.block_size], self.s.block_size)
        self.next_id += 1
        return Request(rid=self.next_id - 1, traffic=k, origin=origin, allowed=t.allowed,
                       models=t.models,
                       plan=t.plan, arrival=now, prompt=prompt, output_len=output_len,
                       access_s=t.access_rtt_ms / 2000, prefix_keys=tuple(keys))
