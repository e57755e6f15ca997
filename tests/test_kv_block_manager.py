"""The block manager: allocation, prefix cache, LRU eviction, copy-on-write; a stateful property test."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from reference.kv import BlockManager, KVCacheError, OutOfBlocksError, check_block_manager
from reference.sched import Sequence
from tests.fake_plane import FakeKV


def seq(tokens, salt=None):
    s = Sequence(list(tokens), max_tokens=1, cache_salt=salt)
    return s


def compute(bm, kv, s, n):
    """What a step does for ``s``: make room, copy blocks, write n tokens, advance, register."""
    copies = bm.may_append(s, n)
    kv.copy_blocks(copies)
    kv.write(s.block_table, range(s.num_computed_tokens, s.num_computed_tokens + n),
             s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n])
    s.num_computed_tokens += n
    bm.cache_full_blocks(s)
    return copies


@pytest.mark.parametrize("args", [(0, 4), (4, 0), (4, -1), (2.5, 4), (True, 4)])
def test_invalid_config_is_a_clear_error(args):
    with pytest.raises(KVCacheError):
        BlockManager(*args)


def test_allocate_free_round_trip():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5 and s.num_cached_tokens == 0
    with pytest.raises(KVCacheError, match="already has blocks"):
        bm.allocate(s)
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8
    check_block_manager(bm, [])


def test_out_of_blocks():
    bm = BlockManager(2, 4)
    s = seq(range(9))
    assert not bm.can_allocate(s)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(s)


def test_prefix_hit_shares_blocks_and_counts_references():
    bm, kv = BlockManager(16, 4), FakeKV(16, 4)
    a = seq(range(10))
    bm.allocate(a)
    compute(bm, kv, a, 10)  # blocks 0, 1 full and cached; block 2 partial
    b = seq([*range(8), 99, 98, 97])
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_count[x] for x in b.block_table] == [2, 2, 1]
    assert bm.num_hit_tokens == 8 and bm.num_lookup_tokens == 21
    check_block_manager(bm, [a, b])


def test_fully_cached_prompt_recomputes_its_last_token_into_a_copy():
    bm, kv = BlockManager(16, 4), FakeKV(16, 4)
    a = seq(range(8))
    bm.allocate(a)
    compute(bm, kv, a, 8)
    b = seq(range(8))
    bm.allocate(b)
    assert b.num_cached_tokens == 7 and b.block_table == a.block_table
    b.num_computed_tokens = b.num_cached_tokens
    shared = b.block_table[1]
    copies = compute(bm, kv, b, 1)
    assert copies == [(shared, b.block_table[1])] and b.block_table[1] != shared
    assert kv.read(b.block_table, 8) == list(range(8)) and kv.read(a.block_table, 8) == list(range(8))
    check_block_manager(bm, [a, b])


def test_freed_cached_blocks_stay_findable_until_evicted_lru_first():
    bm, kv = BlockManager(4, 2), FakeKV(4, 2)
    old, new = seq([1, 2, 3]), seq([7, 8, 9])
    for s in (old, new):
        bm.allocate(s)
        compute(bm, kv, s, 3)
        bm.free(s)  # each leaves one cached full block ([1, 2] then [7, 8])
    assert bm.num_free_blocks == 4 and len(bm.evictable) == 2
    probe = seq([1, 2, 5])
    assert bm._cached_prefix(probe)[1]  # still cached after free
    big = seq([40, 41, 42, 43, 44])  # needs 3 blocks: the 2 free ones, then evicts the LRU cached block
    bm.allocate(big)
    assert not bm._cached_prefix(seq([1, 2, 5]))[1] and bm._cached_prefix(seq([7, 8, 5]))[1]
    check_block_manager(bm, [big])


def test_salts_never_share():
    bm, kv = BlockManager(8, 2), FakeKV(8, 2)
    a = seq([1, 2, 3], salt="tenant-a")
    bm.allocate(a)
    compute(bm, kv, a, 3)
    b = seq([1, 2, 3], salt="tenant-b")
    bm.allocate(b)
    c = seq([1, 2, 3], salt="tenant-a")
    bm.allocate(c)
    assert b.num_cached_tokens == 0 and c.num_cached_tokens == 2


def test_fork_then_both_write_copy_on_write():
    bm, kv = BlockManager(8, 4), FakeKV(8, 4)
    parent = seq([1, 2, 3, 4, 5, 6])
    bm.allocate(parent)
    compute(bm, kv, parent, 6)
    child = seq([1, 2, 3, 4, 5, 6])
    child.num_computed_tokens = 6
    bm.fork(parent, child)
    parent.token_ids.append(10)
    child.token_ids.append(20)
    assert compute(bm, kv, parent, 1) != []  # the shared partial block is copied for the parent
    assert compute(bm, kv, child, 1) == []  # the child now owns the original alone
    assert kv.read(parent.block_table, 7) == [1, 2, 3, 4, 5, 6, 10]
    assert kv.read(child.block_table, 7) == [1, 2, 3, 4, 5, 6, 20]
    check_block_manager(bm, [parent, child])


def test_may_append_rejects_tokens_that_do_not_exist():
    bm = BlockManager(8, 4)
    s = seq([1, 2, 3])
    bm.allocate(s)
    with pytest.raises(KVCacheError, match="cannot compute"):
        bm.may_append(s, 4)
    with pytest.raises(KVCacheError, match="cannot compute"):
        bm.may_append(s, 0)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, chunked computes, decodes, forks, preemptions and frees.

    After every rule: the audit (ref counts = block-table holders, each block in exactly one state,
    cache map one-to-one) passes, and reading every live sequence's computed positions back through
    its block table from the fake plane gives exactly its tokens (so no write ever hit a block another
    sequence or the cache relies on). At the end every block is free or evictable.
    """

    @initialize(num_blocks=st.integers(4, 24), block_size=st.integers(1, 4), prefix=st.booleans())
    def setup(self, num_blocks, block_size, prefix):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_cache=prefix)
        self.kv = FakeKV(num_blocks, block_size)
        self.live: list[Sequence] = []

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14), salt=st.sampled_from([None, "t1"]))
    def admit(self, tokens, salt):
        s = seq(tokens, salt)
        if self.bm.can_allocate(s):
            free_before = self.bm.num_free_blocks
            self.bm.allocate(s)
            assert 0 <= s.num_cached_tokens < len(tokens)
            s.num_computed_tokens = s.num_cached_tokens
            self.live.append(s)
            assert self.bm.num_free_blocks <= free_before
        else:
            with pytest.raises(OutOfBlocksError):
                self.bm.allocate(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute_tokens(self, data):
        s = data.draw(st.sampled_from(self.live))
        if s.num_uncomputed_tokens == 0:
            s.token_ids.append(data.draw(st.integers(0, 2)))  # decode: the token sampled last step
        n = data.draw(st.integers(1, s.num_uncomputed_tokens))
        if not self.bm.can_append(s, n):
            return
        start = s.num_computed_tokens
        copies = self.bm.may_append(s, n)
        self.kv.copy_blocks(copies)
        bs = self.bm.block_size
        for i in range(start // bs, self.bm.blocks_for(start + n)):  # blocks about to be written
            block = s.block_table[i]
            assert self.bm.ref_count[block] == 1 and self.bm.block_key[block] is None
        self.kv.write(s.block_table, range(start, start + n), s.token_ids[start:start + n])
        s.num_computed_tokens += n
        self.bm.cache_full_blocks(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = seq(parent.token_ids, parent.cache_salt)
        child.num_computed_tokens = parent.num_computed_tokens
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        s = data.draw(st.sampled_from(self.live))
        self.bm.free(s)
        self.live.remove(s)
        if preempt and self.bm.can_allocate(s):  # recompute: readmit with the same tokens
            s.num_computed_tokens = 0
            self.bm.allocate(s)
            s.num_computed_tokens = s.num_cached_tokens
            self.live.append(s)

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        check_block_manager(self.bm, self.live)
        for s in self.live:
            assert self.kv.read(s.block_table, s.num_computed_tokens) == s.token_ids[:s.num_computed_tokens]

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for s in self.live:
            self.bm.free(s)
        check_block_manager(self.bm, [])
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(self.bm.ref_count[b] == 0 for b in range(self.bm.num_blocks))


TestBlockManagerMachine = BlockManagerMachine.TestCase
