"""The baseline paged KV replaces: each sequence gets one contiguous range of KV slots, reserved
upfront.

``ContiguousAllocator`` manages an arena of ``capacity`` token slots with first-fit allocation over
a list of free holes (merged again on free), so it shows both kinds of fragmentation: *internal*
(slots reserved for tokens the sequence never produces) and *external* (free slots scattered in
holes too small for the next reservation). How much a sequence reserves is the ``reserve`` rule:

* ``"max_context"``: the model's whole context (what a static KV tensor per slot does);
* ``"request"``: prompt + max_tokens of the request (the usual per-request reservation);
* ``"oracle"``: prompt + the true output length (not knowable in practice: a lower bound).

It has the part of the ``BlockManager`` interface the ``Scheduler`` uses, with one "block" per token
slot, so the real scheduler drives it unchanged. Experiment E2 compares paged KV against it.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from reference.kv.errors import OutOfBlocksError

if TYPE_CHECKING:  # reference.sched imports reference.kv: no import cycle at run time
    from reference.sched import Sequence

RESERVE_RULES = ("max_context", "request", "oracle")


class ContiguousAllocator:
    def __init__(self, capacity: int, context: int, reserve: str,
                 true_output_len: dict[int, int] | None = None) -> None:
        if reserve not in RESERVE_RULES:
            raise ValueError(f"reserve must be one of {RESERVE_RULES}, got {reserve!r}")
        self.num_blocks = capacity  # one "block" = one token slot
        self.block_size = 1
        self.context = context
        self.reserve = reserve
        self.true_output_len = true_output_len or {}
        # [start, length], sorted by start, never adjacent
        self.holes: list[list[int]] = [[0, capacity]]
        self.reserved: dict[int, tuple[int, int]] = {}  # seq_id -> (start, length)

    @property
    def num_free_blocks(self) -> int:
        return sum(length for _, length in self.holes)

    @property
    def largest_hole(self) -> int:
        return max((length for _, length in self.holes), default=0)

    def blocks_for(self, num_tokens: int) -> int:
        return num_tokens

    def reservation(self, seq: Sequence) -> int:
        if self.reserve == "max_context":
            return self.context
        if self.reserve == "request":
            return min(seq.num_prompt_tokens + seq.max_tokens, self.context)
        return seq.num_prompt_tokens + self.true_output_len[seq.seq_id]

    def can_allocate(self, seq: Sequence, keep_free: int = 0) -> bool:
        need = self.reservation(seq)  # keep_free is for growing sequences; reservations never grow
        return any(length >= need for _, length in self.holes)

    def allocate(self, seq: Sequence) -> None:
        need = self.reservation(seq)
        for i, (start, length) in enumerate(self.holes):
            if length >= need:  # first fit
                if length == need:
                    del self.holes[i]
                else:
                    self.holes[i] = [start + need, length - need]
                self.reserved[seq.seq_id] = (start, need)
                seq.block_table = [start]  # slot of position p: start + p
                seq.num_cached_tokens = 0
                return
        raise OutOfBlocksError(f"no hole of {need} slots (free {self.num_free_blocks}, largest "
                               f"{self.largest_hole})")

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return seq.num_computed_tokens + num_new_tokens <= self.reserved[seq.seq_id][1]

    def may_append(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        if not self.can_append(seq, num_new_tokens):
            raise OutOfBlocksError(f"sequence {seq.seq_id} outgrew its reservation")
        return []

    def cache_full_blocks(self, seq: Sequence) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        start, length = self.reserved.pop(seq.seq_id)
        i = bisect.bisect_left(self.holes, [start, 0])
        self.holes.insert(i, [start, length])
        # merge with the next hole
        if i + 1 < len(self.holes) and start + length == self.holes[i + 1][0]:
            self.holes[i][1] += self.holes.pop(i + 1)[1]
        # and with the previous one
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == start:
            self.holes[i - 1][1] += self.holes.pop(i)[1]
        seq.block_table = []
