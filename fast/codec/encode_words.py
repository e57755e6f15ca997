"""The encoder's fast path: four weights per int64 word, two passes, one table lookup per four weights.

``fast.codec.encode.encode`` takes this path when every row is a whole number of chunks, a chunk
holds a multiple of 4 weights, the palette has at most 16 entries and codes are at most 14 bits
(the defaults: chunks of 64, palette 16, L = 12; every 2-D weight of MiniLM). Its output is the
general path's, byte for byte. Eager torch makes one pass over memory per operation and pays a
few microseconds per call, so the work is laid out as few operations as possible, each over as
few bytes as possible, in blocks of whole groups that stay in cache, on preallocated buffers.

Pass 1 (per block; sm bytes, palette indices, verbatim chunks):

* **sm bytes**: ``s = b & 0x807F; s |= s >> 8`` on int16 (the arithmetic shift carries the sign
  into bit 7), then a narrowing copy to uint8 keeps the low byte.
* **Lanes**: four consecutive weights are one int64 word; ``(w >> 7) & 0x00FF00FF00FF00FF`` puts
  their exponents in four 16-bit lanes, and every later step keeps each lane to itself, so one
  int64 operation does four weights' work.
* **Palette indices**: when the palette is the 16 consecutive exponents ``[base, base + 16)``
  (trained weights: nearly always; guessed from a sample, checked after the pass) a subtraction
  of ``base`` in the int16 view turns each lane into ``exponent - base``, which is below 16 iff
  the exponent is in the palette. Other palettes map each pair of exponents through a 65,536-entry
  table to two lanes (palette index, or NOT_IN_PALETTE = 0x100 outside the palette).
* **Verbatim chunks**: ``lanes & 0x7FF0FFF0FFF0FFF0`` is 0 iff all four lanes are palette indices,
  and never negative, so its maximum over a chunk's words (``amax``, several times faster than
  ``!=`` or ``any``) is 0 iff the chunk is coded.
* **Pair bytes**: ``lanes | lanes >> 12`` puts ``s0 | s1 << 4`` in byte 0 and ``s2 | s3 << 4`` in
  byte 4; a narrowing copy of the int32 view to uint8 keeps exactly those two bytes. The result,
  one byte per two weights, read as int16, is the 16-bit quad index ``s0 | s1 << 4 | s2 << 8 |
  s3 << 12``, and ``bincount`` of the bytes (256 bins) gives the symbol counts.

Pass 2 (per block; the bit stream):

* **Codes**: one lookup in a 65,536-entry table gives a quad's four codes concatenated
  (right-aligned, at most 56 bits) and their total length, as ``code << 6 | length``. Verbatim
  chunks' quads are set to 0: they emit nothing, so the stream needs no compaction.
* **Bit packing**: an inclusive prefix sum of the lengths gives each quad's end bit ``e``. Its
  code ends in 64-bit word ``e >> 6`` (MSB first): ``code << (64 - (e & 63))`` is its part there
  and ``code >> (e & 63)`` its part in the word before (non-zero only if it straddles). That word
  is where the previous quad ends, so the part is ORed into the previous quad's and one
  ``index_add_`` writes all words (codes never overlap: adding is OR). Slot 0 of each block's
  buffers is a dummy quad (length = the block's start bit, code 0), so the prefix sum starts at
  the right bit and the block's first quad has a "previous quad" too.

int64 addition is avoided where a bitwise operation does (on this CPU an int64 ``+=`` costs about
three ``|=``), and large CPU buffers come from NumPy (``_empty``).
"""

from __future__ import annotations

import functools
import threading
from operator import itemgetter

import numpy as np
import torch

from fast.codec.forms import HuffmanForm
from fast.codec.words import stream_from_words64
from fast.errors import KernelInputError
from reference.codec.huffman import canonical_codes, code_lengths
from reference.codec.layout import Layout
from reference.codec.palette import choose_palette, symbol_table

LANES = 0x0001_0001_0001_0001  # 1 in each 16-bit lane
EXPONENTS = 0x00FF * LANES  # the exponent bits of four weights, after w >> 7
CHECK = 0x7FF0_FFF0_FFF0_FFF0  # lane bits that are 0 iff the lane is < 16 (bit 63 left out: the result is >= 0)
QUAD_MAX_CODE_LENGTH = 14  # this path's limit (the format's is 16): four codes of <= 14 bits, << 6, fit an int64
SAMPLE = 1 << 13  # weights the palette guess looks at
BLOCK_WEIGHTS = 1 << 19  # default block size (encode passes its own BLOCK_WEIGHTS)


def applies(g: Layout, palette_size: int, max_code_length: int) -> bool:
    """Whether the fast path handles these parameters (else the general path runs)."""
    return (g.n > 0 and g.chunk_size % 4 == 0 and g.cols % g.chunk_size == 0 and palette_size <= 16
            and max_code_length <= QUAD_MAX_CODE_LENGTH)


def fast_code_lengths(counts: np.ndarray, max_length: int) -> list[int]:
    """``reference.codec.huffman.code_lengths``, the same package-merge, with lighter bookkeeping.

    An entry's symbols are kept as one integer with a 5-bit count per symbol (a symbol occurs at
    most once per level, so at most max_length <= 16 times); merging is a stable sort, singles
    listed first, which puts a single before a package of equal value as the reference does.
    """
    counts = [int(c) for c in counts]
    used = [s for s, c in enumerate(counts) if c > 0]
    if len(used) <= 2 or min(counts) < 0 or not 1 <= max_length <= 16 or len(used) > 2**max_length:
        return code_lengths(counts, max_length)  # trivial cases and errors: the reference's words
    singles = sorted((counts[s], 1 << (5 * s)) for s in used)  # by count, then symbol
    current = singles
    for _ in range(max_length - 1):
        packages = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(current[0::2], current[1::2], strict=False)]
        current = sorted(singles + packages, key=itemgetter(0))
    total = sum(entry[1] for entry in current[: 2 * len(used) - 2])
    return [(total >> (5 * s)) & 31 for s in range(len(counts))]


def _empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, except that a large CPU buffer is allocated by NumPy.

    NumPy asks the kernel for transparent huge pages (``madvise``) for arrays of 4 MiB and more,
    torch.empty gets 4 KiB pages, and touching fresh memory page by page costs more than a pass
    of this encoder (measured here: 11.7 MB first touched in ~5 ms, under 1 ms with huge pages).
    """
    if device.type != "cpu" or n * dtype.itemsize < 1 << 22:
        return torch.empty(n, dtype=dtype, device=device)
    return torch.from_numpy(np.empty(n * dtype.itemsize, np.uint8)).view(dtype)


_workspace = threading.local()  # per thread: CPU scratch buffers kept between calls, by name
WORKSPACE_LIMIT = 1 << 24  # bytes of one kept buffer; larger ones are allocated per call


def _scratch(name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scratch buffer of n elements, on the CPU reused across calls (fresh pages cost a page fault
    each; torch's CUDA allocator already reuses its blocks)."""
    nbytes = n * dtype.itemsize
    if nbytes > WORKSPACE_LIMIT or device.type != "cpu":
        return _empty(n, dtype, device)
    key = (name, str(device))
    buffers = _workspace.__dict__.setdefault("buffers", {})
    buf = buffers.get(key)
    if buf is None or buf.numel() < nbytes:
        buf = buffers[key] = _empty(max(nbytes, 1 << 16), torch.uint8, device)
    return buf[:nbytes].view(dtype)


def _guess_base(bits: torch.Tensor, palette_size: int) -> int | None:
    """The start of the 16 consecutive exponents most common in a sample (None unless palette_size is 16).

    A guess only: the pass it sets up yields the exact exponent counts, which check it.
    """
    if palette_size != 16:
        return None
    sample = (bits[:: max(1, bits.numel() // SAMPLE)] >> 7).to(torch.uint8)
    cum = np.concatenate([[0], np.cumsum(torch.bincount(sample, minlength=256).cpu().numpy())])
    return int(np.argmax(cum[16:] - cum[:-16]))


class _Work:
    """The tensor's words, cut into blocks of whole groups, and the buffers the passes reuse."""

    def __init__(self, bits: torch.Tensor, g: Layout, block_weights: int) -> None:
        device = bits.device
        self.g, self.bits, self.words = g, bits, bits.view(torch.int64)
        self.words_per_chunk = g.chunk_size // 4
        self.words_per_group = self.words_per_chunk * g.chunks_per_group
        n_words = g.n // 4
        size = n_words if device.type != "cpu" else (  # one block on a GPU: no per-block sync
            max(1, block_weights // (4 * self.words_per_group)) * self.words_per_group)
        size = min(size, n_words)
        self.ranges = [(a, min(a + size, n_words)) for a in range(0, n_words, size)]
        self.sm = _empty(g.n, torch.uint8, device)  # an output: fresh memory
        self.pairs = _scratch("pairs", g.n // 2, torch.uint8, device)  # s0 | s1 << 4 per two weights
        self.chunk_max = _scratch("chunk_max", g.n_chunks, torch.int64, device)  # 0 iff the chunk is coded
        # per block: 4 int64 rows of size + 1 (slot 0 is pass 2's dummy quad) and an int32 index row
        self.rows = _scratch("rows", 4 * (size + 1), torch.int64, device).view(4, size + 1)
        self.index = _scratch("index", size, torch.int32, device)

    def lanes_to_pairs(self, lanes: torch.Tensor, a: int, b: int) -> None:
        """Palette-index lanes of words [a, b) -> their verbatim test and their pair bytes."""
        temp = self.rows[1, : b - a]
        wpc = self.words_per_chunk
        torch.amax(torch.bitwise_and(lanes, CHECK, out=temp).view(-1, wpc), 1, out=self.chunk_max[a // wpc: b // wpc])
        lanes |= torch.bitwise_right_shift(lanes, 12, out=temp)  # s0 | s1 << 4 in byte 0, s2 | s3 << 4 in byte 4
        self.pairs[2 * a: 2 * b].copy_(lanes.view(torch.int32))  # the low byte of each int32

    def sign_mantissa(self, a: int, b: int) -> None:
        """The sm bytes of words [a, b)."""
        s = torch.bitwise_and(self.bits[4 * a: 4 * b], -32641, out=self.rows[0, : b - a].view(torch.int16))  # 0x807F
        s |= torch.bitwise_right_shift(s, 8, out=self.rows[1, : b - a].view(torch.int16))  # the sign to bit 7
        self.sm[4 * a: 4 * b].copy_(s)  # the low byte


def _pass_consecutive(work: _Work, base: int, sm: bool = True) -> None:
    """Pass 1 for the palette [base, base + 16): sm bytes, pair bytes (exponent - base), verbatim test."""
    for a, b in work.ranges:
        if sm:
            work.sign_mantissa(a, b)
        lanes = torch.bitwise_right_shift(work.words[a:b], 7, out=work.rows[2, : b - a])
        lanes &= EXPONENTS
        lanes.view(torch.int16).sub_(base)  # a 16-bit lane wraps alone: below 16 iff in the palette
        work.lanes_to_pairs(lanes, a, b)


def _pass_pairs(work: _Work, palette_size: int, palette: list[int] | None) -> tuple[np.ndarray | None, list[int]]:
    """Pass 1 for any palette: exponent pairs (counted, and the palette chosen, unless it is given)
    mapped to lanes by a table of all 65,536 pairs. Computes the sm bytes too when it counts.

    Returns the exponent counts over the whole tensor (None if the palette was given) and the palette.
    """
    device = work.bits.device
    pairs = _scratch("exponent_pairs", 2 * work.words.numel(), torch.int32, device)  # e0 | e1 << 8 per 2 weights
    for a, b in work.ranges:
        if palette is None:
            work.sign_mantissa(a, b)
        lanes = torch.bitwise_right_shift(work.words[a:b], 7, out=work.rows[2, : b - a])
        lanes &= EXPONENTS
        lanes |= torch.bitwise_right_shift(lanes, 8, out=work.rows[1, : b - a])  # per int32: e0 | e1 << 8, junk above
        torch.bitwise_and(lanes.view(torch.int32), 0xFFFF, out=pairs[2 * a: 2 * b])
    counts = None
    if palette is None:
        h = torch.bincount(pairs, minlength=65536).view(256, 256)  # [e1, e0]
        counts = (h.sum(0) + h.sum(1)).cpu().numpy()
        palette = choose_palette(counts, palette_size)
    lane = symbol_table(palette).astype(np.int64)  # exponent -> palette index, NOT_IN_PALETTE outside
    table = torch.from_numpy((lane[None, :] | lane[:, None] << 16).reshape(-1).astype(np.int32)).to(device)
    for a, b in work.ranges:
        lanes = work.rows[2, : b - a]
        torch.index_select(table, 0, pairs[2 * a: 2 * b], out=lanes.view(torch.int32))
        work.lanes_to_pairs(lanes, a, b)
    return counts, palette


@functools.lru_cache(maxsize=64)
def _quad_table_cpu(codes: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """int64 [65536]: entry of quad ``p01 | p23 << 8`` (p = s_even | s_odd << 4) = its 4 codes << 6 | length."""
    c = torch.zeros(16, dtype=torch.int64)
    ln = torch.zeros(16, dtype=torch.int64)
    c[: len(codes)], ln[: len(lengths)] = torch.tensor(codes, dtype=torch.int64), torch.tensor(lengths)
    pc = ((c[None, :] << ln[:, None]) | c[:, None]).reshape(-1)  # pair s0 | s1 << 4, indexed [s1, s0]
    pl = (ln[None, :] + ln[:, None]).reshape(-1)
    # quad [p23, p01]: (pc01 << pl23 | pc23) << 6 | (pl01 + pl23), as (pc01 << (pl23 + 6) | (pc23 << 6 | pl23)) + pl01
    return (((pc[None, :] << (pl + 6)[:, None]) | ((pc << 6) | pl)[:, None]) + pl[None, :]).reshape(-1)


def _pack(work: _Work, table: torch.Tensor, vchunks: torch.Tensor, stream_bits: int) -> tuple[torch.Tensor, list]:
    """Pass 2: the stream as 64-bit words (MSB first) and, per block, the end bits of its groups."""
    device = work.bits.device
    words = _scratch("words", stream_bits // 64 + 2, torch.int64, device).zero_()
    wpc, wpg = work.words_per_chunk, work.words_per_group
    quad_index = work.pairs.view(torch.int16)  # p01 | p23 << 8, as int16 (negative from 0x8000 on)
    vsplit = torch.searchsorted(vchunks, torch.tensor([b for _, b in work.ranges], device=device) // wpc).tolist()
    code, end, word, high = work.rows[0], work.rows[1], work.rows[2], work.rows[3]
    code[0] = 0
    ends, position, v0 = [], 0, 0
    for (a, b), v1 in zip(work.ranges, vsplit, strict=True):
        m = b - a
        c, e, w, h = code[: m + 1], end[: m + 1], word[: m + 1], high[: m + 1]
        index = work.index[:m]
        index.copy_(quad_index[a:b])  # sign-extends ...
        index &= 0xFFFF  # ... so keep the low 16 bits
        entry = torch.index_select(table, 0, index, out=c[1:])
        if v1 > v0:  # verbatim chunks: their quads emit nothing
            entry.view(-1, wpc)[vchunks[v0:v1] - a // wpc] = 0
        torch.bitwise_and(entry, 63, out=w[1:])  # the lengths
        entry >>= 6  # c[1:] = the codes
        w[0] = position
        torch.cumsum(w, 0, out=e)  # e[k] = end bit of quad k (k >= 1), e[0] = start of the block
        ends.append(e[wpg::wpg].clone())  # the end bit of each group
        position = int(e[m])
        torch.bitwise_right_shift(e, 6, out=w)  # the word each quad ends in ...
        e &= 63  # ... and how many of its bits the quad fills
        torch.bitwise_right_shift(c, e, out=h)  # the part in the word before
        e ^= 63
        c <<= e  # c << (64 - (e & 63)) in two steps, as a shift by 64 must give 0
        c <<= 1
        c[:-1] |= h[1:]  # quad k+1's part in the word before goes with quad k (which ends there)
        words.index_add_(0, w, c)
        c[0] = 0
        v0 = v1
    if position != stream_bits:
        raise AssertionError(f"encode: packed {position} bits, expected {stream_bits}")
    return words, ends


def _verbatim(work: _Work) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """vchunks (the chunks pass 1 found not coded), vexp, and the count of each exponent in vexp."""
    g = work.g
    vchunks = torch.nonzero(work.chunk_max[: g.n_chunks]).flatten()
    vexp = (work.bits.view(g.n_chunks, g.chunk_size).index_select(0, vchunks) >> 7).to(torch.uint8)
    return vchunks, vexp, torch.bincount(vexp.reshape(-1), minlength=256).cpu().numpy()


def encode_words(bits: torch.Tensor, g: Layout, max_code_length: int, palette_size: int,
                 block_weights: int = BLOCK_WEIGHTS) -> HuffmanForm:
    """The Huffman form of a tensor's int16 bits (flat, contiguous) on the fast path (``applies``)."""
    device = bits.device
    if bits.storage_offset() % 4:  # the int64 view needs 8-byte alignment
        bits = bits.clone()
    work = _Work(bits, g, block_weights)

    base = _guess_base(bits, palette_size)
    if base is not None:  # pass 1 for the palette [base, base + 16), then its exact counts
        _pass_consecutive(work, base)
        vchunks, vexp, in_verbatim = _verbatim(work)
        pair_counts = torch.bincount(work.pairs, minlength=256)  # [s1, s0] over all pairs ...
        if vchunks.numel():  # ... less those of the verbatim chunks (not symbols)
            pair_counts -= torch.bincount(work.pairs.view(g.n_chunks, -1).index_select(0, vchunks).reshape(-1),
                                          minlength=256)
        h = pair_counts.view(16, 16)
        coded = (h.sum(0) + h.sum(1)).cpu().numpy()  # exponent base + j, over the coded chunks
        counts = in_verbatim.copy()  # outside [base, base + 16) exponents occur in verbatim chunks only
        counts[base: base + 16] += coded
        palette = choose_palette(counts, palette_size)
        if sorted(palette) != list(range(base, base + 16)):  # a wrong guess (the sm bytes are done)
            if len(palette) == 16 and max(palette) - min(palette) == 15:  # ... but consecutive: again
                base = min(palette)
                _pass_consecutive(work, base, sm=False)
                vchunks, vexp, in_verbatim = _verbatim(work)
            else:  # map the exponents to this palette by pair table
                _pass_pairs(work, palette_size, palette)
                base = None
        if base is not None:
            nibble_symbol = [palette.index(base + j) for j in range(16)]
            sym_counts = counts[palette] - in_verbatim[palette]  # over the coded chunks
    else:
        counts, palette = _pass_pairs(work, palette_size, None)
    if base is None:
        vchunks, vexp, in_verbatim = _verbatim(work)
        sym_counts = counts[palette] - in_verbatim[palette]
        nibble_symbol = list(range(len(palette)))
    lengths = fast_code_lengths(sym_counts, max_code_length)
    codes = canonical_codes(lengths)
    stream_bits = int(np.dot(sym_counts, np.asarray(lengths, np.int64)))
    if stream_bits >= 1 << 32:
        raise KernelInputError(f"encode: the stream of {stream_bits} bits exceeds the format's 2^32 - 1 limit")
    table = _quad_table_cpu(tuple(codes[i] for i in nibble_symbol), tuple(lengths[i] for i in nibble_symbol))
    words, ends = _pack(work, table.to(device), vchunks, stream_bits)
    tail = [torch.tensor([stream_bits], device=device)] if g.n_chunks % g.chunks_per_group else []
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), *ends, *tail])
    stream = stream_from_words64(words, stream_bits, _scratch("half", words.numel(), torch.int64, device))
    return HuffmanForm(layout=g, max_code_length=max_code_length, palette=palette, code_lengths=lengths, sm=work.sm,
                       stream=stream, stream_bits=stream_bits, offsets=offsets, vchunks=vchunks, vexp=vexp)
