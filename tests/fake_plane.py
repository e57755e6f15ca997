"""A fake data plane for control-plane tests: the "KV cache" stores token ids instead of K/V.

Writing token t at position p into slot s records ``(p, t)`` there. Reading a sequence's context back
through its block table then proves that the block manager and the scheduler gave the model the
right cache: every computed position must hold exactly that sequence's token. A fake model returns a
token that depends only on (seed, sequence id, position), so recomputation after preemption must
reproduce the same output.
"""

from __future__ import annotations

import hashlib

from reference.sched import Batch, Scheduler


class FakeKV:
    """Slots of (position, token) per block; block copies and writes as the real data plane does them."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.slots[dst] = list(self.slots[src])

    def write(self, block_table: list[int], positions: range, token_ids: list[int]) -> None:
        bs = self.block_size
        for p, t in zip(positions, token_ids, strict=True):
            self.slots[block_table[p // bs]][p % bs] = (p, t)

    def read(self, block_table: list[int], num_tokens: int) -> list[int | None]:
        """Token ids stored for positions 0 .. num_tokens - 1 (None where a slot is wrong or empty)."""
        bs, out = self.block_size, []
        for p in range(num_tokens):
            cell = self.slots[block_table[p // bs]][p % bs]
            out.append(cell[1] if cell is not None and cell[0] == p else None)
        return out


def fake_token(seed: int, seq_id: int, position: int, vocab: int = 50) -> int:
    """A deterministic 'sampled' token for the token after ``position``."""
    digest = hashlib.blake2b(f"{seed}/{seq_id}/{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % vocab


def run_step(sched: Scheduler, kv: FakeKV, now: float, seed: int = 0, vocab: int = 50) -> tuple[Batch, list]:
    """One engine step against the fake plane; checks that each entry's cached context is right."""
    batch = sched.schedule(now)
    kv.copy_blocks(batch.block_copies)
    bm, written = sched.block_manager, set()
    for e in batch.entries:  # copy-on-write: every block written is private and not in the prefix cache
        blocks = {e.block_table[p // kv.block_size] for p in e.positions}
        assert not blocks & written, "two sequences write the same block"
        assert all(bm.ref_count[b] == 1 and bm.block_key[b] is None for b in blocks)
        written |= blocks
    tokens = []
    for e in batch.entries:
        seen = kv.read(e.block_table, e.start)
        assert seen == e.seq.token_ids[:e.start], f"seq {e.seq.seq_id}: wrong cached context"
        kv.write(e.block_table, e.positions, e.token_ids)
        tokens.append(fake_token(seed, e.seq.seq_id, e.context_len, vocab) if e.needs_sample else None)
    finished = sched.postprocess(batch, tokens, now)
    return batch, finished
