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
    max_lengths: np.ndarray,
    table_base: np.ndarray,
    table_symbols: np.ndarray,
    table_lengths: np.ndarray,
) -> np.ndarray:
    """Decode many groups at once; return their symbols concatenated in group order (uint8).

    Group i starts at bit ``starts[i]`` of ``stream``, holds ``counts[i]`` symbols, and must end
    exactly at bit ``ends[i]``. Its decoding table is entries ``table_base[i] ...`` of
    ``table_symbols`` / ``table_lengths``, indexed by the next ``max_lengths[i]`` bits. (Several
    tensors, each with its own table, can be decoded in one call: concatenate their streams and
    tables and offset the starts and bases.) The stream must end with one spare zero word.

    Raises CodecError if a group hits an invalid table entry, runs off the stream, or does not
    end exactly where the next one starts.
    """
    n_groups = len(starts)
    if n_groups == 0:
        return np.zeros(0, np.uint8)
    # every 64-bit window of two neighbouring words, so a peek is one gather and two shifts
    windows = (stream[:-1].astype(np.uint64) << np.uint64(32)) | stream[1:].astype(np.uint64)
    advance = np.where(table_lengths == 0, INVALID_ADVANCE, table_lengths.astype(np.int64))

    # Longest groups first: then the groups still decoding at step t are a prefix of the arrays.
    order = np.argsort(-counts, kind="stable")
    pos = starts[order].astype(np.int64)
    drop = (64 - max_lengths[order]).astype(np.uint64)
    base = table_base[order].astype(np.int64)
    steps = int(counts.max())
    active = np.searchsorted(-counts[order], -np.arange(steps), side="left")  # groups with count > t
    out = np.zeros((steps, n_groups), np.uint8)
    try:
        for t in range(steps):
            k = active[t]
            p = pos[:k]  # a view: updating p updates pos
            peek = (windows[p >> 5] << (p & 31).astype(np.uint64)) >> drop[:k]
            entry = peek.astype(np.int64) + base[:k]
            out[t, :k] = table_symbols[entry]
            p += advance[entry]
    except IndexError:  # a corrupt group ran off the end of the stream
        raise CodecError("Huffman stream is corrupt: a group ran past the end of the stream") from None
    bad = np.flatnonzero(pos != ends[order].astype(np.int64))
    if bad.size:
        g = int(order[bad[0]])
        raise CodecError(f"Huffman stream is corrupt: group {g} ended at bit {int(pos[bad[0]])} "
                         f"instead of {int(ends[g])} ({bad.size} bad groups)")
    # symbols of group order[j] are out[:counts, j]; put the groups back in order and drop the unused tail
    by_group = out.T[np.argsort(order, kind="stable")]
    return by_group[np.arange(steps) < counts[:, None]]
