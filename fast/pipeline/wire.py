"""What travels between pipeline stages, and the checks a receiver makes before it trusts any of it.

Every message starts with a header of 9 int64: ``MAGIC, kind, step, micro-batch, chunks, tokens,
copies, rows, meta_len``. Then, by kind:

* ``FORWARD`` (stage k -> k+1): ``meta`` int64[meta_len] (per chunk: tokens, start, which logits it
  wants (bit 0: its last row's, bit 1: every row's, for a prompt's logprobs), block-table length, the
  table; then the copy-on-write pairs, applied before the micro-batch), the residual stream float32
  [tokens, hidden], and the trace float64 [2 (k+1)] (when each stage started and ended its compute, on
  the host's monotonic clock);
* ``LOGITS`` (last stage -> stage 0): float32 [rows, vocab] (``reference.model.llama.logit_rows``'s rows, chunk
  by chunk) and the trace float64 [2 K];
* ``STOP``: nothing more; every stage passes it on and exits.

A receiver checks the header against its limits (the number of KV blocks, the context, the step's
token budget) before it allocates a buffer for what follows, and every block id and position before
it writes its cache: a peer's numbers are never trusted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference.model.llama import Chunk, logit_rows

MAGIC = 0x55465050  # "UFPP"
FORWARD, LOGITS, STOP = 1, 2, 3
HEADER_LEN = 9


@dataclass(frozen=True)
class Limits:
    """What a stage accepts: any number outside these is refused before it is used."""

    num_blocks: int
    block_size: int
    max_position: int
    hidden: int
    vocab: int
    max_tokens: int = 1 << 16  # tokens in one micro-batch
    max_chunks: int = 4096

    @property
    def max_table(self) -> int:
        return min(self.num_blocks, -(-self.max_position // self.block_size))


def header(kind: int, step: int = 0, mb: int = 0, chunks: int = 0, tokens: int = 0, copies: int = 0, rows: int = 0,
           meta_len: int = 0) -> torch.Tensor:
    return torch.tensor([MAGIC, kind, step, mb, chunks, tokens, copies, rows, meta_len], dtype=torch.int64)


def encode_forward(step: int, mb: int, chunks: Sequence[Chunk],
                   copies: Sequence[tuple[int, int]] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The header and meta of a FORWARD message for these chunks (tokens themselves go only to stage 0)."""
    meta: list[int] = []
    for ch in chunks:
        wants = int(ch.wants_logits) | 2 * int(ch.all_logits)  # bit 0: the last row's logits; bit 1: every row's
        meta += [len(ch.tokens), ch.start, wants, len(ch.block_table), *ch.block_table]
    for src, dst in copies:
        meta += [src, dst]
    tokens = sum(len(ch.tokens) for ch in chunks)
    rows = len(logit_rows(chunks)[0])
    h = header(FORWARD, step, mb, len(chunks), tokens, len(copies), rows, len(meta))
    return h, torch.tensor(meta, dtype=torch.int64)


def check_header(h: torch.Tensor, limits: Limits, kinds: tuple[int, ...]) -> tuple[int, ...]:
    """The header's fields, or ``WireError`` naming what is wrong with it."""
    magic, kind, step, mb, chunks, tokens, copies, rows, meta_len = (int(v) for v in h.tolist())
    if magic != MAGIC:
        raise WireError(f"not a pipeline message (magic {magic:#x})")
    if kind not in kinds:
        raise WireError(f"unexpected message kind {kind} (expected one of {kinds})")
    if kind == STOP:
        return kind, step, mb, chunks, tokens, copies, rows, meta_len
    if not (0 <= step and 0 <= mb and 1 <= chunks <= limits.max_chunks and 1 <= tokens <= limits.max_tokens
            and 0 <= rows <= tokens and 0 <= copies <= limits.num_blocks):
        raise WireError(f"header out of range: step {step}, micro-batch {mb}, {chunks} chunks, {tokens} tokens, "
                        f"{rows} rows, {copies} copies")
    if kind == FORWARD and not 4 * chunks + 2 * copies <= meta_len <= chunks * (4 + limits.max_table) + 2 * copies:
        raise WireError(f"meta length {meta_len} does not fit {chunks} chunks and {copies} copies")
    return kind, step, mb, chunks, tokens, copies, rows, meta_len


def decode_forward(fields: tuple[int, ...], meta: torch.Tensor,
                   limits: Limits) -> tuple[list[Chunk], list[tuple[int, int]]]:
    """Chunks (token ids left empty: only the first stage has them) and copies, every number checked."""
    _, _, _, n_chunks, n_tokens, n_copies, n_rows, _ = fields
    m = meta.tolist()
    at, chunks, total, rows = 0, [], 0, 0
    for j in range(n_chunks):
        if at + 4 > len(m):
            raise WireError(f"meta ends inside chunk {j}")
        size, start, wants, table_len = m[at:at + 4]
        at += 4
        if size < 1 or start < 0 or start + size > limits.max_position or wants not in (0, 1, 2, 3):
            raise WireError(f"chunk {j}: {size} tokens from {start} (context {limits.max_position})")
        if not (size + start <= table_len * limits.block_size and table_len <= limits.max_table) \
                or at + table_len > len(m):
            raise WireError(f"chunk {j}: a block table of {table_len} does not cover {start + size} tokens")
        table = m[at:at + table_len]
        at += table_len
        if any(not 0 <= b < limits.num_blocks for b in table):
            raise WireError(f"chunk {j}: a block id outside [0, {limits.num_blocks})")
        chunks.append(Chunk([0] * size, start, table, wants_logits=bool(wants & 1), all_logits=bool(wants & 2)))
        total, rows = total + size, rows + (size if wants & 2 else wants)
    if total != n_tokens or rows != n_rows:
        raise WireError(f"chunks hold {total} tokens and {rows} rows; the header says {n_tokens} and {n_rows}")
    if len(m) - at != 2 * n_copies:
        raise WireError(f"meta has {len(m) - at} values after the chunks; {n_copies} copies need {2 * n_copies}")
    copies = [(m[at + 2 * i], m[at + 2 * i + 1]) for i in range(n_copies)]
    if any(not (0 <= s < limits.num_blocks and 0 <= d < limits.num_blocks) for s, d in copies):
        raise WireError(f"a block copy outside [0, {limits.num_blocks})")
    return chunks, copies


class WireError(ValueError):
    """A message from a peer stage that does not pass the checks."""


def send_all(tensors: Sequence[torch.Tensor], dst: int) -> list[dist.Work]:
    """Start sending the tensors to ``dst`` in order (non-blocking); wait on the returned works. An empty
    tensor is not sent (the receiver knows its size from the header and skips it too)."""
    return [dist.isend(t.contiguous(), dst=dst) for t in tensors if t.numel()]


def recv(shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    dist.recv(t, src=src)
    return t
