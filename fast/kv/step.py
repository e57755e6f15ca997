"""What the KV kernels need to know about one engine step: ``KVStep``.

A step runs a batch of *chunks*: chunk i is ``query_lens[i]`` new tokens of one sequence at positions
``starts[i] .. starts[i] + query_lens[i] - 1``, whose first ``starts[i]`` tokens are already in the
cache (a cached prefix, or the tokens decoded so far). A decoding sequence is a chunk of one token.
The step's queries are the chunks' tokens concatenated in order (``query_starts`` gives the offsets).

Built once per step and shared by every layer. Host copies (tuples) drive the torch path's batching;
device tensors feed the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from reference.kv.errors import KVCacheError


@dataclass(frozen=True, kw_only=True)
class KVStep:
    """Per-step metadata for writes and paged attention (shapes: B chunks, T = sum(query_lens) tokens).

    * ``query_lens``, ``starts``: host tuples of B ints (tokens in each chunk; cached tokens before it).
    * ``block_tables``: int32 [B, max_blocks], row i = chunk i's block ids, padded on the right with
      ``pad_block`` (never read: kernels stop at ``seq_lens``).
    * ``seq_lens``: int32 [B] = starts + query_lens (positions each chunk attends to, its own included).
    * ``context_lens``: int32 [B] = starts.   ``query_starts``: int32 [B + 1], cumulative query_lens.
    * ``slots``: int64 [T], cache slot of every new token (block * block_size + offset).
    """

    query_lens: tuple[int, ...]
    starts: tuple[int, ...]
    block_size: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    query_starts: torch.Tensor
    slots: torch.Tensor
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # layouts derived once per step and
    # reused by every layer (the torch attention path's batches)

    @property
    def num_chunks(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        got = self.memo.get("max_seq_len")  # asked by every layer: worked out once per step
        if got is None:
            got = self.memo["max_seq_len"] = max((s + n for s, n in zip(self.starts, self.query_lens, strict=True)),
                                                 default=0)
        return got

    @property
    def is_decode(self) -> bool:
        """True when every chunk is one token (a pure decode step)."""
        got = self.memo.get("is_decode")
        if got is None:
            got = self.memo["is_decode"] = all(n == 1 for n in self.query_lens)
        return got

    @classmethod
    def build(cls, *, query_lens: Sequence[int], starts: Sequence[int], block_tables: Sequence[Sequence[int]],
              block_size: int, num_blocks: int, device: torch.device | str = "cpu", pad_block: int = 0,
              max_blocks: int | None = None) -> KVStep:
        """Check the step's bookkeeping and lay it out as tensors on ``device``.

        Raises ``KVCacheError`` naming the chunk when lengths disagree, a count is not positive, a
        block table does not cover its chunk, or a block id is outside [0, num_blocks).
        """
        query_lens, starts = [int(n) for n in query_lens], [int(s) for s in starts]
        if not (len(query_lens) == len(starts) == len(block_tables)):
            raise KVCacheError(f"query_lens ({len(query_lens)}), starts ({len(starts)}) and block_tables "
                               f"({len(block_tables)}) must have one entry per chunk")
        if block_size <= 0 or num_blocks <= 0:
            raise KVCacheError("block_size and num_blocks must be positive")
        if not 0 <= pad_block < num_blocks:
            raise KVCacheError(f"pad_block {pad_block} is outside [0, {num_blocks})")
        width = max([len(t) for t in block_tables] + [1, max_blocks or 0])
        tables = np.full((len(query_lens), width), pad_block, dtype=np.int64)
        slots = []
        for i, (n, start, table) in enumerate(zip(query_lens, starts, block_tables, strict=True)):
            if n <= 0 or start < 0:
                raise KVCacheError(f"chunk {i}: query_len must be >= 1 and start >= 0, got {n} and {start}")
            need = -(-(start + n) // block_size)
            if need > len(table):
                raise KVCacheError(f"chunk {i}: positions up to {start + n - 1} need {need} blocks, "
                                   f"its block table has {len(table)}")
            ids = np.asarray(table, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
                raise KVCacheError(f"chunk {i}: block table has ids outside [0, {num_blocks})")
            tables[i, :len(ids)] = ids
            pos = np.arange(start, start + n)
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
        if max_blocks is not None and width > max_blocks:
            raise KVCacheError(f"a block table has {width} blocks, more than max_blocks={max_blocks}")
        q_lens = np.asarray(query_lens, dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(q_lens)]) if query_lens else np.zeros(1, np.int64)

        def on(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        return cls(query_lens=tuple(query_lens), starts=tuple(starts), block_size=block_size,
                   block_tables=on(tables, torch.int32),
                   seq_lens=on(np.asarray(starts, np.int64) + q_lens, torch.int32),
                   context_lens=on(np.asarray(starts, np.int64), torch.int32),
                   query_starts=on(cu, torch.int32),
                   slots=on(np.concatenate(slots) if slots else np.zeros(0, np.int64), torch.int64))
