"""The contiguous baseline of E2 (first-fit arena) and the scheduler's admission watermark."""

from __future__ import annotations

from reference.kv import BlockManager, check_block_manager
from reference.kv.contiguous import ContiguousAllocator
from reference.sched import Scheduler, SchedulerConfig, Sequence
from tests.fake_plane import FakeKV, run_step


def test_first_fit_merges_holes_and_shows_external_fragmentation():
    arena = ContiguousAllocator(capacity=30, context=10, reserve="max_context")
    seqs = [Sequence([1]) for _ in range(3)]
    for s in seqs:
        arena.allocate(s)
    assert [s.block_table for s in seqs] == [[0], [10], [20]] and arena.num_free_blocks == 0
    arena.free(seqs[0])
    arena.free(seqs[2])
    assert arena.holes == [[0, 10], [20, 10]]
    big = ContiguousAllocator(30, 20, "max_context")
    big.holes = [[0, 10], [20, 10]]  # 20 slots free, none 20 long: external fragmentation
    assert not big.can_allocate(Sequence([1]))
    arena.free(seqs[1])
    assert arena.holes == [[0, 30]]


def test_reservation_rules_and_the_real_scheduler_finishes_everything():
    reqs = [(5, 3), (2, 7), (9, 1), (4, 4)]
    true_out = dict(enumerate(o for _, o in reqs))
    for rule, want in [("max_context", 16), ("request", 5 + 8), ("oracle", 5 + 3)]:
        arena = ContiguousAllocator(40, 16, rule, true_out)
        assert arena.reservation(Sequence([1] * 5, max_tokens=8, seq_id=0)) == want
        sched = Scheduler(arena, SchedulerConfig(16, 4, max_model_len=16))
        seqs = [Sequence([1] * p, max_tokens=8, seq_id=i, eos_token_id=0) for i, (p, _) in enumerate(reqs)]
        for s in seqs:
            sched.add(s, 0.0)
        t = 0
        while sched.has_unfinished():
            batch = sched.schedule(float(t))
            sched.postprocess(batch, [(0 if e.seq.num_output_tokens + 1 >= true_out[e.seq.seq_id] else 1)
                                      if e.needs_sample else None for e in batch.entries], float(t))
            assert not batch.preempted  # reservations never grow
            t += 1
        assert [s.num_output_tokens for s in seqs] == [o for _, o in reqs] and arena.holes == [[0, 40]]


def test_watermark_keeps_blocks_free_for_running_sequences():
    bm = BlockManager(20, 2, enable_prefix_cache=False)
    sched = Scheduler(bm, SchedulerConfig(32, 8, watermark=0.25))  # keep 5 of 20 blocks free
    kv = FakeKV(20, 2)
    for _ in range(5):
        sched.add(Sequence([1, 2, 3, 4], max_tokens=8), 0.0)  # 2 blocks each at admission
    run_step(sched, kv, 1.0)
    assert len(sched.running) == 5 and bm.num_free_blocks == 10  # each admission left >= 5 free
    sched.add(Sequence([1, 2, 3, 4, 5, 6], max_tokens=2), 1.0)  # 3 blocks: would leave fewer than 5 free
    run_step(sched, kv, 2.0)
    assert len(sched.waiting) == 1 and bm.num_free_blocks >= 5
    check_block_manager(bm, sched.running)
