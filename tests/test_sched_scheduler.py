"""The continuous batcher: budgets, chunked prefill, admission, preemption, finishing, abort, errors."""

from __future__ import annotations

import pytest

from reference.kv import BlockManager, check_block_manager
from reference.sched import (
    ConfigError,
    RequestError,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    Sequence,
    SequenceStatus,
    Static,
    Tenants,
    UnknownTenantError,
)
from tests.fake_plane import FakeKV, fake_token, run_step


def make(num_blocks=64, block_size=4, budget=16, max_seqs=4, policy=None, prefix=True, **kw):
    bm = BlockManager(num_blocks, block_size, enable_prefix_cache=prefix)
    sched = Scheduler(bm, SchedulerConfig(budget, max_seqs, **kw), policy=policy)
    return sched, FakeKV(num_blocks, block_size)


def drain(sched, kv, max_steps=10_000, seed=0):
    t, batches = 0.0, []
    while sched.has_unfinished():
        t += 1.0
        batch, _ = run_step(sched, kv, t, seed)
        batches.append(batch)
        check_block_manager(sched.block_manager, sched.running)
        assert len(batches) < max_steps, "did not finish"
    return batches


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=0), dict(max_num_seqs=0),
                                dict(max_num_batched_tokens=4, max_num_seqs=8), dict(max_model_len=0),
                                dict(max_num_seqs=True)])
def test_invalid_config_is_a_clear_error(kw):
    with pytest.raises(ConfigError):
        SchedulerConfig(**kw)


def test_bad_requests_are_rejected_and_change_nothing():
    sched, _ = make(num_blocks=8, block_size=4, max_model_len=20, policy=None)
    with pytest.raises(RequestError, match="empty prompt"):
        Sequence([])
    with pytest.raises(RequestError, match="max_tokens"):
        Sequence([1], max_tokens=0)
    with pytest.raises(RequestError, match="context"):
        sched.add(Sequence(list(range(20)), max_tokens=1))
    sched2, _ = make(num_blocks=2, block_size=4)
    with pytest.raises(RequestError, match="KV blocks"):
        sched2.add(Sequence(list(range(8)), max_tokens=1))
    strict = Scheduler(BlockManager(8, 4), tenants=Tenants({"acme": "paid"}))
    with pytest.raises(UnknownTenantError, match="mallory"):
        strict.add(Sequence([1, 2], tenant="mallory"))
    assert not sched.has_unfinished() and not sched2.has_unfinished() and not strict.has_unfinished()


def test_fcfs_run_finishes_everything_with_chunked_prefill():
    sched, kv = make(budget=8, max_seqs=3)
    seqs = [Sequence(list(range(1, 1 + n)), max_tokens=m, arrival_time=0.0) for n, m in [(20, 3), (5, 6), (9, 1)]]
    for s in seqs:
        sched.add(s)
    batches = drain(sched, kv)
    assert all(s.status is SequenceStatus.FINISHED and s.num_output_tokens == s.max_tokens for s in seqs)
    assert all(b.num_batched_tokens <= 8 and len(b) <= 3 for b in batches)
    first = batches[0].entries  # the 20-token prompt arrived first: it takes the whole first budget
    assert [(e.seq, e.start, e.num_new_tokens, e.needs_sample) for e in first] == [(seqs[0], 0, 8, False)]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_decodes_go_before_prefill_chunks():
    sched, kv = make(budget=4, max_seqs=4)
    a = Sequence([1, 2, 3], max_tokens=5, arrival_time=0.0)
    sched.add(a)
    run_step(sched, kv, 1.0)  # a's prefill, samples its first token
    b = Sequence(list(range(10, 30)), max_tokens=2, arrival_time=1.0)
    sched.add(b)
    batch, _ = run_step(sched, kv, 2.0)
    assert [(e.seq, e.num_new_tokens, e.is_prefill) for e in batch.entries] == [(a, 1, False), (b, 3, True)]


def test_prompt_tokens_beside_decodes_are_capped_but_an_idle_step_takes_the_budget():
    sched, kv = make(budget=16, max_seqs=4, max_prefill_tokens_with_decodes=3)
    a = Sequence(list(range(1, 11)), max_tokens=6, arrival_time=0.0)
    sched.add(a)
    first, _ = run_step(sched, kv, 1.0)  # no decodes yet: the whole 10-token prompt in one step
    assert [(e.seq, e.num_new_tokens) for e in first.entries] == [(a, 10)]
    b, c = (Sequence(list(range(20 + 10 * i, 27 + 10 * i)), max_tokens=2, arrival_time=1.0) for i in range(2))
    sched.add(b)
    sched.add(c)
    second, _ = run_step(sched, kv, 2.0)  # a decodes: the new prompts share 3 tokens (b first, FCFS)
    assert [(e.seq, e.num_new_tokens, e.is_prefill) for e in second.entries] == [(a, 1, False), (b, 3, True)]
    third, _ = run_step(sched, kv, 3.0)
    assert [(e.seq, e.num_new_tokens) for e in third.entries] == [(a, 1), (b, 3)]
    fourth, _ = run_step(sched, kv, 4.0)  # b's last prompt token is one uncomputed token: a decode's share
    assert [(e.seq, e.num_new_tokens, e.is_prefill) for e in fourth.entries] == [(a, 1, False), (b, 1, False),
                                                                                 (c, 3, True)]
    drain(sched, kv)
    assert all(s.status is SequenceStatus.FINISHED and s.num_output_tokens == s.max_tokens for s in (a, b, c))
    with pytest.raises(ConfigError, match="max_prefill_tokens_with_decodes"):
        SchedulerConfig(16, 4, max_prefill_tokens_with_decodes=0)


def test_decode_stall_budget_shrinks_the_prompt_chunk_with_the_decodes_waiting():
    """decode_stall_budget S: a step with d decodes takes at most max(1, S // d) prompt tokens, and no more than
    max_prefill_tokens_with_decodes; a step without decodes takes the whole budget."""
    sched, kv = make(budget=32, max_seqs=8, decode_stall_budget=8)
    a = Sequence(list(range(1, 11)), max_tokens=20, arrival_time=0.0)
    sched.add(a)
    first, _ = run_step(sched, kv, 1.0)  # idle: the whole prompt
    assert [(e.seq, e.num_new_tokens) for e in first.entries] == [(a, 10)]
    b, c, d = (Sequence(list(range(20 + 10 * i, 29 + 10 * i)), max_tokens=20, arrival_time=1.0) for i in range(3))
    for s in (b, c, d):
        sched.add(s)
    second, _ = run_step(sched, kv, 2.0)  # one decode: 8 prompt tokens
    assert [(e.seq, e.num_new_tokens, e.is_prefill) for e in second.entries] == [(a, 1, False), (b, 8, True)]
    third, _ = run_step(sched, kv, 3.0)  # b's last token is a decode now: two decodes, 8 // 2 = 4 prompt tokens
    assert [(e.seq, e.num_new_tokens, e.is_prefill) for e in third.entries] == [(a, 1, False), (b, 1, False),
                                                                                (c, 4, True)]
    assert sched.prefill_cap(0) is None and sched.prefill_cap(3) == 2 and sched.prefill_cap(9) == 1
    drain(sched, kv)
    assert all(s.status is SequenceStatus.FINISHED and s.num_output_tokens == s.max_tokens for s in (a, b, c, d))
    both, _ = make(budget=32, max_seqs=8, decode_stall_budget=64, max_prefill_tokens_with_decodes=5)
    assert (both.prefill_cap(1), both.prefill_cap(16), both.prefill_cap(0)) == (5, 4, None)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="decode_stall_budget"):
            SchedulerConfig(16, 4, decode_stall_budget=bad)


def test_outputs_follow_the_model_and_stop_ids_finish():
    sched, kv = make()
    seq = Sequence([5, 6, 7], max_tokens=50, arrival_time=0.0)
    stop = fake_token(0, seq.seq_id, 3 + 4)  # the 5th output token
    seq.stop_token_ids = (stop,)
    sched.add(seq)
    drain(sched, kv)
    expected = [fake_token(0, seq.seq_id, p) for p in range(3, 3 + 50)]
    cut = expected.index(stop) + 1
    assert seq.output_token_ids == expected[:cut] and seq.finish_reason == "stop"


def test_max_model_len_finishes_with_length():
    sched, kv = make(max_model_len=10)
    seq = Sequence([1] * 7, max_tokens=100, arrival_time=0.0)
    sched.add(seq)
    drain(sched, kv)
    assert seq.num_tokens == 10 and seq.finish_reason == "length"


def test_preemption_by_recompute_loses_no_tokens():
    # 10 blocks of 4 slots; three sequences that each grow to 16 tokens (4 blocks) cannot all fit
    sched, kv = make(num_blocks=10, block_size=4, budget=8, max_seqs=3, prefix=False)
    seqs = [Sequence([i + 1] * 6, max_tokens=10, arrival_time=float(i)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batches = drain(sched, kv)
    assert sum(len(b.preempted) for b in batches) > 0, "the test must force a preemption"
    for s in seqs:
        assert s.output_token_ids == [fake_token(0, s.seq_id, p) for p in range(6, 16)]
    assert sched.block_manager.num_free_blocks == 10


def test_abort_frees_everything_and_is_skipped_in_postprocess():
    sched, kv = make(num_blocks=16)
    a, b = Sequence([1] * 9, max_tokens=5), Sequence([2] * 9, max_tokens=5)
    sched.add(a, 0.0)
    sched.add(b, 0.0)
    batch = sched.schedule(1.0)
    assert sched.abort(a.seq_id) is a and a.status is SequenceStatus.ABORTED and a.block_table == []
    sched.postprocess(batch, [1 if e.needs_sample else None for e in batch.entries], 1.0)
    assert a.num_computed_tokens == 0 and b.num_computed_tokens > 0
    assert sched.abort(a.seq_id) is None
    sched.abort(b.seq_id)
    assert not sched.has_unfinished()
    check_block_manager(sched.block_manager, [])
    assert sched.block_manager.num_free_blocks == 16


def test_schedule_twice_without_postprocess_is_an_error():
    sched, _ = make()
    sched.add(Sequence([1, 2, 3]), 0.0)
    batch = sched.schedule(1.0)
    with pytest.raises(SchedulerError, match="postprocess"):
        sched.schedule(2.0)
    with pytest.raises(SchedulerError, match="tokens for a batch"):
        sched.postprocess(batch, [], 1.0)
    with pytest.raises(SchedulerError, match="int >= 0"):
        sched.postprocess(batch, [-1], 1.0)
    assert batch.entries[0].seq.num_computed_tokens == 0  # a rejected postprocess changes nothing
    sched.postprocess(batch, [7], 1.0)


def test_context_limit_does_not_inflate_the_block_check():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=1000)  # 16 slots, context 1000
    sched.add(Sequence([1] * 6, max_tokens=10), 0.0)  # 16 tokens at most: fits
    with pytest.raises(RequestError, match="KV blocks"):
        sched.add(Sequence([1] * 6, max_tokens=11), 0.0)


def test_static_batching_admits_only_into_an_empty_system():
    sched, kv = make(budget=8, max_seqs=2, policy=Static())
    first = [Sequence([1, 2], max_tokens=m, arrival_time=0.0) for m in (2, 6)]
    for s in first:
        sched.add(s)
    late = Sequence([3, 4], max_tokens=2, arrival_time=0.5)
    sched.add(late)
    t = 0.0
    while first[1].status is not SequenceStatus.FINISHED:
        t += 1
        run_step(sched, kv, t)
        assert late.status is SequenceStatus.WAITING  # a slot is free after first[0] ends, yet no refill
    drain(sched, kv)
    assert late.status is SequenceStatus.FINISHED


def test_prefix_cache_hits_across_requests_and_salts_isolate():
    sched, kv = make(num_blocks=32, block_size=4)
    system = list(range(100, 112))  # 3 full blocks
    a = Sequence(system + [1, 2], max_tokens=2)
    sched.add(a, 0.0)
    drain(sched, kv)
    b = Sequence(system + [3], max_tokens=2)
    c = Sequence(system + [3], max_tokens=2, cache_salt="other-tenant")
    for s in (b, c):
        sched.add(s, 10.0)
    drain(sched, kv)
    assert b.num_cached_tokens == 12 and c.num_cached_tokens == 0
