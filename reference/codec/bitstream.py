"""Writing and reading the Huffman bit stream (FORMAT.md sections 3.4 and 3.5).

The stream is a uint32 array; bit i is bit ``31 - i % 32`` of word ``i // 32`` (MSB first), and
each code is written most significant bit first. Reading is table driven: peek at the next L bits,
look them up in the decoding table, get a symbol and how many bits it used.

The decoder runs every group of every tensor it is given in lockstep: step t decodes symbol t of
all groups at once with a handful of NumPy operations. A group is a few thousand symbols, so the
Python loop runs a few thousand times, and each step works on as many groups as there are.
"""

from __future__ import annotations

import numpy as np

from reference.codec.errors import CodecError

INVALID_ADVANCE = 1 << 40  # what an invalid table entry adds to a position: past any real stream end
TRANSPOSE_BLOCK = 16  # steps decoded into a small buffer before moving them to the group-major result


def pack_codes(acc: np.ndarray, codes: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> None:
    """OR codes (uint64 values of ``lengths`` bits) into a uint64 word accumulator at bit ``starts``.

    ``acc`` holds one 32-bit word per entry. A code of <= 16 bits starting at bit ``s`` lies in the
    64-bit window made of words ``s >> 5`` and ``(s >> 5) + 1``: shift it into place in that window,
    then add the high half to the first word and the low half to the second. Codes never overlap,
    so adding is the same as OR-ing (and ``np.add.at`` is much faster than ``np.bitwise_or.at``).
    """
    word = starts >> 5
    shift = (64 - lengths - (starts & 31)).astype(np.uint64)
    piece = codes.astype(np.uint64) << shift
    np.add.at(acc, word, piece >> np.uint64(32))
    np.add.at(acc, word + 1, piece & np.uint64(0xFFFFFFFF))


def read_groups(
    stream: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    counts: np.ndarray,
    window_bits: int,
    table_symbols: np.ndarray,
    table_lengths: np.ndarray,
    table_of_group: np.ndarray | None = None,
) -> np.ndarray:
    """Decode many groups at once; return their symbols concatenated in group order (uint8).

    Group i starts at bit ``starts[i]`` of ``stream``, holds ``counts[i]`` symbols, and must end
    exactly at bit ``ends[i]``. Decoding tables are indexed by the next ``window_bits`` bits: row
    ``table_of_group[i]`` of ``table_symbols`` / ``table_lengths`` (shape [tables, 2^window_bits])
    is group i's. Several tensors, each with its own table, are decoded in one call by concatenating
    their streams and tables. The stream must end with one spare zero word.

    Raises CodecError if a group hits an invalid table entry, runs off the stream, or does not
    end exactly where it should.
    """
    n_groups = len(starts)
    if n_groups == 0:
        return np.zeros(0, np.uint8)
    # every 64-bit window of two neighbouring words, so a peek is one gather and two shifts
    windows = (stream[:-1].astype(np.uint64) << np.uint64(32)) | stream[1:].astype(np.uint64)
    symbols = table_symbols.reshape(-1)
    advance = np.where(table_lengths == 0, INVALID_ADVANCE, table_lengths).astype(np.int64).reshape(-1)
    drop = np.uint64(64 - window_bits)

    # Longest groups first: then the groups still decoding at step t are a prefix of the arrays.
    order = np.argsort(-counts, kind="stable")
    pos = starts[order].astype(np.int64)  # int64, not uint64: NumPy indexes fastest with int64
    base = None if table_of_group is None else table_of_group[order].astype(np.int64) << window_bits
    steps = int(counts.max())
    active = np.searchsorted(-counts[order], -np.arange(steps), side="left")  # groups with count > t
    by_group = np.zeros((n_groups, steps), np.uint8)  # row j: the symbols of group order[j]
    block = np.zeros((TRANSPOSE_BLOCK, n_groups), np.uint8)  # the last few steps, one row per step
    try:
        for t in range(steps):
            k = active[t]
            p = pos[:k]  # a view: updating p updates pos
            # the next window_bits bits (the views only relabel non-negative values, they copy nothing)
            entry = ((windows[p >> 5] << (p & 31).view(np.uint64)) >> drop).view(np.int64)
            if base is not None:
                entry += base[:k]
            block[t % TRANSPOSE_BLOCK, :k] = symbols[entry]
            p += advance[entry]
            if t % TRANSPOSE_BLOCK == TRANSPOSE_BLOCK - 1 or t == steps - 1:
                # move the block into the group-major result (a small transpose stays in cache;
                # transposing the whole steps x groups matrix at the end would be several times slower)
                t0 = t - t % TRANSPOSE_BLOCK
                by_group[:, t0 : t + 1] = block[: t + 1 - t0].T
    except IndexError:  # a corrupt group ran off the end of the stream
        raise CodecError("Huffman stream is corrupt: a group ran past the end of the stream") from None
    bad = np.flatnonzero(pos != ends[order])
    if bad.size:
        g = int(order[bad[0]])
        raise CodecError(f"Huffman stream is corrupt: group {g} ended at bit {int(pos[bad[0]])} "
                         f"instead of {int(ends[g])} ({bad.size} bad groups)")
    # put the groups back in order, keep each one's first counts[i] symbols
    return by_group[np.argsort(order, kind="stable")][np.arange(steps) < counts[:, None]]
