"""The continuous batcher: every step, which tokens of which sequences to compute.

Each step has a token budget (``max_num_batched_tokens``) and a sequence limit (``max_num_seqs``):

1. Running sequences that are decoding (one uncomputed token: the one sampled last step) go first,
   most urgent first by the policy's key. Then running sequences still in their prefill get the
   rest of the budget in chunks.
2. If a running sequence needs a new block and none is free, the least urgent running sequence not
   yet scheduled in this step is preempted by recompute: its blocks are freed, it goes back to the
   waiting queue, and its tokens (prompt and outputs so far) are computed again once readmitted.
3. Then waiting sequences are admitted, best key first, while the budget lasts, fewer than
   ``max_num_seqs`` run, and ``BlockManager.can_allocate`` says their blocks fit. Admission is
   strict: if the best waiting sequence does not fit, nobody behind it is admitted this step; and
   nothing is admitted in a step that preempted. An admitted sequence gets blocks for all its
   tokens at once (reusing its cached prefix) and a first prefill chunk as large as the remaining
   budget allows.
4. Optionally (``SchedulerConfig.max_prefill_tokens_with_decodes``), a step that carries decodes
   takes at most that many prompt tokens in all (steps 1 and 3), so that a new prompt delays the
   running streams by a bounded amount; a step without decodes uses the whole budget for prompts.
   ``SchedulerConfig.decode_stall_budget`` S is such a cap that shrinks with the decodes d in the
   step: at most max(1, S // d) prompt tokens (a burst's late arrivals stall few streams by much, or
   many streams by little; never no prompt token at all, so nothing waiting starves).

Use: ``add(seq)``; loop ``batch = schedule(now)``; run the model on ``batch``; ``postprocess(batch,
token_ids, now)``. ``abort(seq_id)`` frees everything of a request at any time between steps.
``add_running(seq)`` admits a sequence whose prompt K/V were computed elsewhere (a prefill worker).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from reference.kv.block_manager import BlockManager
from reference.sched.batch import Batch, ScheduledSeq, SchedulerConfig
from reference.sched.errors import RequestError, SchedulerError
from reference.sched.policy import FCFS, Policy
from reference.sched.sequence import Sequence, SequenceStatus
from reference.sched.tenants import Tenants


class Scheduler:
    """Continuous batching over a paged KV cache, with a pluggable policy."""

    def __init__(self, block_manager: BlockManager, config: SchedulerConfig | None = None,
                 policy: Policy | None = None, tenants: Tenants | None = None) -> None:
        self.block_manager = block_manager
        self.config = config or SchedulerConfig()
        self.policy = policy or FCFS()
        self.tenants = tenants if tenants is not None else getattr(self.policy, "tenants", None)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._in_flight: Batch | None = None  # scheduled, not yet postprocessed

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence, now: float | None = None) -> None:
        """Queue a new request. Raises RequestError / UnknownTenantError; then nothing has
        changed."""
        self.check(seq)
        self.policy.on_add(seq)
        if seq.arrival_time is None:
            seq.arrival_time = time.monotonic() if now is None else now
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """Raise what ``add`` would raise for ``seq``, changing nothing (to check many before adding
        any)."""
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise RequestError(f"sequence {seq.seq_id} was already scheduled; add a new Sequence")
        limit = self.config.max_model_len
        if limit is not None and seq.num_prompt_tokens >= limit:
            raise RequestError(f"prompt of {seq.num_prompt_tokens} tokens does not fit the context "
                               f"of {limit} "
                               "tokens (at least one output token must fit)")
        max_len = seq.num_prompt_tokens + seq.max_tokens if limit is None else min(
            seq.num_prompt_tokens + seq.max_tokens, limit)
        bm = self.block_manager
        if bm.blocks_for(max_len) > bm.num_blocks:
            raise RequestError(f"a request of up to {max_len} tokens needs "
                               f"{bm.blocks_for(max_len)} KV blocks; "
                               f"the cache has {bm.num_blocks}")
        if self.tenants is not None:
            self.tenants.plan(seq.tenant)

    def add_running(self, seq: Sequence, now: float | None = None) -> None:
        """Admit a sequence whose blocks, and the K/V of its first ``num_computed_tokens`` tokens,
        are already in this scheduler's cache: its prompt was computed elsewhere (a prefill worker)
        and handed over. The caller allocated its blocks with this block manager. It runs from the
        next step: a decode if only the last token is uncomputed, else a prefill of the rest.
        """
        if seq.status is not SequenceStatus.WAITING or not seq.block_table:
            raise RequestError(f"sequence {seq.seq_id} must be waiting and hold its blocks to be "
                               "added running")
        if not 0 <= seq.num_computed_tokens < seq.num_tokens:
            raise RequestError(f"sequence {seq.seq_id}: {seq.num_computed_tokens} computed tokens "
                               "of "
                               f"{seq.num_tokens}; at least the last token must be left to compute")
        if self.block_manager.blocks_for(seq.num_computed_tokens) > len(seq.block_table):
            raise RequestError(f"sequence {seq.seq_id}: its block table does not cover its "
                               "computed tokens")
        if self.tenants is not None:
            self.tenants.plan(seq.tenant)
        self.policy.on_add(seq)
        now = time.monotonic() if now is None else now
        if seq.arrival_time is None:
            seq.arrival_time = now
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def schedule(self, now: float | None = None) -> Batch:
        """Choose this step's work (see the module docstring). Call ``postprocess`` with its
        result."""
        if self._in_flight is not None:
            raise SchedulerError("schedule() called again before postprocess() of the previous "
                                 "batch")
        now = time.monotonic() if now is None else now
        batch, budget = Batch(now=now), self.config.max_num_batched_tokens
        key, bm = self.policy.key, self.block_manager
        # 1. running sequences: decodes first, then prefill chunks; preempt when blocks run out
        ordered = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, key(s, now)))
        unscheduled = list(ordered)
        for seq in ordered:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            uncomputed = seq.num_uncomputed_tokens
            is_prefill = uncomputed > 1
            n = min(uncomputed, self._prefill_room(batch, budget) if is_prefill else budget)
            if n == 0:
                # decodes come first: every sequence left is a prefill, and the cap is reached
                break
            while not bm.can_append(seq, n):
                victim = max(unscheduled, key=lambda s: key(s, now))
                self._preempt(victim, batch)
                unscheduled.remove(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                unscheduled.remove(seq)
                budget -= self._schedule_one(seq, n, is_prefill, batch)
        # 2. admissions (static batching: only into an empty system, then not until it is empty
        # again);
        # none in a step that had to preempt: memory is short, and a victim must not come straight
        # back
        admit = (self.policy.admit_while_running or not self.running) and not batch.preempted
        while admit and self.waiting and len(self.running) < self.config.max_num_seqs:
            room = self._prefill_room(batch, budget)
            if room == 0 and self.policy.admit_while_running:
                break
            seq = self.policy.pick(self.waiting, now)
            keep_free = (
                int(self.config.watermark * self.block_manager.num_blocks) if self.running else 0
            )
            if not self.block_manager.can_allocate(seq, keep_free):
                break
            self.block_manager.allocate(seq)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.remove(seq)
            self.running.append(seq)
            if room > 0:
                budget -= self._schedule_one(seq, min(seq.num_uncomputed_tokens, room), True, batch)
        if batch.entries:
            self._in_flight = batch
        return batch

    def postprocess(self, batch: Batch, new_token_ids: Seq[int | None],
                    now: float | None = None) -> list[Sequence]:
        """Record a step's results; returns the sequences that finished in it.

        ``new_token_ids[i]`` is the token sampled for ``batch.entries[i]``; it is read only where
        ``entries[i].needs_sample`` is true (pass None elsewhere). Sequences aborted since
        ``schedule`` are skipped.
        """
        if not batch.entries:
            return []
        if batch is not self._in_flight:
            raise SchedulerError("postprocess() needs the batch returned by the last schedule()")
        if len(new_token_ids) != len(batch.entries):
            raise SchedulerError(f"{len(new_token_ids)} tokens for a batch of {len(batch.entries)} "
                                 "entries")
        # check all before changing any
        for entry, token in zip(batch.entries, new_token_ids, strict=True):
            if entry.needs_sample and (
                isinstance(token, bool) or not isinstance(token, int) or token < 0
            ):
                raise SchedulerError(f"sequence {entry.seq.seq_id}: sampled token must be an int "
                                     f">= 0, got {token!r}")
        self._in_flight = None
        now = time.monotonic() if now is None else now
        finished, cache_full_blocks = [], self.block_manager.cache_full_blocks
        for entry, token in zip(batch.entries, new_token_ids, strict=True):
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += entry.num_new_tokens
            cache_full_blocks(seq)
            if not entry.needs_sample:
                continue
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, SequenceStatus.FINISHED, reason, now)
                finished.append(seq)
        return finished

    def abort(self, seq_id: int, now: float | None = None) -> Sequence | None:
        """Abort a live request and free its blocks; returns it, or None if no live request has that
        id."""
        for seq in (*self.running, *self.waiting):
            if seq.seq_id == seq_id:
                self._finish(seq, SequenceStatus.ABORTED, "abort",
                             time.monotonic() if now is None else now)
                return seq
        return None

    def finish_running(self, seq: Sequence, reason: str, now: float) -> None:
        """Retire a running sequence that its last sampled token ended (``reason``: "length" or
        "stop"), as
        ``postprocess`` does: for a driver that replays plain decode steps without scheduling each
        one (the cluster simulator's macro steps)."""
        if seq.status is not SequenceStatus.RUNNING or seq not in self.running:
            raise SchedulerError(f"sequence {seq.seq_id} is not running here")
        self._finish(seq, SequenceStatus.FINISHED, reason, now)

    # ---- internals
    # --------------------------------------------------------------------------------

    def _prefill_room(self, batch: Batch, budget: int) -> int:
        """Prompt tokens this step may still take: the budget left, and once the step carries a
        decode, no more than ``prefill_cap`` in all."""
        cap = self.prefill_cap(sum(not e.is_prefill for e in batch.entries))
        if cap is None:
            return budget
        return max(0, min(budget, cap - batch.num_prefill_tokens))

    def prefill_cap(self, num_decodes: int) -> int | None:
        """Most prompt tokens a step that carries ``num_decodes`` decodes may take (None: the
        budget's): ``max_prefill_tokens_with_decodes`` and ``max(1, decode_stall_budget //
        num_decodes)``, the smaller; none without decodes."""
        if num_decodes == 0:
            return None
        caps = [self.config.max_prefill_tokens_with_decodes]
        if self.config.decode_stall_budget is not None:
            caps.append(max(1, self.config.decode_stall_budget // num_decodes))
        caps = [c for c in caps if c is not None]
        return min(caps) if caps else None

    def _schedule_one(self, seq: Sequence, n: int, is_prefill: bool, batch: Batch) -> int:
        batch.block_copies += self.block_manager.may_append(seq, n)
        start = seq.num_computed_tokens
        batch.entries.append(ScheduledSeq(seq, start, n, seq.token_ids[start:start + n],
                                          list(seq.block_table),
                                          needs_sample=start + n == seq.num_tokens,
                                          is_prefill=is_prefill))
        self.policy.on_schedule(seq, n)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = batch.now
        return n

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.append(seq)
        batch.preempted.append(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token == seq.eos_token_id or token in seq.stop_token_ids:
            return "stop"
        limit = self.config.max_model_len
        if seq.num_output_tokens >= seq.max_tokens or (
            limit is not None and seq.num_tokens >= limit
        ):
            return "length"
        return None

    def _finish(self, seq: Sequence, status: SequenceStatus, reason: str, now: float) -> None:
        self.block_manager.free(seq)
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        seq.status, seq.finish_reason, seq.finish_time = status, reason, now
        self.policy.on_finish(seq)
