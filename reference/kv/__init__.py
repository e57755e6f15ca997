"""Paged KV cache, control plane: block allocator, block tables, prefix cache with chained keys.

Plain Python, shared by reference/ and fast/ (only the K/V arrays differ). API:

    bm = BlockManager(num_blocks, block_size, enable_prefix_cache=True)
    bm.num_free_blocks                  # free + evictable (cached, unreferenced) blocks
    bm.can_allocate(seq, keep_free=0) -> bool   # admission check (counts prefix-cache hits)
    bm.allocate(seq)                    # sets seq.block_table (blocks for ALL its tokens),
    seq.block_keys,
                                        #   seq.num_cached_tokens (<= len(tokens) - 1: the last
                                        token is computed)
    bm.can_append(seq, n=1) -> bool
    bm.may_append(seq, n=1) -> [(src, dst)]   # room for tokens num_computed .. num_computed+n-1;
    block
                                        #   copies (copy-on-write) the data plane must do before
                                        writing
    bm.cache_full_blocks(seq)           # after seq.num_computed_tokens advanced: register full
    blocks
    bm.free(seq)                        # finish / abort / preempt; cached blocks stay findable
    (LRU)
    bm.fork(parent, child)              # share all blocks (n > 1 samples); writes are copied on
    write
    bm.num_lookup_tokens, bm.num_hit_tokens   # prefix-cache statistics (tokens)

A sequence is anything with the fields of ``KVSequence`` (``reference.sched.Sequence`` has them):
token_ids, num_computed_tokens, cache_salt (read); block_table, block_keys, num_cached_tokens
(written). Token position p is in block ``block_table[p // block_size]``, slot ``p % block_size``.
Cache keys: ``prefix_hash.block_key(parent_key, token_ids, salt)`` (BLAKE2b-128, chained).
``audit.check_block_manager(bm, live_seqs)`` checks every invariant (tests use it).
Errors: ``KVCacheError`` (bad config or call), ``OutOfBlocksError`` (allocation without room).
"""

from reference.kv.audit import check_block_manager
from reference.kv.block_manager import BlockManager, KVSequence
from reference.kv.errors import KVCacheError, OutOfBlocksError
from reference.kv.prefix_hash import ROOT_KEY, block_key, prefix_keys

__all__ = ["BlockManager", "KVSequence", "KVCacheError", "OutOfBlocksError", "ROOT_KEY",
           "block_key", "check_block_manager", "prefix_keys"]
