"""The encoder: bf16 tensor -> Huffman form (and palette form), on CPU or GPU.

It produces, byte for byte, what the reference encoder produces (FORMAT.md sections 2 and 3).
``encode`` picks one of three implementations:

* on the CPU, the C encoder (``encode_c.py``, ``native/encode.c``): three loops over the
  tensor, built on first use with the system C compiler. Eager torch cannot match ZipNN's speed
  on a CPU (``encode_c.py`` says why); this can, by a wide margin;
* else (a GPU, or no C compiler), when rows are whole chunks, chunks a multiple of 4 weights, the
  palette at most 16 and L at most 14 (the defaults, and every 2-D weight of MiniLM): the torch
  fast path (``encode_words.py``: four weights per int64 word, two blocked passes);
* else the general torch path in this file (``encode_general``), in a handful of whole-tensor passes,
  each a function of its own (``_pass_histogram``, ``_pass_verbatim``, ``_code_lengths``, ``_pass_pack``):

1. split each bf16 into its exponent and sign/mantissa bytes (int16 arithmetic);
2. histogram the exponents and pick the palette; give every weight a 4-bit symbol. When the
   palette is 16 consecutive exponents (the usual case in trained weights) the symbol is simply
   ``exponent - smallest`` and an exponent outside the palette shows as a value >= 16; otherwise a
   256-entry table maps exponents to palette indices (255 = none, ``symbol_bytes``). The tables of step 4 are
   indexed by these stored symbols, so both cases share the rest;
3. a chunk is verbatim iff one of its symbols is >= 16: viewed as int64, eight symbols are tested at
   once against 0xF0F0...F0;
4. four consecutive symbols form a 16-bit "quad" index; one lookup in a 65,536-entry table gives the
   four concatenated codes (left-aligned in an int64) and their total length. A verbatim chunk's
   quads get length 0: nothing is removed, so the stream needs no compaction;
5. an inclusive prefix sum of the quad lengths gives every quad's bit position: its code goes into
   one or two 64-bit words (``index_add_``: the bits never overlap, so adding is OR).

Group offsets are read off the same prefix sum at each group's first quad. Tensors whose chunk
lengths are not multiples of 4 (or palettes of more than 16 entries) use single symbols instead of
quads; rows whose length is not a multiple of chunk_size are gathered chunk by chunk first.
torch's elementwise ops are used with care: ``torch.where``, ``clamp_max`` and boolean-mask
indexing are several times slower on CPU than shifts, masks and ``index_select``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from fast.bf16 import split_sm_exponent
from fast.codec import encode_c, encode_words
from fast.codec.forms import HuffmanForm, PaletteForm
from fast.codec.words import stream_from_words64
from fast.errors import KernelInputError
from reference.codec.codec import CHUNK_SIZE, CHUNKS_PER_GROUP, MAX_CODE_LENGTH, PALETTE_SIZE, check_parameters
from reference.codec.errors import CodecError
from reference.codec.huffman import canonical_codes, code_lengths
from reference.codec.layout import Layout
from reference.codec.palette import NOT_IN_PALETTE, choose_palette, symbol_table

HIGH_NIBBLES = -0x0F0F0F0F0F0F0F10  # 0xF0F0F0F0F0F0F0F0 as int64: any of 8 packed symbols >= 16
_LOW_MASK = torch.tensor([-1] + [(1 << (64 - o)) - 1 for o in range(1, 64)], dtype=torch.int64)


def symbol_bytes(palette: list[int]) -> np.ndarray:
    """uint8[256]: the palette index of each exponent; an exponent outside the palette (NOT_IN_PALETTE)
    gets 255, which is above every index whenever some exponent is left out (the palette then has < 256)."""
    return np.minimum(symbol_table(palette), 255).astype(np.uint8)


def _check_input(x: torch.Tensor, chunk_size: int, chunks_per_group: int, palette_size: int,
                 max_code_length: int) -> None:
    """The reference encoder's checks (``reference.codec.codec.check_parameters``), as KernelInputError."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise KernelInputError(f"encode: expected a torch.bfloat16 tensor, got {got}")
    try:
        check_parameters(Layout(tuple(x.shape), chunk_size, chunks_per_group), palette_size, max_code_length)
    except CodecError as e:
        raise KernelInputError(f"encode: {e}") from None


def _chunk_matrix(values: torch.Tensor, g: Layout, fill: int) -> torch.Tensor:
    """Per-weight values as a [n_chunks, chunk_size] matrix (a view when the rows are aligned)."""
    if g.cols % g.chunk_size == 0:
        return values.view(g.n_chunks, g.chunk_size)
    padded = torch.full((g.rows, g.chunks_per_row * g.chunk_size), fill, dtype=values.dtype, device=values.device)
    padded[:, : g.cols] = values.view(g.rows, g.cols)
    return padded.view(g.n_chunks, g.chunk_size)


def _chunk_lengths(g: Layout, device: torch.device) -> torch.Tensor:
    """int64 [n_chunks]: weights in each chunk (chunk_size, less for a row's short last chunk)."""
    lengths = torch.full((g.rows, g.chunks_per_row), g.chunk_size, dtype=torch.int64, device=device)
    if g.chunks_per_row:
        lengths[:, -1] = g.cols - (g.chunks_per_row - 1) * g.chunk_size
    return lengths.reshape(-1)


@functools.lru_cache(maxsize=64)
def _unit_tables(codes: tuple[int, ...], lengths: tuple[int, ...], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Code (left-aligned in an int64) and length of every k-tuple (k = 1 or 4) of stored symbols.

    ``codes[j]``/``lengths[j]`` belong to stored symbol j (length 0 = never coded). For k = 4 the
    first symbol sits in the lowest nibble of the 16-bit tuple index; for k = 1 the index is the symbol.
    """
    bits = 8 if k == 1 else 4
    c = np.zeros(1 << bits, np.int64)
    ln = np.zeros(1 << bits, np.int64)
    c[: len(codes)], ln[: len(lengths)] = codes, lengths
    if k == 4:  # pairs (index s0 | s1 << 4), then quads (pair0 | pair1 << 8)
        s0, s1 = np.arange(256) & 15, np.arange(256) >> 4
        pc, pl = (c[s0] << ln[s1]) | c[s1], ln[s0] + ln[s1]
        p0, p1 = np.arange(65536) & 255, np.arange(65536) >> 8
        c, ln = (pc[p0] << pl[p1]) | pc[p1], pl[p0] + pl[p1]
    left = (c.astype(np.uint64) << (64 - ln).astype(np.uint64)) * (ln > 0)  # top `length` bits hold the code
    return left.view(np.int64), ln


def _units(sym: torch.Tensor, k: int, code_t: torch.Tensor, len_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(left-aligned code, length) of each run of k symbols (k = 4: four nibbles -> one 16-bit index)."""
    if k == 4:  # four symbols (< 16) are the bytes of one int32; s0 goes to the low nibble
        quads = sym.contiguous().view(torch.int32)
        unit = (quads & 0xF) | ((quads >> 4) & 0xF0) | ((quads >> 8) & 0xF00) | ((quads >> 12) & 0xF000)
    else:
        unit = sym.to(torch.int32)
    return code_t.index_select(0, unit), len_t.index_select(0, unit)


def _pack_into(words: torch.Tensor, code: torch.Tensor, length: torch.Tensor, first_bit: int) -> torch.Tensor:
    """OR consecutive left-aligned codes into 64-bit words (MSB first) from bit ``first_bit`` on.

    A code starting at bit o of word w puts ``code >>> o`` (an arithmetic shift, then a mask) into
    word w and ``code << (64 - o)`` into word w + 1 (0 unless the code crosses the word boundary).
    Returns each code's starting bit.
    """
    ends = torch.cumsum(length, 0) + first_bit
    starts = ends - length
    if starts.numel():
        w = starts >> 6
        o = starts & 63
        high = (code >> o) & _LOW_MASK.to(words.device).index_select(0, o)
        low = (code << (63 - o)) << 1  # two shifts: a shift by 64 is undefined
        words.index_add_(0, w, high)  # bits never overlap: adding is OR (and wraps like uint64)
        words.index_add_(0, w + 1, low)
    return starts


BLOCK_WEIGHTS = 1 << 20  # per-weight work runs in blocks of about this many weights (cache-sized temporaries)


def encode(x: torch.Tensor, chunk_size: int = CHUNK_SIZE, chunks_per_group: int = CHUNKS_PER_GROUP,
           palette_size: int = PALETTE_SIZE, max_code_length: int = MAX_CODE_LENGTH, *,
           with_palette_form: bool = False,
           native: bool | None = None) -> HuffmanForm | tuple[HuffmanForm, PaletteForm]:
    """Compress a bf16 tensor into the Huffman form (FORMAT.md), identical to the reference encoder's output.

    With ``with_palette_form=True`` also returns the palette form. Three implementations give the same
    bytes: on the CPU the C encoder (``encode_c``; ``native=None`` uses it when it can be built,
    ``False`` never, ``True`` always or raises), else the torch fast path (``encode_words``: rows of
    whole chunks, palettes of <= 16, L <= 14) or the general torch path (``encode_general``).
    """
    _check_input(x, chunk_size, chunks_per_group, palette_size, max_code_length)
    device = x.device
    g = Layout(tuple(x.shape), chunk_size, chunks_per_group)
    bits = x.contiguous().reshape(-1).view(torch.int16) if g.n else torch.zeros(0, dtype=torch.int16, device=device)
    if native or (native is None and device.type == "cpu" and g.n and encode_c.library() is not None):
        if device.type != "cpu" or not g.n:
            raise KernelInputError(f"encode: the C encoder takes a non-empty CPU tensor, got {tuple(x.shape)} "
                                   f"on {device}")
        form = encode_c.encode_c(bits, g, max_code_length, palette_size)
    elif encode_words.applies(g, palette_size, max_code_length):  # the usual case: see encode_words.py
        form = encode_words.encode_words(bits, g, max_code_length, palette_size, BLOCK_WEIGHTS)
    else:
        form = encode_general(bits, g, max_code_length, palette_size)
    if not with_palette_form:
        return form
    exponent = (bits >> 7).to(torch.uint8).to(torch.int32)
    sym = torch.from_numpy(symbol_bytes(form.palette)).to(device).index_select(0, exponent)
    return form, palette_form_from_symbols(g, form.palette, sym, form.sm, form.vchunks, form.vexp)


def encode_general(bits: torch.Tensor, g: Layout, max_code_length: int, palette_size: int) -> HuffmanForm:
    """The general torch path (any layout, palette, L): the passes of this file's docstring, in blocks."""
    blocks = _blocks(g)
    sm, counts = _pass_histogram(bits, g, blocks)
    palette = choose_palette(counts, palette_size)
    stored = _StoredSymbols(bits, palette)
    vchunks, vexp = _pass_verbatim(bits, g, blocks, stored, counts, palette)
    lengths, stream_bits = _code_lengths(g, counts, palette, vchunks, vexp, max_code_length)
    words, offsets = _pass_pack(g, blocks, stored, vchunks, lengths, stream_bits)
    return HuffmanForm(layout=g, max_code_length=max_code_length, palette=palette, code_lengths=lengths, sm=sm,
                       stream=stream_from_words64(words, stream_bits), stream_bits=stream_bits, offsets=offsets,
                       vchunks=vchunks, vexp=vexp)


def _blocks(g: Layout) -> list[tuple[int, int]]:
    """Flat ranges of about BLOCK_WEIGHTS weights, whole groups each (one block if rows hold short chunks)."""
    group_weights = g.chunks_per_group * g.chunk_size
    block = max(1, BLOCK_WEIGHTS // group_weights) * group_weights if g.aligned else max(g.n, 1)
    return [(s, min(s + block, g.n)) for s in range(0, g.n, block)]


def _pass_histogram(bits: torch.Tensor, g: Layout, blocks: list[tuple[int, int]]) -> tuple[torch.Tensor, np.ndarray]:
    """Pass 1: the sm byte of every weight, and the exponent histogram (256 counts)."""
    sm = torch.empty(g.n, dtype=torch.uint8, device=bits.device)
    counts = torch.zeros(256, dtype=torch.int64, device=bits.device)
    for s0, s1 in blocks:
        exponent, sm[s0:s1] = split_sm_exponent(bits[s0:s1])
        counts += torch.bincount(exponent, minlength=256)
    return sm, counts.cpu().numpy()


class _StoredSymbols:
    """The 'stored symbol' of each weight: exponent - base when the palette is 16 consecutive exponents
    (the usual case in trained weights: one subtraction), else the palette index from a table (255
    outside). Either way a symbol below the palette size is in the palette; ``palette_index_of`` maps
    stored symbols back to palette indices (NOT_IN_PALETTE for the others)."""

    def __init__(self, bits: torch.Tensor, palette: list[int]):
        self.bits, self.p = bits, len(palette)
        consecutive = self.p == 16 and max(palette) - min(palette) == 15
        self.base = min(palette) if consecutive else None
        if self.base is not None:
            symbol_of = symbol_table(palette).astype(np.int64)
            self.palette_index_of = np.append(symbol_of[self.base: self.base + 16], [NOT_IN_PALETTE] * 240)
        else:
            self.palette_index_of = np.arange(256)
        self.table = torch.from_numpy(symbol_bytes(palette)).to(bits.device)

    def __call__(self, s0: int, s1: int) -> torch.Tensor:
        """uint8 stored symbols of weights [s0, s1)."""
        exponent = (self.bits[s0:s1] >> 7).to(torch.uint8)
        if self.base is not None:
            return exponent - self.base  # uint8 arithmetic wraps: exponents outside the palette become >= 16
        return self.table.index_select(0, exponent.to(torch.int32))


def _pass_verbatim(bits: torch.Tensor, g: Layout, blocks: list[tuple[int, int]], stored: _StoredSymbols,
                   counts: np.ndarray, palette: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 2: the verbatim chunks (holding an exponent outside the palette) and their exponent bytes."""
    device, cs, p = bits.device, g.chunk_size, stored.p
    vchunks = torch.zeros(0, dtype=torch.int64, device=device)
    if counts.sum() > counts[palette].sum():  # else the palette covers every exponent: no chunk is verbatim
        found = []
        for s0, s1 in blocks:
            chunks = _chunk_matrix(stored(s0, s1), Layout((s1 - s0,), cs), 0) if g.aligned \
                else _chunk_matrix(stored(s0, s1), g, fill=0)
            if p <= 16 and cs % 8 == 0:  # 8 stored symbols per int64: is any >= 16?
                is_verbatim = ((chunks.view(torch.int64) & HIGH_NIBBLES) != 0).any(dim=1)
            else:
                is_verbatim = chunks.amax(dim=1) >= p  # stored symbols: < p in the palette, 255 outside
            found.append(torch.nonzero(is_verbatim).flatten() + s0 // cs)
        vchunks = torch.cat(found)
    if not vchunks.numel():
        return vchunks, torch.zeros((0, cs), dtype=torch.uint8, device=device)
    if g.aligned:
        return vchunks, (bits.view(g.n_chunks, cs).index_select(0, vchunks) >> 7).to(torch.uint8)
    return vchunks, _chunk_matrix((bits >> 7).to(torch.uint8), g, fill=0).index_select(0, vchunks).contiguous()


def _code_lengths(g: Layout, counts: np.ndarray, palette: list[int], vchunks: torch.Tensor, vexp: torch.Tensor,
                  max_code_length: int) -> tuple[list[int], int]:
    """Code lengths from the symbol counts over coded chunks (all counts less the verbatim chunks'), and B."""
    if not palette:
        return [], 0
    sym_counts = counts[palette]
    if vchunks.numel():
        in_v = torch.bincount(vexp.reshape(-1), minlength=256).cpu().numpy()
        if not g.aligned:  # the zero tails of short verbatim chunks are not weights
            last_in_row = int((vchunks % g.chunks_per_row == g.chunks_per_row - 1).sum())
            in_v[0] -= (g.chunk_size - g.cols % g.chunk_size) * last_in_row
        sym_counts = sym_counts - in_v[palette]
    lengths = code_lengths(sym_counts, max_code_length)
    stream_bits = int(np.dot(np.asarray(sym_counts, np.int64), np.asarray(lengths, np.int64)))
    if stream_bits >= 1 << 32:
        raise KernelInputError(f"encode: the stream of {stream_bits} bits exceeds the format's 2^32 - 1 limit")
    return lengths, stream_bits


def _pass_pack(g: Layout, blocks: list[tuple[int, int]], stored: _StoredSymbols, vchunks: torch.Tensor,
               lengths: list[int], stream_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 3: the coded symbols in stream order, k at a time, as (code, length) units, packed into
    int64 words (MSB first); and the group offsets, read off the units' bit positions."""
    device, cs, cpg, p = stored.bits.device, g.chunk_size, g.chunks_per_group, stored.p
    codes = canonical_codes(lengths)
    k = 4 if (p <= 16 and cs % 4 == 0 and (g.cols % cs) % 4 == 0) else 1
    index_of = stored.palette_index_of
    in_palette = [index_of[j] < p for j in range(16 if k == 4 else 256)]
    code_t, len_t = (torch.from_numpy(t).to(device) for t in _unit_tables(
        tuple(codes[index_of[j]] if ok else 0 for j, ok in enumerate(in_palette)),
        tuple(lengths[index_of[j]] if ok else 0 for j, ok in enumerate(in_palette)), k))
    words = torch.zeros(stream_bits // 64 + 2, dtype=torch.int64, device=device)
    group_starts, position = [], 0
    for s0, s1 in blocks:
        if g.aligned:  # all chunks in order; a verbatim chunk's units get length 0
            unit_code, unit_len = _units(stored(s0, s1), k, code_t, len_t)
            units_per_chunk = cs // k
            c0, c1 = s0 // cs, s1 // cs
            local = vchunks[torch.searchsorted(vchunks, c0): torch.searchsorted(vchunks, c1)] - c0
            if local.numel():
                unit_len.view(-1, units_per_chunk)[local] = 0
                unit_code.view(-1, units_per_chunk)[local] = 0
            group_first = torch.arange(0, unit_len.numel(), cpg * units_per_chunk, device=device)
        else:  # short chunks (one block): gather the real, coded weights' symbols first
            keep = torch.arange(cs, device=device)[None, :] < _chunk_lengths(g, device)[:, None]
            keep[vchunks] = False
            unit_code, unit_len = _units(_chunk_matrix(stored(s0, s1), g, fill=0)[keep], k, code_t, len_t)
            units = torch.sum(keep, dim=1) // k
            group_first = (torch.cumsum(units, 0) - units)[::cpg]
        starts = _pack_into(words, unit_code, unit_len, position)
        position += int(unit_len.sum())
        group_starts.append(torch.cat([starts, torch.tensor([position], device=device)])[group_first])
    offsets = torch.cat([*group_starts, torch.tensor([stream_bits], dtype=torch.int64, device=device)])
    return words, offsets


def palette_form_from_symbols(g: Layout, palette: list[int], sym: torch.Tensor, sm: torch.Tensor,
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
    return PaletteForm(layout=g, palette=pal, idx=idx, sm=sm.view(g.rows, g.cols), vchunks=vchunks, vexp=vexp,
                       row_vstart=row_vstart, n_palette=len(palette))
