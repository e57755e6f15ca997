"""The lockstep Huffman decoder: every group of every tensor decoded at once, in NumPy.

The same result as the plain decoder (``decoder.py``, FORMAT.md 3.5 line by line), reorganised for
speed: step t decodes symbol t of all groups with a handful of whole-array operations. A group is a
few thousand symbols, so the Python loop runs a few thousand times and each step works on as many
groups as there are. It is an optimisation, checked against the plain decoder in
``tests/test_codec_roundtrip.py`` and by the conformance suite; the container uses it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from reference.bf16 import join_sign_mantissa
from reference.codec.errors import CodecError
from reference.codec.format import CompressedTensor, crc32
from reference.codec.huffman import decode_table

# what an invalid table entry adds to a position: past any real stream end
INVALID_ADVANCE = 1 << 40
# steps decoded into a small buffer before moving them to the group-major result
TRANSPOSE_BLOCK = 16


def decode_many(tensors: Sequence[CompressedTensor]) -> list[np.ndarray]:
    """Decompress several tensors, decoding all their groups in one lockstep pass."""
    for ct in tensors:
        ct.check()
    exponents = decode_symbols(tensors, as_exponents=True)
    return [_assemble(ct, e) for ct, e in zip(tensors, exponents, strict=True)]


def decode_symbols(
    tensors: Sequence[CompressedTensor], as_exponents: bool = False
) -> list[np.ndarray]:
    """The Huffman symbols (palette indices) of each tensor's coded weights, in stream order.

    With ``as_exponents`` the decoding tables hold palette[symbol], so what comes out is exponents.

    Builds one work list over the groups of all tensors (their streams concatenated, one decoding
    table each) and hands it to ``read_groups``. All tables are built for the batch's longest
    ``max_code_length`` (a table for fewer bits simply repeats each entry), so every group peeks the
    same number of bits. Tensors must have passed ``check()``.
    """
    if not tensors:
        return []
    window_bits = max(ct.max_code_length for ct in tensors)
    starts, ends, counts, table_of_group, tables = [], [], [], [], []
    word_base = 0
    for i, ct in enumerate(tensors):
        offsets = ct.offsets.astype(np.int64) + 32 * word_base
        starts.append(offsets[:-1])
        ends.append(offsets[1:])
        counts.append(_coded_weights_per_group(ct))
        table_of_group.append(np.full(ct.layout.n_groups, i, np.int64))
        symbols, lengths = decode_table(ct.code_lengths, window_bits)
        tables.append(
            (
                np.asarray(ct.palette, np.uint8)[symbols]
                if as_exponents and ct.palette
                else symbols,
                lengths,
            )
        )
        word_base += len(ct.stream)
    try:
        decoded = read_groups(
            np.concatenate([ct.stream for ct in tensors]), np.concatenate(starts),
            np.concatenate(ends),
            np.concatenate(counts), window_bits, np.stack([s for s, _ in tables]),
            np.stack([n for _, n in tables]),
            np.concatenate(table_of_group) if len(tensors) > 1 else None)
    except CodecError as e:
        names = ", ".join(repr(ct.name) for ct in tensors[:4]) + (
            " ..." if len(tensors) > 4 else ""
        )
        raise CodecError(f"tensor(s) {names}: {e}") from None
    return np.split(decoded, np.cumsum([int(c.sum()) for c in counts])[:-1])


def _coded_weights_per_group(ct: CompressedTensor) -> np.ndarray:
    """How many coded weights (= Huffman symbols) each group of ``ct`` holds (int64 per group)."""
    layout = ct.layout
    per_chunk = layout.chunk_length(np.arange(layout.n_chunks, dtype=np.int64))
    per_chunk[ct.vchunks.astype(np.int64)] = 0
    if layout.n_chunks == 0:
        return np.zeros(0, np.int64)
    return np.add.reduceat(per_chunk, np.arange(0, layout.n_chunks, layout.chunks_per_group))


def _assemble(ct: CompressedTensor, exponents: np.ndarray) -> np.ndarray:
    """Rebuild the bf16 bits from the coded weights' exponents, the verbatim chunks and sm; check
    the CRC."""
    layout = ct.layout
    chunks = place_chunks(ct, exponents.astype(np.uint8), ct.vexp)
    bits = join_sign_mantissa(ct.sm, layout.unchunk(chunks, 0, layout.n_chunks))
    if crc32(bits) != ct.crc["data"]:
        raise CodecError(f"tensor {ct.name!r}: decoded data fails its CRC-32 check (corrupt header "
                         "or stream)")
    return bits.reshape(ct.shape)


def place_chunks(ct: CompressedTensor, coded_values: np.ndarray,
                 verbatim_values: np.ndarray) -> np.ndarray:
    """A (n_chunks, chunk_size) matrix: ``coded_values`` (one per coded weight, in order) in the
    coded chunks, the rows of ``verbatim_values`` in the verbatim chunks; slots past a row's end are
    0."""
    layout = ct.layout
    if layout.aligned and ct.n_verbatim == 0:  # the common case: a reshape, no copy
        return coded_values.reshape(layout.n_chunks, layout.chunk_size)
    verbatim = np.zeros(layout.n_chunks, bool)
    verbatim[ct.vchunks.astype(np.int64)] = True
    matrix = np.zeros((layout.n_chunks, layout.chunk_size), coded_values.dtype)
    if layout.aligned:
        matrix[~verbatim] = coded_values.reshape(-1, layout.chunk_size)
    else:
        matrix[layout.column_mask(0, layout.n_chunks) & ~verbatim[:, None]] = coded_values
    matrix[verbatim] = verbatim_values
    return matrix


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
    advance = (
        np.where(table_lengths == 0, INVALID_ADVANCE, table_lengths).astype(np.int64).reshape(-1)
    )
    drop = np.uint64(64 - window_bits)

    # Longest groups first: then the groups still decoding at step t are a prefix of the arrays.
    order = np.argsort(-counts, kind="stable")
    pos = starts[order].astype(np.int64)  # int64, not uint64: NumPy indexes fastest with int64
    base = None if table_of_group is None else table_of_group[order].astype(np.int64) << window_bits
    steps = int(counts.max())
    # groups with count > t
    active = np.searchsorted(-counts[order], -np.arange(steps), side="left")
    by_group = np.zeros((n_groups, steps), np.uint8)  # row j: the symbols of group order[j]
    block = np.zeros((TRANSPOSE_BLOCK, n_groups), np.uint8)  # the last few steps, one row per step
    try:
        for t in range(steps):
            k = active[t]
            p = pos[:k]  # a view: updating p updates pos
            # the next window_bits bits (the views only relabel non-negative values, they copy
            # nothing)
            entry = ((windows[p >> 5] << (p & 31).view(np.uint64)) >> drop).view(np.int64)
            if base is not None:
                entry += base[:k]
            block[t % TRANSPOSE_BLOCK, :k] = symbols[entry]
            p += advance[entry]
            if t % TRANSPOSE_BLOCK == TRANSPOSE_BLOCK - 1 or t == steps - 1:
                # move the block into the group-major result (a small transpose stays in cache;
                # transposing the whole steps x groups matrix at the end would be several times
                # slower)
                t0 = t - t % TRANSPOSE_BLOCK
                by_group[:, t0 : t + 1] = block[: t + 1 - t0].T
    except IndexError:  # a corrupt group ran off the end of the stream
        raise CodecError(
            "Huffman stream is corrupt: a group ran past the end of the stream"
        ) from None
    bad = np.flatnonzero(pos != ends[order])
    if bad.size:
        g = int(order[bad[0]])
        raise CodecError(f"Huffman stream is corrupt: group {g} ended at bit {int(pos[bad[0]])} "
                         f"instead of {int(ends[g])} ({bad.size} bad groups)")
    # put the groups back in order, keep each one's first counts[i] symbols
    return by_group[np.argsort(order, kind="stable")][np.arange(steps) < counts[:, None]]
