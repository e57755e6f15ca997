"""A consistency check of a BlockManager against the live sequences, for tests and debugging."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from reference.kv.block_manager import BlockManager, KVSequence
from reference.kv.errors import KVCacheError


def check_block_manager(bm: BlockManager, live: Iterable[KVSequence]) -> None:
    """Raise KVCacheError unless the allocator's state agrees with the block tables of ``live``.

    Checks: each block's reference count equals the number of live block tables that hold it; every
    block is in exactly one of in-use / free / evictable; the prefix cache maps keys to blocks one
    to one; free blocks carry no key and evictable ones do; a table is as long as its tokens need.
    """
    held = Counter()
    for seq in live:
        held.update(seq.block_table)
        if len(seq.block_table) < bm.blocks_for(seq.num_computed_tokens):
            raise KVCacheError(f"sequence {seq.seq_id}: {len(seq.block_table)} blocks for "
                               f"{seq.num_computed_tokens} computed tokens")
        if len(seq.block_table) > bm.blocks_for(len(seq.token_ids)):
            raise KVCacheError(f"sequence {seq.seq_id}: {len(seq.block_table)} blocks for "
                               f"{len(seq.token_ids)} tokens")
    free, evictable = set(bm.free_block_ids), set(bm.evictable)
    if len(free) != len(bm.free_block_ids):
        raise KVCacheError("a block is twice in the free list")
    for block in range(bm.num_blocks):
        refs, key = bm.ref_count[block], bm.block_key[block]
        if refs != held[block]:
            raise KVCacheError(f"block {block}: ref_count {refs} but {held[block]} block tables "
                               "hold it")
        states = (refs > 0) + (block in free) + (block in evictable)
        if states != 1:
            raise KVCacheError(f"block {block}: in {states} of in-use/free/evictable, must be in "
                               "exactly one")
        if block in free and key is not None:
            raise KVCacheError(f"block {block} is free but still has a cache key")
        if block in evictable and key is None:
            raise KVCacheError(f"block {block} is evictable but has no cache key")
        if key is not None and bm.cached_blocks.get(key) != block:
            raise KVCacheError(f"block {block}: its key maps to block {bm.cached_blocks.get(key)}")
    if len(bm.cached_blocks) != sum(k is not None for k in bm.block_key):
        raise KVCacheError("the prefix cache holds a key of no block")
