"""Colocated vs disaggregated serving in simulated time, with the real scheduler (E4's GPU regime).

Not an experiment itself. Each GPU is a ``Scheduler`` + ``BlockManager`` (the engine's own control
plane); a step takes ``roofline(step shape)`` seconds: the larger of its FLOPs at a share of the
GPU's peak and its bytes at a share of its memory bandwidth (``reference/engine/cost.py`` counts
both), plus a fixed launch overhead. Colocated: each replica runs prompts (chunked) and decodes in
the same steps. Disaggregated: the prefill GPU runs prompts only; when a prompt's last chunk ends,
its KV arrives at the decode GPU after the exposed part of the transfer (the last layer's fp8 frame
at the link's bandwidth: the rest overlaps the compute, see E6), and joins the decode batch with
``Scheduler.add_running``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from reference.disagg.wire import KVLayout
from reference.engine.cost import StepShape, step_bytes, step_flops
from reference.kv.block_manager import BlockManager
from reference.model.config import LlamaConfig
from reference.sched import Scheduler, SchedulerConfig
from reference.sched import Sequence as SchedSequence


@dataclass(frozen=True)
class Gpu:
    name: str = "H100 SXM"
    flops: float = 989e12  # dense bf16
    bandwidth: float = 3.35e12  # HBM bytes/s
    flops_share: float = 0.6
    bandwidth_share: float = 0.8
    overhead: float = 0.3e-3  # per step


def roofline(config: LlamaConfig, gpu: Gpu) -> Callable[[StepShape], float]:
    def cost(s: StepShape) -> float:
        return max(step_flops(config, s) / (gpu.flops * gpu.flops_share),
                   step_bytes(config, s) / (gpu.bandwidth * gpu.bandwidth_share)) + gpu.overhead
    return cost


@dataclass
class SimReq:
    arrival: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)


class Node:
    """One GPU: a scheduler, its clock, and the requests it is running."""

    def __init__(self, cost: Callable[[StepShape], float], budget: int, max_seqs: int, num_blocks: int) -> None:
        self.cost, self.clock = cost, 0.0
        self.bm = BlockManager(num_blocks, 16, enable_prefix_cache=False)
        self.sched = Scheduler(self.bm, SchedulerConfig(budget, max_seqs))

    def step(self, on_token: Callable[[SchedSequence, float], None]) -> None:
        batch = self.sched.schedule(self.clock)
        shape = StepShape(tuple(e.num_new_tokens for e in batch.entries), tuple(e.context_len for e in batch.entries),
                          sum(e.needs_sample for e in batch.entries))
        self.clock += self.cost(shape)
        self.sched.postprocess(batch, [0 if e.needs_sample else None for e in batch.entries], self.clock)
        for e in batch.entries:
            if e.needs_sample:
                on_token(e.seq, self.clock)


def _seq(r: SimReq, max_tokens: int) -> SchedSequence:
    return SchedSequence(prompt_token_ids=[1] * r.prompt_len, max_tokens=max_tokens, arrival_time=r.arrival, request=r)


def run_events(nodes: Sequence[Node], arrivals: list[tuple[float, Callable[[], None]]],
               on_token: Callable[[SchedSequence, float], None]) -> None:
    """Advance the node that is furthest behind; deliver arrivals (time, action) in time order."""
    heapq.heapify(arrivals)
    while arrivals or any(n.sched.has_unfinished() for n in nodes):
        busy = [n for n in nodes if n.sched.has_unfinished()]
        t_next = arrivals[0][0] if arrivals else float("inf")
        node = min(busy, key=lambda n: n.clock) if busy else None
        if node is None or t_next <= node.clock:
            t, _, action = heapq.heappop(arrivals)
            for n in nodes:
                if not n.sched.has_unfinished():
                    n.clock = max(n.clock, t)
            action()
            continue
        node.step(on_token)


def colocated(reqs: list[SimReq], config: LlamaConfig, gpu: Gpu, replicas: int = 2, budget: int = 2048,
              max_seqs: int = 64, num_blocks: int = 16384) -> None:
    nodes = [Node(roofline(config, gpu), budget, max_seqs, num_blocks) for _ in range(replicas)]

    def admit(r: SimReq) -> Callable[[], None]:
        def go() -> None:
            node = min(nodes, key=lambda n: sum(s.predicted_remaining_work() for s in (*n.sched.running,
                                                                                         *n.sched.waiting)))
            node.sched.add(_seq(r, r.output_len), r.arrival)
        return go

    arrivals = [(r.arrival, k, admit(r)) for k, r in enumerate(reqs)]
    run_events(nodes, arrivals, lambda s, t: s.request.token_times.append(t))  # type: ignore[arg-type]


def disaggregated(reqs: list[SimReq], config: LlamaConfig, gpu: Gpu, link_gbit: float = 400, budget: int = 2048,
                  max_seqs: int = 64, num_blocks: int = 16384) -> None:
    cost = roofline(config, gpu)
    prefill, decode = Node(cost, budget, max_seqs, num_blocks), Node(cost, budget, max_seqs, num_blocks)
    layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim, 16, "fp8")
    arrivals: list = [(r.arrival, k, (lambda r=r: prefill.sched.add(_seq(r, 1), r.arrival)))
                      for k, r in enumerate(reqs)]
    counter = [len(reqs)]

    def handoff(r: SimReq) -> Callable[[], None]:
        def go() -> None:
            seq = _seq(r, r.output_len)
            decode.bm.allocate(seq)
            seq.num_computed_tokens = r.prompt_len
            seq.token_ids.append(0)
            if r.output_len > 1:
                decode.sched.add_running(seq, decode.clock)
        return go

    def on_token(seq: SchedSequence, t: float) -> None:
        r = seq.request
        if seq.max_tokens == 1:  # the prefill GPU sampled the first token: hand the KV over
            exposed = layout.payload_size(0, r.prompt_len) * 8 / (link_gbit * 1e9)  # the last layer's frame
            r.token_times.append(t + exposed)
            counter[0] += 1
            heapq.heappush(arrivals, (t + exposed, counter[0], handoff(r)))
        else:
            r.token_times.append(t)

    run_events([prefill, decode], arrivals, on_token)
