"""The palette (the 16 most frequent exponents of a tensor) and the verbatim-chunk rule.

FORMAT.md section 2: the palette is the ``palette_size`` most frequent exponent values, by count
descending, ties by exponent value ascending. A chunk holding any exponent outside the palette is
verbatim; every other chunk is coded, one Huffman symbol (= palette index) per weight.
"""

from __future__ import annotations

import numpy as np

from reference.codec.layout import Layout

# "this exponent is not in the palette": above every palette index (0 ... 255)
NOT_IN_PALETTE = 0x100
SLICE_WEIGHTS = 1 << 22  # the encoder walks big tensors in slices of about this many weights


def exponent_field(bits: np.ndarray) -> np.ndarray:
    """The 8-bit exponent of each bf16 bit pattern (uint8)."""
    return ((bits >> 7) & 0xFF).astype(np.uint8)


def choose_palette(exponent_counts: np.ndarray, palette_size: int) -> list[int]:
    """The palette: the most frequent exponents that occur, by count descending, then value
    ascending."""
    counts = np.asarray(exponent_counts, np.int64)
    order = np.lexsort((np.arange(256), -counts))  # last key is the primary one
    return [int(e) for e in order[:palette_size] if counts[e] > 0]


def symbol_table(palette: list[int] | tuple[int, ...]) -> np.ndarray:
    """int16[256]: the palette index of each exponent value, NOT_IN_PALETTE for the others."""
    table = np.full(256, NOT_IN_PALETTE, np.int16)
    table[np.asarray(palette, np.int64)] = np.arange(len(palette), dtype=np.int16)
    return table


def chunk_slices(layout: Layout) -> list[tuple[int, int]]:
    """Chunk ranges [k0, k1) of whole groups, each about SLICE_WEIGHTS weights (for bounded
    memory)."""
    group_weights = layout.chunks_per_group * layout.chunk_size
    step = max(1, SLICE_WEIGHTS // group_weights) * layout.chunks_per_group
    return [(k0, min(k0 + step, layout.n_chunks)) for k0 in range(0, layout.n_chunks, step)]


def find_verbatim_chunks(
    exponent: np.ndarray, symbol_of: np.ndarray, layout: Layout, palette_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which chunks are verbatim, their exponent bytes, and the symbol counts of the coded chunks.

    Returns ``(verbatim, vexp, coded_counts)``: a bool per chunk, uint8 [V, chunk_size] (a short
    chunk's tail is 0), and int64 [palette_size] counts over the weights of coded chunks only
    (those are what the Huffman code is built for).
    """
    verbatim = np.zeros(layout.n_chunks, bool)
    vexp_parts = [np.zeros((0, layout.chunk_size), np.uint8)]
    coded_counts = np.zeros(palette_size, np.int64)
    for k0, k1 in chunk_slices(layout):
        exps = layout.chunk_matrix(exponent, k0, k1)
        symbols = symbol_of[exps]
        real = layout.column_mask(k0, k1)
        bad = ((symbols == NOT_IN_PALETTE) & real).any(axis=1)
        verbatim[k0:k1] = bad
        vexp_parts.append(exps[bad])
        coded_counts += np.bincount(symbols[real & ~bad[:, None]], minlength=palette_size)
    return verbatim, np.concatenate(vexp_parts), coded_counts
