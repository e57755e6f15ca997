"""A vectorised torch encoder: bf16 tensor -> Huffman form (and palette form), on CPU or GPU.

It produces, byte for byte, what the reference encoder produces (FORMAT.md sections 2 and 3),
but in a handful of whole-tensor passes instead of loops:

1. split each bf16 into its exponent and sign/mantissa bytes (uint8 arithmetic on the two bytes);
2. histogram the exponents, pick the palette, map every exponent to its palette index (255 = none);
3. a chunk is verbatim iff its largest index is 255 (one ``amax`` over a [chunks, chunk_size] view);
4. drop the verbatim chunks (a row selection), pack the remaining symbols four at a time into a
   16-bit "quad" and look up the quad's concatenated code and length in a 65,536-entry table;
5. an exclusive prefix sum of the quad lengths gives every quad's bit position: its code goes into
   one or two 64-bit words at that position (``index_add_``: the bits never overlap, so adding is OR).

Group offsets are read off the same prefix sum, at the quads where each group's coded chunks
start. Tensors whose chunk lengths are not multiples of 4 (or palettes of more than 16 entries)
use single symbols instead of quads; non-aligned rows (columns not a multiple of chunk_size) are
padded per row first.
"""

from __future__ import annotations

import numpy as np
import torch

from fast.codec.forms import Geometry, HuffmanForm, PaletteForm
from fast.errors import KernelInputError
from reference.codec.huffman import canonical_codes, code_lengths

NONE = 255  # "not in the palette" in the uint8 symbol map (palettes of up to 16 entries)


def split_bytes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exponent, sign/mantissa) uint8 tensors of a bf16 tensor, flat, C order."""
    if x.numel() == 0:
        empty = torch.zeros(0, dtype=torch.uint8, device=x.device)
        return empty, empty.clone()
    pairs = x.reshape(-1).view(torch.uint8).view(-1, 2)  # little-endian: [low byte, high byte]
    lo, hi = pairs[:, 0], pairs[:, 1]
    exponent = ((hi & 0x7F) << 1) | (lo >> 7)
    sm = (hi & 0x80) | (lo & 0x7F)
    return exponent, sm


def choose_palette(counts: np.ndarray, palette_size: int) -> list[int]:
    """The most frequent exponent values that occur, by count descending then value ascending."""
    used = np.flatnonzero(counts)
    order = used[np.lexsort((used, -counts[used]))]
    return [int(v) for v in order[:palette_size]]


def _check_input(x: torch.Tensor, chunk_size: int, chunks_per_group: int, palette_size: int,
                 max_code_length: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise KernelInputError(f"encode: expected a torch.bfloat16 tensor, got {got}")
    if not 1 <= chunk_size <= 4096 or not 1 <= chunks_per_group <= 65536:
        raise KernelInputError(f"encode: chunk_size must be 1..4096 and chunks_per_group 1..65536, "
                               f"got {chunk_size}, {chunks_per_group}")
    if not 1 <= palette_size <= 256 or not 1 <= max_code_length <= 16:
        raise KernelInputError(f"encode: palette_size must be 1..256 and max_code_length 1..16, "
                               f"got {palette_size}, {max_code_length}")


def _chunk_matrix(sym: torch.Tensor, g: Geometry, fill: int) -> torch.Tensor:
    """Per-weight values as a [n_chunks, chunk_size] matrix (a view when the rows are aligned)."""
    if g.cols % g.chunk_size == 0:
        return sym.view(g.n_chunks, g.chunk_size)
    padded = torch.full((g.rows, g.chunks_per_row * g.chunk_size), fill, dtype=sym.dtype, device=sym.device)
    padded[:, : g.cols] = sym.view(g.rows, g.cols)
    return padded.view(g.n_chunks, g.chunk_size)


def _unit_tables(codes: list[int], lengths: list[int], k: int, bits: int, device: torch.device):
    """Code and length of every k-tuple of symbols (each symbol ``bits`` wide), concatenated."""
    size = 1 << (k * bits)
    tup = np.arange(size, dtype=np.int64)
    code = np.zeros(size, np.int64)
    length = np.zeros(size, np.int64)
    c = np.zeros(1 << bits, np.int64)
    ln = np.zeros(1 << bits, np.int64)
    c[: len(codes)], ln[: len(lengths)] = codes, lengths
    for i in range(k):  # the first symbol sits in the lowest bits of the tuple index
        s = (tup >> (bits * i)) & ((1 << bits) - 1)
        code = (code << ln[s]) | c[s]
        length += ln[s]
    return torch.from_numpy(code).to(device), torch.from_numpy(length.astype(np.int32)).to(device)


def _pack(unit_code: torch.Tensor, unit_len: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """MSB-first bit packing of consecutive codes (each <= 56 bits). Returns (int32 words, bit starts)."""
    lens64 = unit_len.to(torch.int64)
    ends = torch.cumsum(lens64, 0)
    starts = ends - lens64
    total = int(ends[-1]) if ends.numel() else 0
    n_words64 = (total + 63) // 64 + 1
    words = torch.zeros(n_words64, dtype=torch.int64, device=device)
    if total:
        w = starts >> 6
        end = (starts & 63) + lens64  # end of the code, counted from the word's MSB
        fits = end <= 64
        high = torch.where(fits, unit_code << (64 - end).clamp_min(0), unit_code >> (end - 64).clamp_min(0))
        words.index_add_(0, w, high)  # bits never overlap: adding is OR (and wraps like uint64)
        spill = ~fits
        if bool(spill.any()):
            words.index_add_(0, w[spill] + 1, unit_code[spill] << (128 - end[spill]))
    # 64-bit words, MSB first -> 32-bit words, MSB first: [high half, low half]
    words32 = words.view(torch.int32).view(-1, 2).flip(1).reshape(-1)
    return words32[: (total + 31) // 32 + 1].contiguous(), starts


def encode(x: torch.Tensor, chunk_size: int = 64, chunks_per_group: int = 32, palette_size: int = 16,
           max_code_length: int = 12, *,
           with_palette_form: bool = False) -> HuffmanForm | tuple[HuffmanForm, PaletteForm]:
    """Compress a bf16 tensor into the Huffman form (FORMAT.md), identical to the reference encoder's output.

    With ``with_palette_form=True`` also returns the palette form, built from the same pass.
    """
    _check_input(x, chunk_size, chunks_per_group, palette_size, max_code_length)
    device = x.device
    g = Geometry(tuple(x.shape), chunk_size, chunks_per_group)
    x = x.contiguous()
    exponent, sm = split_bytes(x)
    counts = torch.bincount(exponent, minlength=256).cpu().numpy() if g.n else np.zeros(256, np.int64)
    palette = choose_palette(counts, palette_size)
    p = len(palette)
    wide = p > 16  # symbols need a full byte, and "not in palette" cannot be 255 when p == 256
    symmap = np.full(256, NONE, np.uint8)
    symmap[palette] = np.arange(p)
    sym = torch.from_numpy(symmap).to(device).index_select(0, exponent.to(torch.int32)) if g.n else exponent

    # verbatim chunks: any exponent outside the palette (impossible when the palette holds all 256)
    chunks = _chunk_matrix(sym, g, fill=0)
    if p < 256 and g.n_chunks:
        is_verbatim = chunks.amax(dim=1) == NONE
        vchunks = torch.nonzero(is_verbatim).flatten()
    else:
        is_verbatim = torch.zeros(g.n_chunks, dtype=torch.bool, device=device)
        vchunks = torch.zeros(0, dtype=torch.int64, device=device)
    v = vchunks.numel()
    exps = _chunk_matrix(exponent, g, fill=0)
    vexp = exps.index_select(0, vchunks).contiguous() if v else torch.zeros((0, chunk_size), dtype=torch.uint8,
                                                                             device=device)
    coded_chunks = chunks if v == 0 else chunks[~is_verbatim]

    # symbol counts over coded chunks: all counts minus the palette exponents inside verbatim chunks
    sym_counts = counts[palette] if p else np.zeros(0, np.int64)
    if v:
        in_v = torch.bincount(vexp.reshape(-1), minlength=256).cpu().numpy()
        if g.cols % chunk_size:  # the zero tails of short verbatim chunks are not weights
            tails = (chunk_size - (g.cols % chunk_size)) * int((vchunks % g.chunks_per_row
                                                                == g.chunks_per_row - 1).sum())
            in_v[0] -= tails
        sym_counts = sym_counts - in_v[palette]
    lengths = code_lengths(sym_counts, max_code_length) if p else []
    codes = canonical_codes(lengths) if p else []

    # the coded symbols in stream order, grouped k at a time
    short = g.cols % chunk_size
    k = 4 if (not wide and chunk_size % 4 == 0 and short % 4 == 0 and max_code_length <= 14) else 1
    coded = coded_chunks.reshape(-1)
    if short:  # drop the row padding of short chunks
        keep = torch.arange(chunk_size, device=device) < torch.where(
            (torch.arange(g.n_chunks, device=device) % g.chunks_per_row) == g.chunks_per_row - 1, short, chunk_size
        )[:, None]
        coded = coded[(keep if v == 0 else keep[~is_verbatim]).reshape(-1)]
    if k == 4:
        quads = coded.view(-1, 4).to(torch.int32)
        unit = quads[:, 0] | (quads[:, 1] << 4) | (quads[:, 2] << 8) | (quads[:, 3] << 12)
        code_t, len_t = _unit_tables(codes, lengths, 4, 4, device)
    else:
        unit = coded.to(torch.int32)
        code_t, len_t = _unit_tables(codes, lengths, 1, 8, device)
    stream, starts = _pack(code_t.index_select(0, unit), len_t.index_select(0, unit), device)
    stream_bits = int(starts[-1] + len_t[unit[-1]]) if unit.numel() else 0
    if stream_bits >= 1 << 32:
        raise KernelInputError(f"encode: the stream of {stream_bits} bits exceeds the format's 2^32 - 1 limit")

    # group offsets: the stream position where each group's first coded chunk starts
    chunk_units = torch.full((g.n_chunks,), chunk_size // k, dtype=torch.int64, device=device)
    if short:
        chunk_units[g.chunks_per_row - 1:: g.chunks_per_row] = short // k
    chunk_units[vchunks] = 0
    first_unit = torch.cumsum(chunk_units, 0) - chunk_units  # units before each chunk
    group_first = first_unit[::chunks_per_group]
    ends = torch.cat([starts, torch.tensor([stream_bits], dtype=torch.int64, device=device)])
    offsets = torch.cat([ends[group_first], torch.tensor([stream_bits], dtype=torch.int64, device=device)])

    form = HuffmanForm(g, max_code_length, palette, lengths, sm, stream, stream_bits, offsets, vchunks, vexp)
    if not with_palette_form:
        return form
    return form, palette_form_from_symbols(g, palette, sym, sm, vchunks, vexp)


def palette_form_from_symbols(g: Geometry, palette: list[int], sym: torch.Tensor, sm: torch.Tensor,
                              vchunks: torch.Tensor, vexp: torch.Tensor) -> PaletteForm:
    """Assemble the palette form from per-weight palette indices (any value in verbatim chunks)."""
    device = sm.device
    if len(palette) > 16:
        raise KernelInputError(f"the palette form needs a palette of at most 16 entries, this one has {len(palette)}")
    nib = sym.view(g.rows, g.cols).clone() if g.n else torch.zeros((g.rows, g.cols), dtype=torch.uint8, device=device)
    if vchunks.numel():  # verbatim weights get nibble 0
        nib_chunks = _chunk_matrix(nib.reshape(-1), g, fill=0)  # a view of nib when the rows are aligned
        nib_chunks[vchunks] = 0
        if g.cols % g.chunk_size:
            nib = nib_chunks.view(g.rows, -1)[:, : g.cols]
    if g.cols % 2:
        nib = torch.cat([nib, torch.zeros((g.rows, 1), dtype=torch.uint8, device=device)], dim=1)
    idx = (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()
    pal = torch.zeros(16, dtype=torch.uint8, device=device)
    pal[: len(palette)] = torch.tensor(palette, dtype=torch.uint8)
    row_vstart = torch.searchsorted(vchunks, torch.arange(g.rows + 1, device=device) * g.chunks_per_row)
    return PaletteForm(g, pal, idx, sm.view(g.rows, g.cols), vchunks, vexp, row_vstart, n_palette=len(palette))
