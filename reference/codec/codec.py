"""Encode a bf16 tensor into the Huffman form and decode it back, bit for bit (FORMAT.md 2-3).

    ct = encode(bits)          # bits: uint16 array of bf16 patterns, any shape
    assert (decode(ct) == bits).all()

``decode`` is the plain decoder (``decoder.py``); ``decode_many`` (``lockstep.py``) decodes a list
of tensors in one lockstep pass, with the same result, much faster.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from reference.bf16 import sign_mantissa_byte
from reference.codec.bitstream import pack_codes
from reference.codec.decoder import decode_plain
from reference.codec.errors import CodecError
from reference.codec.format import (
    MAX_CHUNK_SIZE,
    MAX_CHUNKS_PER_GROUP,
    MAX_GROUP_WEIGHTS,
    UINT32_LIMIT,
    CompressedTensor,
    crc32,
)
from reference.codec.huffman import MAX_SUPPORTED_LENGTH, canonical_codes, code_lengths
from reference.codec.layout import Layout
from reference.codec.palette import (
    choose_palette,
    chunk_slices,
    exponent_field,
    find_verbatim_chunks,
    symbol_table,
)

PALETTE_SIZE, CHUNK_SIZE, CHUNKS_PER_GROUP, MAX_CODE_LENGTH = 16, 64, 32, 12


def encode(
    bits: np.ndarray,
    *,
    palette_size: int = PALETTE_SIZE,
    chunk_size: int = CHUNK_SIZE,
    chunks_per_group: int = CHUNKS_PER_GROUP,
    max_code_length: int = MAX_CODE_LENGTH,
    palette: Sequence[int] | None = None,
    name: str = "",
) -> CompressedTensor:
    """Compress a bf16 tensor (uint16 bit patterns, any shape) into the Huffman form.

    ``palette`` overrides the palette choice (used by the palette-form transcode, which must keep
    the palette it was given); by default it is the ``palette_size`` most frequent exponents.
    """
    bits = as_bf16(bits, name)
    layout = Layout(tuple(int(d) for d in bits.shape), chunk_size, chunks_per_group)
    check_parameters(layout, palette_size, max_code_length)
    flat = bits.reshape(-1)
    exponent = exponent_field(flat)
    if palette is None:
        palette = choose_palette(np.bincount(exponent, minlength=256), palette_size)
    palette = [int(e) for e in palette]
    symbol_of = symbol_table(palette)
    verbatim, vexp, coded_counts = find_verbatim_chunks(exponent, symbol_of, layout, len(palette))
    lengths = code_lengths(coded_counts, max_code_length)
    stream, offsets, stream_bits = _write_stream(exponent, symbol_of, verbatim, lengths, layout)
    ct = CompressedTensor(
        shape=layout.shape, chunk_size=chunk_size, chunks_per_group=chunks_per_group,
        max_code_length=max_code_length, palette=tuple(palette), code_lengths=tuple(lengths),
        stream_bits=stream_bits, crc={}, sm=sign_mantissa_byte(flat), stream=stream,
        offsets=offsets, vchunks=np.flatnonzero(verbatim).astype(np.uint32), vexp=vexp, name=name,
    )
    ct.crc = {key: crc32(a) for key, a in ct.arrays().items()} | {"data": crc32(flat)}
    return ct


def _write_stream(
    exponent: np.ndarray, symbol_of: np.ndarray, verbatim: np.ndarray, lengths: list[int],
    layout: Layout
) -> tuple[np.ndarray, np.ndarray, int]:
    """The Huffman codes of every coded chunk's exponents: (stream words, group offsets, bit
    count)."""
    codes = np.array(canonical_codes(lengths) or [0], np.uint64)
    length_of = np.array(lengths or [0], np.int64)
    group_bits = np.zeros(layout.n_groups, np.int64)
    chunks_per_group = layout.chunks_per_group
    pieces, position = [], 0
    for k0, k1 in chunk_slices(layout):
        symbols = symbol_of[layout.chunk_matrix(exponent, k0, k1)]
        coded = layout.column_mask(k0, k1) & ~verbatim[k0:k1, None]
        symbols = np.where(coded, symbols, 0)  # verbatim and padding slots: symbol 0, length 0
        bit_lengths = np.where(coded, length_of[symbols], 0)
        chunk_bits = bit_lengths.sum(axis=1)
        group_bits[k0 // chunks_per_group : -(-k1 // chunks_per_group)] = np.add.reduceat(
            chunk_bits, np.arange(0, k1 - k0, chunks_per_group))
        s, n = symbols[coded], bit_lengths[coded]
        starts = position + np.cumsum(n) - n
        pieces.append((codes[s], n, starts))
        position += int(n.sum())
    if position >= UINT32_LIMIT:
        raise CodecError(f"the Huffman stream would be {position} bits, beyond the format's 2^32 - "
                         "1")
    acc = np.zeros(-(-position // 32) + 1, np.uint64)
    for piece_codes, piece_lengths, starts in pieces:
        pack_codes(acc, piece_codes, piece_lengths, starts)
    offsets = np.concatenate([[0], np.cumsum(group_bits)]).astype(np.uint32)
    return acc.astype(np.uint32), offsets, position


def decode(ct: CompressedTensor) -> np.ndarray:
    """Decompress one tensor: its bf16 bit patterns (uint16, original shape). Raises CodecError.

    The plain decoder of ``decoder.py`` (FORMAT.md 3.5 line by line); ``decode_many`` gives the same
    bits much faster for big or many tensors.
    """
    return decode_plain(ct)


def as_bf16(bits: np.ndarray, name: str) -> np.ndarray:
    """``bits`` as a C-order uint16 array of bf16 patterns; CodecError for any other dtype."""
    bits = np.asarray(bits)
    if bits.dtype.newbyteorder("=") != np.dtype(np.uint16):
        raise CodecError(f"tensor {name!r}: bf16 tensors are uint16 bit patterns, got dtype "
                         f"{bits.dtype}")
    return np.asarray(bits, dtype=np.uint16, order="C")  # (ascontiguousarray makes 0-D 1-D)


def check_parameters(layout: Layout, palette_size: int, max_code_length: int) -> None:
    """Raise CodecError unless these encoder parameters are in the ranges FORMAT.md allows."""
    if not 1 <= layout.chunk_size <= MAX_CHUNK_SIZE:
        raise CodecError(f"chunk_size must be 1..{MAX_CHUNK_SIZE}, got {layout.chunk_size}")
    if not 1 <= layout.chunks_per_group <= MAX_CHUNKS_PER_GROUP:
        raise CodecError(f"chunks_per_group must be 1..{MAX_CHUNKS_PER_GROUP}, got "
                         f"{layout.chunks_per_group}")
    if layout.chunk_size * layout.chunks_per_group > MAX_GROUP_WEIGHTS:
        raise CodecError(f"chunk_size * chunks_per_group must be <= {MAX_GROUP_WEIGHTS}")
    if not 1 <= palette_size <= 256:
        raise CodecError(f"palette_size must be 1..256, got {palette_size}")
    if not 1 <= max_code_length <= MAX_SUPPORTED_LENGTH or 2**max_code_length < min(
        palette_size, 256
    ):
        raise CodecError(f"max_code_length {max_code_length} cannot code {palette_size} symbols "
                         f"(needs 2^L >= palette size, L <= {MAX_SUPPORTED_LENGTH})")
    if layout.n_chunks >= UINT32_LIMIT:
        raise CodecError(f"shape {layout.shape} has too many chunks for 32-bit chunk ids")
