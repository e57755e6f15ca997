"""One simulated engine replica: the real scheduler and block manager, stepping on a virtual clock.

A replica never runs a model. ``start_step(now)`` asks its ``Scheduler`` for the next batch (exactly
as the engine does) and returns when that step would end, by the step cost model; ``finish_step``
hands the scheduler a placeholder token for every sequence that samples. Its load counters (prompt
tokens still to prefill, output tokens still to decode, live requests) are what the router reads
(token-aware load, as opposed to counting requests).

A disaggregated decode replica receives a request's KV from a prefill replica: ``import_kv``
allocates blocks for the transferred tokens, marks them computed and frees them, which leaves them
in the prefix cache under their deterministic keys; when the request is then added, admission finds
them there and only the last, partial block is recomputed. If memory is short the import is skipped
and the decode replica recomputes the prompt (``kv_recomputed`` counts such requests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reference.cluster.costs import decode_step_s, per_token_prefill_s
from reference.cluster.macro import MacroStep, plan_macro
from reference.engine.cost import StepShape
from reference.kv.block_manager import BlockManager
from reference.sched import Batch, Scheduler, SchedulerConfig, Sequence
from reference.sched.policy import Policy


@dataclass
class _Carrier:
    """The fields the block manager needs, to park transferred K/V in the prefix cache."""

    seq_id: int
    token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)


@dataclass
class Replica:
    """A replica of one model on ``gpus`` GPUs at one site, in one role."""

    index: int
    site: str
    jurisdiction: str
    tier: str
    model: str
    role: str  # colocated | prefill | decode
    cost: Callable[[StepShape], float]
    flops: Callable[[StepShape], float]
    # the same from (new tokens, attention pairs, sampled sequences)
    flops_of: Callable[[int, int, int], float]
    peak_flops_per_s: float
    num_blocks: int
    block_size: int
    config: SchedulerConfig
    policy: Policy
    measure_until: float = float("inf")  # busy time and FLOPs are counted only before this time
    alive: bool = True
    epoch: int = 0  # bumped by a failure: step-end events of an older epoch are stale
    stepping: bool = False
    busy_s: float = 0.0
    flops_done: float = 0.0
    # time of steps that computed prompt tokens (for the pool's utilization)
    prefill_busy_s: float = 0.0
    prefill_flops: float = 0.0
    pending_prefill: int = 0
    pending_decode: int = 0
    kv_recomputed: int = 0
    macro: MacroStep | None = None  # the macro step in flight, if any (``macro.py``)
    scheduler: Scheduler = field(init=False)
    _tok_s: float = field(init=False)
    _decode_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.reset()
        self._tok_s = per_token_prefill_s(self.cost, self.config.max_num_batched_tokens)
        self._decode_s = decode_step_s(self.cost, self.config.max_num_seqs)

    def reset(self) -> None:
        """Empty memory and queues (a fresh start after a failure)."""
        self.scheduler = Scheduler(BlockManager(self.num_blocks, self.block_size), self.config,
                                   self.policy)
        self.pending_prefill = self.pending_decode = 0
        self.stepping = False
        self.macro = None

    @property
    def num_live(self) -> int:
        return self.scheduler.num_unfinished

    def est_wait_s(self, now: float = 0.0) -> float:
        """Estimated queueing before a new request's prefill starts, from the tokens in flight at
        ``now``."""
        cap = self.config.max_num_seqs
        plan = self.macro  # in flight: the counters as single steps would show them at ``now``
        n = self.num_live if plan is None else self.num_live - plan.finished_by(now)
        wait = self.pending_prefill * self._tok_s
        if n + 1 > cap:
            decode = (
                self.pending_decode
                if plan is None
                else max(0, self.pending_decode - plan.sampled_by(now))
            )
            wait += (n + 1 - cap) / cap * (decode / max(n, 1)) * self._decode_s
        return wait

    def add(self, seq: Sequence, now: float) -> None:
        """Queue a sequence (RequestError if it can never fit this replica)."""
        self.scheduler.add(seq, now)
        self.pending_prefill += seq.num_uncomputed_tokens
        self.pending_decode += seq.max_tokens

    def import_kv(self, token_ids: list[int]) -> bool:
        """Park a transferred prefix in the prefix cache (see the module docstring); False if no
        room."""
        bm = self.scheduler.block_manager
        carrier = _Carrier(seq_id=-1, token_ids=token_ids)
        if not bm.can_allocate(carrier, keep_free=0):
            self.kv_recomputed += 1
            return False
        bm.allocate(carrier)
        carrier.num_computed_tokens = len(token_ids)
        bm.cache_full_blocks(carrier)
        bm.free(carrier)
        return True

    def start_step(self, now: float, macro_cap: int = 0) -> tuple[Batch | MacroStep, float] | None:
        """Plan the next step; returns (batch, end time), or None when there is nothing to run. With
        ``macro_cap`` >= 2, up to that many plain decode steps may come back as one ``MacroStep``
        instead."""
        if self.stepping or not self.alive or not self.scheduler.has_unfinished():
            return None
        if macro_cap >= 2 and self.role != "prefill":
            plan = plan_macro(self.scheduler, self.cost, now, macro_cap)
            if plan is not None:
                self.macro, self.stepping = plan, True
                self.advance_macro(now)  # the first step starts now: its blocks, its busy time
                return plan, plan.ends[plan.k - 1]
        batch = self.scheduler.schedule(now)
        if not batch.entries:
            return None
        tokens, pairs, sampled, context, prefill = step_sums(batch)
        # the step cost model's sums form, where it has one
        seconds_of = getattr(self.cost, "seconds_of", None)
        if seconds_of is not None:
            seconds = seconds_of(tokens, pairs, sampled, context - tokens)
        else:
            seconds = self.cost(StepShape(tuple(e.num_new_tokens for e in batch.entries),
                                          tuple(e.context_len for e in batch.entries), sampled))
        # the part inside the measured window
        counted = max(0.0, min(seconds, self.measure_until - now))
        flops = self.flops_of(tokens, pairs, sampled) * (counted / seconds if seconds > 0 else 0.0)
        self.busy_s += counted
        self.flops_done += flops
        if prefill:
            self.prefill_busy_s += counted
            self.prefill_flops += flops
        self.stepping = True
        return batch, now + seconds

    def finish_step(self, batch: Batch, now: float) -> list[Any]:
        """Record the step; returns the scheduled entries (the caller reads which sampled, which
        finished)."""
        self.stepping = False
        self.scheduler.postprocess(batch, [0 if e.needs_sample else None for e in batch.entries],
                                   now)
        for e in batch.entries:
            if e.is_prefill:
                self.pending_prefill = max(0, self.pending_prefill - e.num_new_tokens)
            if e.needs_sample:
                self.pending_decode = max(0, self.pending_decode - 1)
        return batch.entries

    def advance_macro(self, now: float) -> None:
        """Bring the macro step in flight up to ``now`` (``MacroStep.advance``) and apply what it
        hands back."""
        plan = self.macro
        progress = plan.advance(now, self.scheduler)
        self._count_macro_busy(plan, *progress.started)
        self.pending_decode = max(0, self.pending_decode - progress.sampled)

    def _count_macro_busy(self, plan: MacroStep, first: int, last: int) -> None:
        """Busy time and FLOPs of planned steps first+1 .. last, counted at each step's start (as
        ``start_step`` does for a single step)."""
        for i in range(first, last):  # 0-based: step i + 1
            seconds = plan.seconds[i]
            # only inside the measured window
            room = self.measure_until - (plan.ends[i - 1] if i else plan.start)
            counted = seconds if room >= seconds else room if room > 0 else 0.0
            self.busy_s += counted
            if counted > 0:
                shape, n = plan.shapes[i], plan.sizes[i]
                flops = (
                    self.flops(shape)
                    if shape is not None
                    else self.flops_of(n, plan.context_sums[i], n)
                )
                self.flops_done += flops * (counted / seconds)
            else:
                self.flops_done += 0.0

    def finish_macro(self, plan: MacroStep) -> None:
        """The last step of a macro step ended: apply all of it (the caller hands out its
        tokens)."""
        assert plan is self.macro, "the plan that ended is the one in flight"
        self.advance_macro(float("inf"))
        self.macro, self.stepping = None, False

    def drop(self, decode_left: int) -> None:
        """A request left before finishing (aborted): forget its remaining decode tokens."""
        self.pending_decode = max(0, self.pending_decode - decode_left)


def step_sums(batch: Batch) -> tuple[int, int, int, int, int]:
    """A step's shape as the sums the step cost model reads, in one pass over its entries: new
    tokens, attention pairs (a new token at position p attends to p + 1 keys, as
    ``StepShape.attention_pairs``), sampled sequences, contexts after the step, and prompt tokens
    (prefill entries' new tokens)."""
    tokens = pairs = sampled = context = prefill = 0
    for e in batch.entries:
        n, start = e.num_new_tokens, e.start
        tokens += n
        pairs += n * start + n * (n + 1) // 2
        context += start + n
        if e.needs_sample:
            sampled += 1
        if e.is_prefill:
            prefill += n
    return tokens, pairs, sampled, context, prefill
