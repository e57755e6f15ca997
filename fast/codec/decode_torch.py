"""Plain torch (no Triton) versions of the transcode and the palette decode, for CPU and GPU.

They are vectorised the way the reference decoder is: all groups of a tensor decode in lockstep,
step t decoding symbol t of every group at once with a few whole-array operations. The Triton
kernels are the fast path on a GPU; these serve where Triton cannot run natively (a CPU without
the interpreter) and as a second, independent implementation in the conformance suite.
"""

from __future__ import annotations

import numpy as np
import torch

from fast.bf16 import join_sm_exponent
from fast.codec.encode import palette_form_from_symbols
from fast.codec.forms import HuffmanForm, PaletteForm
from fast.codec.words import stream_windows
from fast.errors import KernelInputError
from reference.codec.errors import CodecError
from reference.codec.huffman import check_lengths, decode_table


def coded_per_group(form: HuffmanForm) -> torch.Tensor:
    """int64 [n_groups]: how many coded weights (symbols) each group holds."""
    g = form.layout
    dev = form.device
    per_chunk = torch.full((g.n_chunks,), g.chunk_size, dtype=torch.int64, device=dev)
    short = g.cols - (g.chunks_per_row - 1) * g.chunk_size
    if g.n_chunks:
        per_chunk[g.chunks_per_row - 1:: g.chunks_per_row] = short
        per_chunk[form.vchunks] = 0
    pad = g.n_groups * g.chunks_per_group - g.n_chunks
    return torch.nn.functional.pad(per_chunk, (0, pad)).view(g.n_groups, g.chunks_per_group).sum(1)


def decode_symbols_torch(form: HuffmanForm) -> torch.Tensor:
    """The palette index of every coded weight, in stream order (uint8), decoding all groups in lockstep."""
    check_lengths(form.code_lengths, form.max_code_length)
    dev = form.device
    counts = coded_per_group(form)
    total = int(counts.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.uint8, device=dev)
    sym_t, len_t = decode_table(form.code_lengths, form.max_code_length)
    table_sym = torch.from_numpy(sym_t).to(dev)
    table_len = torch.from_numpy(np.where(len_t == 0, 1 << 40, len_t.astype(np.int64))).to(dev)
    windows = stream_windows(form.stream)  # words i and i + 1: any L bits are one gather away
    order = torch.argsort(counts, descending=True, stable=True)  # active groups form a prefix
    pos = form.offsets[:-1][order].clone()
    sorted_counts = counts[order]
    first = torch.cumsum(counts, 0) - counts  # where each group's symbols go in the output
    out_at = first[order]
    steps = int(sorted_counts[0])
    active = torch.searchsorted(-sorted_counts, -torch.arange(steps, device=dev), right=False).tolist()
    out = torch.empty(total, dtype=torch.uint8, device=dev)
    drop = 64 - form.max_code_length
    mask = (1 << form.max_code_length) - 1
    last = windows.numel() - 1
    for t in range(steps):
        k = active[t]
        p = pos[:k]
        window = windows[torch.clamp(p >> 5, max=last)]
        entry = ((window << (p & 31)) >> drop) & mask  # arithmetic shift: the mask drops the sign bits
        out[out_at[:k] + t] = table_sym[entry]
        pos[:k] = p + table_len[entry]
    bad = torch.nonzero(pos != form.offsets[1:][order]).flatten()
    if bad.numel():
        raise CodecError(f"corrupt Huffman stream: {bad.numel()} groups do not end at their offsets "
                         f"(first: group {int(order[bad[0]])})")
    return out


def transcode_torch(form: HuffmanForm) -> PaletteForm:
    """Huffman form -> palette form in plain torch (the same result as the Triton ``transcode``)."""
    if len(form.palette) > 16:
        raise KernelInputError(f"the palette form needs a palette of at most 16 entries, this one has "
                               f"{len(form.palette)}")
    g = form.layout
    symbols = decode_symbols_torch(form)
    sym = torch.zeros(g.n, dtype=torch.uint8, device=form.device)
    sym[coded_mask(form)] = symbols
    return palette_form_from_symbols(g, form.palette, sym, form.sm, form.vchunks, form.vexp)


def coded_mask(form: HuffmanForm) -> torch.Tensor:
    """bool [n]: which weights are coded (not in a verbatim chunk), in C order."""
    g = form.layout
    is_v = torch.zeros(g.n_chunks, dtype=torch.bool, device=form.device)
    is_v[form.vchunks] = True
    per_weight = is_v.view(g.rows, g.chunks_per_row).repeat_interleave(g.chunk_size, dim=1)[:, : g.cols]
    return ~per_weight.reshape(-1)


def decode_palette_torch(form: PaletteForm) -> torch.Tensor:
    """Palette form -> torch.bfloat16 in plain torch, bit for bit."""
    form.check()
    g = form.layout
    idx = form.idx.to(torch.int32)
    nib = torch.stack([idx & 0xF, idx >> 4], dim=-1).view(g.rows, 2 * idx.shape[1])[:, : g.cols]
    exponent = form.palette.to(torch.int32)[nib]
    if form.vchunks.numel():
        v = form.vchunks
        rows, j = v // g.chunks_per_row, v % g.chunks_per_row
        cols = j[:, None] * g.chunk_size + torch.arange(g.chunk_size, device=form.device)
        real = cols < g.cols
        exponent[rows[:, None].expand_as(cols)[real], cols[real]] = form.vexp.to(torch.int32)[real]
    return join_sm_exponent(form.sm, exponent).view(torch.bfloat16).view(g.shape)
