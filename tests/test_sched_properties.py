"""Stateful property test of the batcher under random arrivals, aborts and policies, with a fake model.

Properties, checked after every step: no step exceeds its token budget or sequence limit (nor, when the
step carries d decodes, its cap on prompt tokens: ``max_prefill_tokens_with_decodes`` and
``max(1, decode_stall_budget // d)``); no running decode is skipped (each is in the step unless
preempted in it); every
entry reads back the right cached context from the fake plane (so preemption, prefix sharing and
copy-on-write never lose or mix tokens); the block-manager audit passes; waiting requests hold no
blocks. At the end, with arrivals stopped: every admitted request finishes (or was aborted) within a
bounded number of steps, its output is exactly the fake model's tokens, and every block is free or
evictable again. And, beside it: under the decode stall budget a prompt arriving beside long-running
decodes is prefilled at least one token a step (no starvation) while every decode advances every step.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from reference.kv import BlockManager, check_block_manager
from reference.sched import Scheduler, SchedulerConfig, Sequence, SequenceStatus, Tenants, make_policy
from tests.fake_plane import FakeKV, fake_token, run_step

TENANTS = Tenants({"paid-1": "paid", "free-1": "free", "free-2": "free"})
POLICIES = ["fcfs", "sjf", "wfq", "sjf+wfq", "static"]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 30), block_size=st.integers(1, 4), budget=st.integers(1, 12),
                max_seqs=st.integers(1, 6), prefix=st.booleans(), policy=st.sampled_from(POLICIES),
                max_model_len=st.sampled_from([None, 12, 24]), cap=st.none() | st.integers(1, 12),
                stall=st.none() | st.integers(1, 24))
    def setup(self, num_blocks, block_size, budget, max_seqs, prefix, policy, max_model_len, cap, stall):
        max_seqs = min(max_seqs, budget)
        self.config = SchedulerConfig(budget, max_seqs, max_model_len, max_prefill_tokens_with_decodes=cap,
                                      decode_stall_budget=stall)
        bm = BlockManager(num_blocks, block_size, enable_prefix_cache=prefix)
        self.sched = Scheduler(bm, self.config, make_policy(policy, TENANTS, aging=0.5))
        self.kv = FakeKV(num_blocks, block_size)
        self.now = 0.0
        self.added: list[Sequence] = []

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=16), max_tokens=st.integers(1, 10),
          tenant=st.sampled_from(sorted(TENANTS.plan_of)), predicted=st.none() | st.integers(0, 12),
          eos=st.none() | st.integers(0, 49))
    def arrive(self, prompt, max_tokens, tenant, predicted, eos):
        seq = Sequence(prompt, max_tokens=max_tokens, tenant=tenant, predicted_output_len=predicted,
                       eos_token_id=eos, cache_salt=tenant if tenant.startswith("paid") else None,
                       seq_id=len(self.added))  # ids from the test case, so runs replay exactly
        try:
            self.sched.add(seq, self.now)
        except ValueError:
            self.added.append(None)  # too long for this cache / context: rejected, nothing changed
            return
        self.added.append(seq)

    @rule(n=st.integers(2, 6), prompt_len=st.integers(1, 12), max_tokens=st.integers(4, 12))
    def burst(self, n, prompt_len, max_tokens):
        """Several similar requests at once: memory pressure, preemption, shared prefixes."""
        for i in range(n):
            self.arrive([i % 2] * prompt_len, max_tokens, "free-1" if i % 3 else "paid-1", None, None)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule()
    def step(self):
        self._step()

    def _step(self):
        self.now += 1.0
        decoding = [s for s in self.sched.running if s.num_uncomputed_tokens == 1]
        batch, _ = run_step(self.sched, self.kv, self.now)
        scheduled = {id(e.seq) for e in batch.entries} | {id(s) for s in batch.preempted}
        assert all(id(s) in scheduled for s in decoding), "a running decode was skipped"
        assert batch.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(batch) <= self.config.max_num_seqs
        assert len(self.sched.running) <= self.config.max_num_seqs
        assert len({id(e.seq) for e in batch.entries}) == len(batch)
        assert not set(map(id, batch.preempted)) & {id(e.seq) for e in batch.entries}
        cap = self.config.max_prefill_tokens_with_decodes
        if cap is not None and not all(e.is_prefill for e in batch.entries):
            assert batch.num_prefill_tokens <= cap  # a step with decodes takes at most the cap in prompt tokens
            event("prefill capped by decodes" if batch.num_prefill_tokens == cap else "decodes under the cap")
        num_decodes = sum(not e.is_prefill for e in batch.entries)
        stall = self.config.decode_stall_budget
        if stall is not None and num_decodes:
            room = max(1, stall // num_decodes)
            assert batch.num_prefill_tokens <= room  # the stall budget's share of a step with d decodes
            event("prefill at the stall budget's share" if batch.num_prefill_tokens == room else "under the share")
        for what, happened in [("preemption", batch.preempted), ("block copy", batch.block_copies),
                               ("prefix hit", any(e.seq.num_cached_tokens for e in batch.entries))]:
            if happened:
                event(what)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.sched.running + self.sched.waiting))
        assert self.sched.abort(seq.seq_id, self.now) is seq
        assert seq.block_table == [] and seq.status is SequenceStatus.ABORTED

    @invariant()
    def consistent(self):
        if not hasattr(self, "sched"):
            return
        check_block_manager(self.sched.block_manager, self.sched.running)
        assert all(not s.block_table and s.num_computed_tokens == 0 for s in self.sched.waiting)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # A bound on the steps left that grows with the work left: every unfinished sequence may have to
        # recompute all its tokens once per other sequence (preemption by recompute), at `budget` tokens a
        # step. A livelock exceeds any such bound; a long but progressing drain (budget 1) does not.
        left = [s for s in self.sched.running + self.sched.waiting]
        work = sum(s.num_prompt_tokens + s.max_tokens for s in left)
        # (under a stall budget a step may take as little as one prompt token beside its decodes)
        per_step = 1 if self.config.decode_stall_budget is not None else self.config.max_num_batched_tokens
        limit = 100 + work * (len(left) + 1) // per_step
        steps = 0
        while self.sched.has_unfinished():
            self._step()
            steps += 1
            assert steps < limit, f"requests did not finish in {limit} steps ({len(left)} left, {work} tokens)"
        bm = self.sched.block_manager
        check_block_manager(bm, [])
        assert bm.num_free_blocks == bm.num_blocks
        for seq in filter(None, self.added):
            assert seq.is_finished
            if seq.status is SequenceStatus.FINISHED:
                want = [fake_token(0, seq.seq_id, p) for p in range(seq.num_prompt_tokens, seq.num_tokens)]
                assert seq.output_token_ids == want
                assert seq.num_output_tokens <= seq.max_tokens


TestSchedulerMachine = SchedulerMachine.TestCase


@settings(deadline=None)
@given(stall=st.integers(1, 40), num_decodes=st.integers(1, 6), prompt_len=st.integers(2, 40),
       chunk_cap=st.none() | st.integers(1, 8), policy=st.sampled_from(["fcfs", "sjf", "sjf+wfq"]),
       arrivals=st.lists(st.integers(1, 30), max_size=4))
def test_stall_budget_starves_no_prompt_and_skips_no_decode(stall, num_decodes, prompt_len, chunk_cap, policy,
                                                             arrivals):
    """Decodes that outlast the test keep every step busy; a prompt that arrives beside them (and more prompts
    after it) still gets at least one prompt token a step, so its first token comes within prompt_len steps
    (FCFS, or ahead of later arrivals that are no shorter); and every decode emits a token every step."""
    budget, max_seqs = 64, num_decodes + 1 + len(arrivals)
    config = SchedulerConfig(budget, max_seqs, decode_stall_budget=stall, max_prefill_tokens_with_decodes=chunk_cap)
    sched = Scheduler(BlockManager(200, 4, enable_prefix_cache=False), config, make_policy(policy, TENANTS))
    kv = FakeKV(200, 4)
    streams = [Sequence([7, 8], max_tokens=500, tenant="free-1", seq_id=i) for i in range(num_decodes)]
    for s in streams:
        sched.add(s, 0.0)
    run_step(sched, kv, 1.0)  # their prompts: every one decodes from now on
    late = Sequence(list(range(prompt_len)), max_tokens=3, tenant="free-1", seq_id=100)
    sched.add(late, 1.0)
    later = [Sequence([1] * n, max_tokens=3, tenant="free-1", seq_id=200 + i) for i, n in enumerate(arrivals)]
    for step in range(1, prompt_len + 1):
        outputs = [s.num_output_tokens for s in streams]
        if step <= len(later):
            sched.add(later[step - 1], 1.0 + step)
        batch, _ = run_step(sched, kv, 1.0 + step)
        num_decodes_now = sum(not e.is_prefill for e in batch.entries)
        assert batch.num_prefill_tokens <= max(1, stall // num_decodes_now)
        assert batch.num_prefill_tokens >= 1 or late.first_token_time is not None  # progress every step
        assert [s.num_output_tokens for s in streams] == [n + 1 for n in outputs]  # no decode skipped
        if late.first_token_time is not None:
            break
    if policy == "fcfs" or all(n >= prompt_len for n in arrivals):
        assert late.first_token_time is not None, f"a {prompt_len}-token prompt waited {prompt_len} steps"
