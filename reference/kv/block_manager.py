"""Paged KV-cache bookkeeping: which fixed-size block holds which token of which sequence.

The data plane owns the K/V arrays, shaped ``[num_blocks, block_size, ...]``; this class only hands
out block ids. Token position ``p`` of a sequence lives in block
``seq.block_table[p // block_size]`` at offset ``p % block_size``, so a sequence's cache need not be
contiguous and at most one block per sequence is partly empty (the waste paged attention removes).

Every block is in exactly one of three states:

* **in use**: ``ref_count > 0``; referenced by that many block tables (more than one when shared);
* **free**: ``ref_count == 0``, no cached content; in ``free_block_ids``;
* **evictable**: ``ref_count == 0`` but its content is in the prefix cache, so a later sequence with
  the same prefix can still find it. Kept in LRU order; reclaimed (and forgotten by the cache) only
  when no free block is left.

Prefix cache: a block that is full and whose K/V have been computed is registered under its chained
key (``prefix_hash.block_key``). On admission a sequence reuses the cached blocks of its longest
cached prefix. A cached or shared block is never written: a sequence that must write into one gets a
private copy first (copy-on-write), and ``may_append`` returns the ``(src, dst)`` copies the data
plane must perform before the step's forward pass. The model must compute at least the last prompt
token (to get logits), so when the whole prompt is cached, ``num_cached_tokens = len(tokens) - 1``
and the last block is copied on write.

Call order for one sequence: ``can_allocate`` -> ``allocate`` (on admission); each step
``can_append(seq, n)`` -> ``may_append(seq, n)`` before computing ``n`` tokens, then
``cache_full_blocks(seq)`` after ``seq.num_computed_tokens`` has advanced; ``free`` when it
finishes, aborts or is preempted.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol

from reference.kv.errors import KVCacheError, OutOfBlocksError
from reference.kv.prefix_hash import ROOT_KEY, block_key


class KVSequence(Protocol):
    """What the block manager reads from and writes to a sequence (``reference.sched.Sequence`` has
    it)."""

    seq_id: int
    token_ids: list[int]  # read: prompt + output tokens so far
    num_computed_tokens: int  # read: tokens whose K/V are already in the cache
    cache_salt: str | None  # read: sequences with different salts never share blocks
    block_table: list[int]  # written: block ids in position order
    block_keys: list[bytes]  # written: prefix-cache keys of the full, computed blocks, in order
    num_cached_tokens: int  # written by allocate: tokens whose K/V came from the prefix cache


class BlockManager:
    """Reference-counted allocator of KV blocks with per-sequence block tables and a prefix
    cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KVCacheError(f"{name} must be an integer >= 1, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_count = [0] * num_blocks
        self.block_key: list[bytes | None] = [None] * num_blocks  # key of a cached block, else None
        self.cached_blocks: dict[bytes, int] = {}  # key -> block id
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        # unreferenced cached blocks, LRU first
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.num_lookup_tokens = 0  # prompt tokens looked up in the prefix cache (statistics)
        self.num_hit_tokens = 0  # of which found cached

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones plus evictable cached ones."""
        return len(self.free_block_ids) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        """Number of blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # ---- admission ------------------------------------------------------------------------------

    def can_allocate(self, seq: KVSequence, keep_free: int = 0) -> bool:
        """Whether ``allocate(seq)`` would succeed now and leave at least ``keep_free`` blocks
        free."""
        return self._blocks_needed_to_allocate(seq) + keep_free <= self.num_free_blocks

    def allocate(self, seq: KVSequence) -> None:
        """Give a new (or preempted) sequence blocks for all its tokens, reusing its cached prefix.

        Sets ``seq.block_table``, ``seq.block_keys`` and ``seq.num_cached_tokens``; the caller sets
        ``seq.num_computed_tokens = seq.num_cached_tokens``.
        """
        if seq.block_table:
            raise KVCacheError(f"sequence {seq.seq_id} already has blocks; free it before "
                               "allocating again")
        if not seq.token_ids:
            raise KVCacheError(f"sequence {seq.seq_id} has no tokens to allocate for")
        if not self.can_allocate(seq):
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs "
                                   f"{self._blocks_needed_to_allocate(seq)} "
                                   f"blocks, {self.num_free_blocks} free")
        keys, hits = self._cached_prefix(seq)
        for block in hits:  # take the hits first, so allocating new blocks cannot evict them
            if self.ref_count[block] == 0:
                del self.evictable[block]
            self.ref_count[block] += 1
        num_new = self.blocks_for(len(seq.token_ids)) - len(hits)
        seq.block_table = hits + [self._allocate_block() for _ in range(num_new)]
        seq.block_keys = keys
        seq.num_cached_tokens = min(len(hits) * self.block_size, len(seq.token_ids) - 1)
        self.num_lookup_tokens += len(seq.token_ids)
        self.num_hit_tokens += seq.num_cached_tokens

    # ---- each step
    # --------------------------------------------------------------------------------

    def can_append(self, seq: KVSequence, num_new_tokens: int = 1) -> bool:
        """Whether ``may_append(seq, num_new_tokens)`` would succeed now."""
        new_blocks, copies = self._append_plan(seq, num_new_tokens)
        needed = new_blocks + len(copies)
        # a decode into its own last block needs none
        return needed == 0 or needed <= self.num_free_blocks

    def may_append(self, seq: KVSequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Make room for the K/V of the next ``num_new_tokens`` tokens of ``seq``.

        Those are positions ``num_computed_tokens .. num_computed_tokens + num_new_tokens - 1``.
        Adds blocks at the end of the table as needed, and replaces every block in that range that
        is shared or cached by a private copy. Returns the ``(src, dst)`` block copies the data
        plane must make (all layers, K and V) before writing.
        """
        new_blocks, cow = self._append_plan(seq, num_new_tokens)
        if not new_blocks and not cow:
            # the common decode step: the token goes into the last block, which is private
            return []
        if new_blocks + len(cow) > self.num_free_blocks:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {new_blocks + len(cow)} blocks, "
                                   f"{self.num_free_blocks} free")
        copies = []
        for i in cow:
            src, dst = seq.block_table[i], self._allocate_block()  # allocate before releasing src
            self._release(src)
            seq.block_table[i] = dst
            copies.append((src, dst))
        seq.block_table.extend(self._allocate_block() for _ in range(new_blocks))
        return copies

    def cache_full_blocks(self, seq: KVSequence) -> None:
        """Register the blocks of ``seq`` that are full and computed in the prefix cache.

        Call after ``seq.num_computed_tokens`` advanced. A block whose key is already cached (the
        same prefix computed twice at once) stays private and is simply freed later.
        """
        if not self.enable_prefix_cache:
            return
        bs, keys = self.block_size, seq.block_keys
        for i in range(len(keys), seq.num_computed_tokens // bs):
            parent = keys[i - 1] if i else ROOT_KEY
            key = block_key(parent, seq.token_ids[i * bs:(i + 1) * bs], seq.cache_salt)
            keys.append(key)
            block = seq.block_table[i]
            if key not in self.cached_blocks and self.block_key[block] is None:
                self.cached_blocks[key] = block
                self.block_key[block] = key

    def free(self, seq: KVSequence) -> None:
        """Drop the sequence's references (finish, abort or preemption). Cached blocks stay
        findable."""
        for block in reversed(seq.block_table):  # the tail is least likely shared: evict it first
            self._release(block)
        seq.block_table = []
        seq.block_keys = []

    def fork(self, parent: KVSequence, child: KVSequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (e.g. n > 1 samples of one prompt).

        The child must hold the same tokens and ``num_computed_tokens`` as the parent; the first
        write into a shared block by either of them is then copied on write.
        """
        if child.block_table:
            raise KVCacheError(f"sequence {child.seq_id} already has blocks; free it before "
                               "forking into it")
        for block in parent.block_table:
            self.ref_count[block] += 1
        child.block_table = list(parent.block_table)
        child.block_keys = list(parent.block_keys)
        child.num_cached_tokens = parent.num_cached_tokens

    # ---- internals
    # --------------------------------------------------------------------------------

    def _cached_prefix(self, seq: KVSequence) -> tuple[list[bytes], list[int]]:
        """Keys and block ids of the longest run of cached full blocks at the start of ``seq``."""
        keys: list[bytes] = []
        hits: list[int] = []
        if not self.enable_prefix_cache:
            return keys, hits
        bs, parent = self.block_size, ROOT_KEY
        for i in range(len(seq.token_ids) // bs):
            parent = block_key(parent, seq.token_ids[i * bs:(i + 1) * bs], seq.cache_salt)
            block = self.cached_blocks.get(parent)
            if block is None:
                break
            keys.append(parent)
            hits.append(block)
        return keys, hits

    def _blocks_needed_to_allocate(self, seq: KVSequence) -> int:
        _, hits = self._cached_prefix(seq)
        needed = self.blocks_for(len(seq.token_ids)) - len(hits)
        # evictable hits leave the free pool
        needed += sum(1 for b in hits if self.ref_count[b] == 0)
        if len(hits) * self.block_size >= len(seq.token_ids):
            needed += 1  # the last token is recomputed into a copy of the last (cached) block
        return needed

    def _append_plan(self, seq: KVSequence, num_new_tokens: int) -> tuple[int, list[int]]:
        """(blocks to add at the end, table indices of blocks to copy on write) for the next
        tokens."""
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        if num_new_tokens < 1 or end > len(seq.token_ids):
            raise KVCacheError(f"sequence {seq.seq_id}: cannot compute {num_new_tokens} tokens "
                               "from position "
                               f"{start}, it has {len(seq.token_ids)} tokens")
        last = self.blocks_for(end)  # table length needed
        table = seq.block_table
        ref_count, cached = self.ref_count, self.block_key
        cow = [i for i in range(start // self.block_size, min(last, len(table)))
               if ref_count[table[i]] > 1 or cached[table[i]] is not None]
        return max(0, last - len(table)), cow

    def _allocate_block(self) -> int:
        """A block with no content: a free one, else the least recently used evictable one."""
        if self.free_block_ids:
            block = self.free_block_ids.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached_blocks[self.block_key[block]]
            self.block_key[block] = None
        self.ref_count[block] = 1
        return block

    def _release(self, block: int) -> None:
        if self.ref_count[block] <= 0:
            raise KVCacheError(f"block {block} freed more often than it was allocated")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if self.block_key[block] is not None:
                self.evictable[block] = None  # most recently used end
            else:
                self.free_block_ids.append(block)
