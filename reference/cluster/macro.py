"""Macro steps: a replica advances k plain decode steps in one event, exactly as k single steps
would.

Most steps of a busy replica are plain decode steps: every running sequence gains one token and
nothing else happens. When the next k steps provably are all like that, the simulator plans them at
once (a *macro step*) and puts one event in its queue, at the end of the k-th step, instead of k.
It is exact, not an approximation. ``plan_macro`` accepts k steps only when

* nothing waits for admission and every running sequence is decoding (one uncomputed token), its
  first token sampled, and the next block it writes private (no copy on write);
* the policy orders sequences by a key that does not change while they decode (FCFS), so each of
  the k steps schedules the same sequences in the same order;
* the placeholder token the simulator samples is no stop token, so a sequence finishes exactly when
  it reaches max_tokens or the context length: the plan knows in which step, and retires it there
  (its blocks freed, its request done) as ``Scheduler.postprocess`` would;
* the KV blocks the k steps add fit in the blocks free now, so no step can preempt;
* every step takes a positive time.

Each of the k steps is priced by the cost model on its own shape (the sequences still running, every
context one token longer than the step before). Block boundaries are kept exactly: in the step where
a sequence needs a new block, the block manager's ``may_append`` is called for it at that step's
start, in the scheduler's order; in the step where a block fills, ``cache_full_blocks`` registers it
in the prefix cache at that step's end. A plan changes only the scheduler and the sequences it
planned; what the replica counts (busy time and FLOPs at each step's start, as
``Replica.start_step`` does; decode tokens still to generate) it hands back as deltas (``Progress``)
that the replica applies (``Replica.advance_macro``).

What a plan cannot know is the future: a request that joins the replica, a KV import or a failure at
time t in the middle of it. The simulator then calls ``Replica.advance_macro(t)``, which applies
every step that ended before t and the start of the step in flight at t (events at the same time as
a step's end come before it), and ``cut``, which ends the plan with that step; from there the real
scheduler takes over, exactly where single steps would have admitted the newcomer. The simulator's
switch
``macro_steps=False`` turns all of this off (tests compare both).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, NamedTuple

from reference.engine.cost import StepShape
from reference.sched.policy import FCFS, Policy

if TYPE_CHECKING:
    from collections.abc import Callable

    from reference.sched import Scheduler, Sequence

# what the simulator "samples" (Replica.finish_step hands the scheduler the same)
PLACEHOLDER_TOKEN = 0
NEVER = 1 << 62  # the finish step of a sequence that outlives the plan


@dataclass(frozen=True)
class DecodeShape(StepShape):
    """A plain decode step's shape with its attention pairs counted once: a sequence of context c
    that computes its last token attends to c keys, so the pairs are the sum of the contexts (the
    same integer ``StepShape.attention_pairs`` adds up one sequence at a time)."""

    pairs: int = 0

    def attention_pairs(self) -> int:
        return self.pairs


class Progress(NamedTuple):
    """What one ``MacroStep.advance`` means for the replica: steps ``started[0]+1 .. started[1]``
    began (their busy time and FLOPs count now) and ``sampled`` decode tokens were generated."""

    started: tuple[int, int]
    sampled: int


class MacroStep:
    """k planned decode steps of one replica (see the module docstring); steps are numbered from
    1."""

    def __init__(self, seqs: list[Sequence], finish: list[int], start: float,
                 computed0: list[int] | None = None) -> None:
        """``computed0``: the sequences' computed tokens now, if the caller has them at hand (else
        read here)."""
        self.seqs, self.finish_step, self.start = seqs, finish, start
        self.computed0 = (
            computed0 if computed0 is not None else [s.num_computed_tokens for s in seqs]
        )  # before step 1
        # a decoding sequence has one token left to compute
        self.length0 = [c + 1 for c in self.computed0]
        self.k = 0
        self.sizes: list[int] = []  # sizes[i - 1]: sequences in step i
        # context_sums[i - 1]: their contexts after step i, summed
        self.context_sums: list[int] = []
        # step i's shape, where the cost model needs it (else None)
        self.shapes: list[DecodeShape | None] = []
        self.seconds: list[float] = []
        self.ends: list[float] = []  # ends[i - 1]: end time of step i
        # step -> positions in seqs that take a new block at its start
        self.allocs: dict[int, list[int]] = {}
        # step -> (position, block full, finished)
        self.retire: dict[int, list[tuple[int, bool, bool]]] = {}
        self.sampled: list[int] = [0]  # sampled[i]: tokens sampled by steps 1..i
        self.finished: list[int] = [0]  # finished[i]: sequences finished by steps 1..i
        self.event_steps: list[int] = []  # steps with an entry in allocs or retire, in order
        self.next_event = 0  # event_steps[:next_event] are fully applied
        self.scheduled = 0  # steps whose start (blocks, busy time) is applied
        self.completed = 0  # steps whose end (prefix cache, finishes, load counters) is applied
        # steps whose tokens the simulator has handed out (it may lag ``completed``)
        self.emitted = 0
        self.version = 0  # bumped by ``cut``: the queued end event of an older version is void

    def _ended(self, now: float) -> int:
        return bisect.bisect_left(self.ends, now, hi=self.k)  # steps that ended before now

    def sampled_by(self, now: float) -> int:
        """Decode tokens that steps ended before ``now`` sampled and ``advance`` has not yet handed
        back."""
        return self.sampled[self._ended(now)] - self.sampled[self.completed]

    def finished_by(self, now: float) -> int:
        """Sequences that steps ended before ``now`` finished and ``advance`` has not yet
        retired."""
        return self.finished[self._ended(now)] - self.finished[self.completed]

    def advance(self, t: float, sched: Scheduler) -> Progress:
        """Apply every step that ended before ``t``, and the start of the one in flight at ``t``, to
        ``sched`` and the planned sequences; returns what the replica's counters gain."""
        ended = self._ended(t)
        started = min(self.k, ended + 1)
        if started <= self.scheduled and ended <= self.completed:
            return Progress((self.scheduled, self.scheduled), 0)
        progress = Progress(
            (self.scheduled, started), self.sampled[ended] - self.sampled[self.completed]
        )
        bm = sched.block_manager
        steps = self.event_steps
        while self.next_event < len(steps) and steps[self.next_event] <= started:
            i = steps[self.next_event]
            if i > self.scheduled:  # its start: the blocks it adds, in the scheduler's order
                for j in self.allocs.get(i, ()):
                    self._set(j, self.seqs[j], i - 1)
                    copies = bm.may_append(self.seqs[j], 1)
                    assert not copies, "a planned decode step never copies on write"
            if i > ended:
                break  # in flight at t: its end comes later
            # its end: full blocks cached, sequences done
            for j, full, finished in self.retire.get(i, ()):
                seq = self.seqs[j]
                self._set(j, seq, i)
                if full:
                    bm.cache_full_blocks(seq)
                if finished:
                    sched.finish_running(seq, "length", self.ends[i - 1])
            self.next_event += 1
        self.scheduled, self.completed = started, ended
        if ended == self.k:  # in between, a sequence is brought up to date when an event touches it
            self._set_all(ended)
        return progress

    def cut(self) -> bool:
        """End the plan with the step in flight (call after ``advance``); True if that shortened
        it."""
        if self.scheduled >= self.k:
            return False
        self.k = max(self.scheduled, 1)
        self.version += 1
        return True

    def _set_all(self, steps: int) -> None:
        """``_set`` for every sequence of the plan (one loop, as the plan ends)."""
        for seq, computed, length, last in zip(self.seqs, self.computed0, self.length0,
                                               self.finish_step, strict=True):
            if steps < last:
                last = steps
            seq.num_computed_tokens = computed + last
            missing = length + last - len(seq.token_ids)
            if missing > 0:
                seq.token_ids.extend([PLACEHOLDER_TOKEN] * missing)

    def _set(self, j: int, seq: Sequence, steps: int) -> None:
        """Put sequence ``j`` in its state after ``steps`` of the planned steps (it takes part until
        it finishes)."""
        if steps > self.finish_step[j]:
            steps = self.finish_step[j]
        seq.num_computed_tokens = self.computed0[j] + steps
        missing = self.length0[j] + steps - len(seq.token_ids)
        if missing > 0:
            seq.token_ids.extend([PLACEHOLDER_TOKEN] * missing)


def static_order(policy: Policy) -> bool:
    """Whether the policy's order of running sequences cannot change while they decode (FCFS
    keys)."""
    return type(policy) in (FCFS, Policy)


def plan_macro(sched: Scheduler, cost: Callable[[StepShape], float], now: float,
               cap: int) -> MacroStep | None:
    """Up to ``cap`` decode steps of the replica whose scheduler is ``sched`` and step cost model
    ``cost``, from
    ``now``, as one macro step, or None if fewer than 2 qualify."""
    if cap < 2 or sched.waiting or not sched.running or not static_order(sched.policy):
        return None
    bm, limit, key = sched.block_manager, sched.config.max_model_len, sched.policy.key
    bs, prefix_cache, ref_count, cached = (
        bm.block_size,
        bm.enable_prefix_cache,
        bm.ref_count,
        bm.block_key,
    )
    seqs = sorted(sched.running, key=lambda s: key(s, now))
    finish, computed0 = [], []
    for s in seqs:
        computed, length = s.num_computed_tokens, len(s.token_ids)
        computed0.append(computed)
        if (
            length - computed != 1
            or s.first_token_time is None
            or s.eos_token_id == PLACEHOLDER_TOKEN
            or PLACEHOLDER_TOKEN in s.stop_token_ids
        ):
            return None
        index = computed // bs
        if prefix_cache and len(s.block_keys) != index:
            return None
        if index < len(s.block_table):
            block = s.block_table[index]
            if ref_count[block] > 1 or cached[block] is not None:
                return None
        # the step that samples this many more finishes it
        left = s.max_tokens - (length - len(s.prompt_token_ids))
        if limit is not None and limit - length < left:
            left = limit - length
        finish.append(left)
    k = min(cap, max(finish))
    # new blocks: sequence j writes position computed + i - 1 in step i; it takes a block when that
    # is past its table
    allocs = []
    for j, s in enumerate(seqs):
        first = len(s.block_table) * bs - computed0[j] + 1
        last = finish[j] if finish[j] < k else k
        if first <= last:
            allocs += [(i, j) for i in range(first, last + 1, bs)]
    allocs.sort()
    if len(allocs) > bm.num_free_blocks:
        # the step that would run out of blocks (and preempt)
        k = min(k, allocs[bm.num_free_blocks][0] - 1)
    if k < 2:
        return None
    p = MacroStep(seqs, [f if f <= k else NEVER for f in finish], now, computed0)
    # price each step: by the shape's sums where the cost model can (the same number, without the
    # shape)
    seconds_of = getattr(cost, "seconds_of", None)
    t, running, finish_steps = now, p.computed0, set(finish)
    n, base = len(running), sum(running)
    for i in range(1, k + 1):
        if i - 1 in finish_steps:  # someone finished in the step before: the batch shrinks
            running = [c for c, f in zip(p.computed0, finish, strict=True) if f >= i]
            n, base = len(running), sum(running)
        if not n:
            break
        # a sequence that had c tokens computed attends to c + i keys in step i
        context_sum = base + i * n
        if seconds_of is not None:
            shape = None
            seconds = seconds_of(n, context_sum, n, context_sum - n)
        else:
            context = tuple(c + i for c in running)
            shape = DecodeShape(new_tokens=(1,) * n, context_lens=context, num_sampled=n,
                                pairs=context_sum)
            seconds = cost(shape)
        if not seconds > 0:
            break
        t += seconds
        p.sizes.append(n)
        p.context_sums.append(context_sum)
        p.shapes.append(shape)
        p.seconds.append(seconds)
        p.ends.append(t)
    p.k = len(p.ends)
    if p.k < 2:
        return None
    p.finish_step = [f if f <= p.k else NEVER for f in finish]
    for i, j in allocs:
        if i <= p.k:
            p.allocs.setdefault(i, []).append(j)
    for j, c in enumerate(p.computed0):  # j ascending: each step's list is in the scheduler's order
        last = min(p.k, p.finish_step[j])
        for i in range(bs - c % bs, last + 1, bs):
            p.retire.setdefault(i, []).append((j, True, i == last == p.finish_step[j]))
        if last == p.finish_step[j] and (c + last) % bs:
            p.retire.setdefault(last, []).append((j, False, True))
    p.event_steps = sorted(p.allocs.keys() | p.retire.keys())
    p.sampled = [0, *accumulate(p.sizes)]
    done = [0] * (p.k + 1)
    for f in p.finish_step:
        if f <= p.k:
            done[f] += 1
    p.finished = list(accumulate(done))
    return p
