"""Huffman form -> bf16 (and -> palette form: the transcode done once at load), in Triton.

Parallel decoding from the format's start offsets (FORMAT.md 3.5): every group of chunks starts at
a known bit position, so each group is decoded independently. One lane of a Triton program owns
one group and walks its chunks in order, one symbol per step: peek L bits from a two-word window,
look the window up in the decoding table (symbol | length << 8), advance by the length. Verbatim
chunks take their exponents from ``vexp`` and consume no bits. The same kernel either assembles
bf16 bits (MODE 0) or writes the palette index of each weight (MODE 1, the transcode; verbatim
weights get 0). Every lane checks that it ends exactly at the next group's offset and that it hit
no invalid table entry; the wrapper raises CodecError otherwise.

Limits of this layout: lanes write scattered addresses (a group is 2,048 weights apart from its
neighbour), so the stores do not coalesce. The Huffman form is the storage form; inference reads
the palette form, decoded by ``palette_triton`` or fused into the matmul.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from fast.codec.forms import HuffmanForm, PaletteForm
from fast.codec.words import stream_windows
from fast.errors import KernelInputError
from fast.triton_util import cdiv, check_kernel_device, on_interpreter
from fast.validate import check_tensor
from reference.codec.errors import CodecError
from reference.codec.huffman import check_lengths, decode_table


@triton.jit
def _huffman_kernel(windows_ptr, last_word, offsets_ptr, gvstart_ptr, vchunks_ptr, n_verbatim, sm_ptr, lut_ptr, out_ptr,
                    status_ptr, n_groups, n_chunks, cols, chunks_per_row,
                    CS: tl.constexpr, G: tl.constexpr, L: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """One lane per group. MODE 0: bf16 bits of coded weights (verbatim chunks are left to
    ``_verbatim_kernel``); MODE 1: palette index of every weight, 0 in verbatim chunks.
    The table entry is ``value | length << 8`` with value = exponent (MODE 0) or symbol (MODE 1).
    ``windows[i]`` is stream words i and i + 1 as one 64-bit integer: one load peeks any L bits."""
    first = tl.program_id(0) * BLOCK
    lane = first + tl.arange(0, BLOCK)
    valid = lane < n_groups
    pos = tl.load(offsets_ptr + lane, mask=valid, other=0)
    end = tl.load(offsets_ptr + lane + 1, mask=valid, other=0)
    vptr = tl.load(gvstart_ptr + lane, mask=valid, other=0)
    bad = tl.zeros([BLOCK], dtype=tl.int1)
    n_steps = tl.minimum(n_chunks - first.to(tl.int64) * G, G)  # chunks in the program's fullest group
    for ci in range(0, n_steps):
        chunk = lane.to(tl.int64) * G + ci
        cvalid = valid & (chunk < n_chunks)
        col0 = (chunk % chunks_per_row) * CS
        start = (chunk // chunks_per_row) * cols + col0
        clen = tl.minimum(cols - col0, CS)
        has_v = cvalid & (vptr < n_verbatim)
        is_v = has_v & (tl.load(vchunks_ptr + vptr, mask=has_v, other=-1) == chunk)
        coded_chunk = cvalid & (~is_v)
        sm_row = sm_ptr + start
        out_row = out_ptr + start
        for w in range(0, tl.minimum(cols, CS)):
            coded = coded_chunk & (w < clen)
            word = tl.minimum(pos >> 5, last_word)  # a corrupt stream may run on; never read past the end
            window = tl.load(windows_ptr + word, mask=coded, other=0).to(tl.uint64, bitcast=True)
            peek = ((window << (pos & 31).to(tl.uint64)) >> (64 - L)).to(tl.int64)
            entry = tl.load(lut_ptr + peek, mask=coded, other=0)
            length = entry >> 8  # 0 where not coded (other=0) or on an invalid window
            bad = bad | (coded & (length == 0))
            pos += length
            if MODE == 0:
                s = tl.load(sm_row + w, mask=coded, other=0).to(tl.int32)
                bits = ((s & 0x80) << 8) | ((entry & 0xFF) << 7) | (s & 0x7F)
                tl.store(out_row + w, bits.to(tl.int16), mask=coded)
            else:
                tl.store(out_row + w, tl.where(is_v, 0, entry & 0xFF).to(tl.uint8), mask=cvalid & (w < clen))
        vptr += is_v.to(tl.int64)
    bad = bad | (valid & (pos != end))
    tl.store(status_ptr + lane, bad.to(tl.int32), mask=valid)


@triton.jit
def _verbatim_kernel(vchunks_ptr, n_verbatim, vexp_ptr, sm_ptr, out_ptr, cols, chunks_per_row,
                     CS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr):
    """bf16 bits of the verbatim chunks: exponent from vexp, sign/mantissa from sm."""
    v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    vmask = v < n_verbatim
    chunk = tl.load(vchunks_ptr + v, mask=vmask, other=0)
    col0 = (chunk % chunks_per_row) * CS
    start = (chunk // chunks_per_row) * cols + col0
    mask = vmask[:, None] & (w[None, :] < tl.minimum(cols - col0, CS)[:, None])
    e = tl.load(vexp_ptr + v[:, None].to(tl.int64) * CS + w[None, :], mask=mask, other=0).to(tl.int32)
    offs = start[:, None] + w[None, :]
    s = tl.load(sm_ptr + offs, mask=mask, other=0).to(tl.int32)
    tl.store(out_ptr + offs, (((s & 0x80) << 8) | (e << 7) | (s & 0x7F)).to(tl.int16), mask=mask)


def lookup_table(form: HuffmanForm, exponents: bool) -> torch.Tensor:
    """The decoding table, int32 entries ``value | length << 8`` (length 0 = invalid window).

    value is the palette index (the symbol), or with ``exponents`` the exponent it stands for.
    """
    check_lengths(form.code_lengths, form.max_code_length)
    sym, length = decode_table(form.code_lengths, form.max_code_length)
    value = sym.astype(np.int32)
    if exponents and form.palette:
        value = np.asarray(form.palette, dtype=np.int32)[value]
    return torch.from_numpy((value | (length.astype(np.int32) << 8)).astype(np.int64)).to(form.device)


def _check_form(form: HuffmanForm) -> None:
    g = form.layout
    want = {
        "sm": (form.sm, torch.uint8, (g.n,)),
        "stream": (form.stream, torch.int32, ((form.stream_bits + 31) // 32 + 1,)),
        "offsets": (form.offsets, torch.int64, (g.n_groups + 1,)),
        "vchunks": (form.vchunks, torch.int64, (form.vchunks.shape[0],)),
        "vexp": (form.vexp, torch.uint8, (form.vchunks.shape[0], g.chunk_size)),
    }
    for name, (t, dtype, shape) in want.items():
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise KernelInputError(f"Huffman form: {name} must be a contiguous {dtype} tensor of shape {shape}, "
                                   f"got {got}")
        check_kernel_device(t, f"Huffman form {name}")
        if t.device != form.sm.device:
            raise KernelInputError(f"Huffman form: {name} is on {t.device}, sm on {form.sm.device}")
    if len(form.palette) != len(form.code_lengths):
        raise KernelInputError("Huffman form: palette and code_lengths differ in length")
    v = form.vchunks
    if v.numel() and (bool((v[1:] <= v[:-1]).any()) or int(v[0]) < 0 or int(v[-1]) >= g.n_chunks):
        raise CodecError("vchunks must be strictly increasing chunk ids below n_chunks")
    o = form.offsets
    if int(o[0]) != 0 or int(o[-1]) != form.stream_bits or bool((o[1:] < o[:-1]).any()):
        raise CodecError("offsets must start at 0, end at stream_bits and never decrease")


def _run(form: HuffmanForm, mode: int, block: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    _check_form(form)
    g = form.layout
    device = form.device
    if out is not None:  # checked by the caller: contiguous, the tensor's shape, bf16/int16 (mode 0) or uint8
        out = out.view(torch.int16 if mode == 0 else torch.uint8).view(-1)
    else:
        out = torch.empty(g.n, dtype=torch.int16 if mode == 0 else torch.uint8, device=device)
    if g.n == 0:
        return out
    lut = lookup_table(form, exponents=(mode == 0))
    gvstart = torch.searchsorted(form.vchunks, torch.arange(g.n_groups, device=device) * g.chunks_per_group)
    status = torch.zeros(g.n_groups, dtype=torch.int32, device=device)
    vch = form.vchunks if form.vchunks.numel() else torch.full((1,), -1, dtype=torch.int64, device=device)
    if block is None:  # the interpreter pays per step, not per lane: one wide program
        block = 4096 if on_interpreter() else 64
    block = min(block, triton.next_power_of_2(g.n_groups))
    windows = stream_windows(form.stream)
    if windows.numel() == 0:  # an empty stream (every chunk verbatim)
        windows = torch.zeros(1, dtype=torch.int64, device=device)
    _huffman_kernel[(cdiv(g.n_groups, block),)](
        windows, max(form.stream.numel() - 2, 0), form.offsets, gvstart, vch, form.vchunks.numel(), form.sm,
        lut, out, status, g.n_groups, g.n_chunks, g.cols, g.chunks_per_row,
        CS=g.chunk_size, G=g.chunks_per_group, L=form.max_code_length, MODE=mode, BLOCK=block)
    bad = torch.nonzero(status).flatten()
    if bad.numel():
        raise CodecError(f"corrupt Huffman stream: {bad.numel()} of {g.n_groups} groups do not decode to their "
                         f"offsets (first: group {int(bad[0])})")
    v = form.vchunks.numel()
    if mode == 0 and v:
        block_w = min(triton.next_power_of_2(g.chunk_size), 256)
        block_v = max(1, 4096 // block_w)
        _verbatim_kernel[(cdiv(v, block_v), cdiv(g.chunk_size, block_w))](
            form.vchunks, v, form.vexp, form.sm, out, g.cols, g.chunks_per_row,
            CS=g.chunk_size, BLOCK_V=block_v, BLOCK_W=block_w)
    return out


def decode_huffman(form: HuffmanForm, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a Huffman-form tensor to torch.bfloat16 (same shape), bit for bit; into ``out`` if given."""
    if out is not None:
        check_tensor(out, "out", dtype=(torch.bfloat16, torch.int16), shape=form.shape, device=form.device)
    return _run(form, mode=0, out=out).view(torch.bfloat16).view(form.shape)


def transcode(form: HuffmanForm, symbols_out: torch.Tensor | None = None) -> PaletteForm:
    """Huffman form -> palette form (FORMAT.md section 5), decoding the stream with the Triton kernel.
    ``symbols_out`` (uint8, the tensor's shape): where the kernel writes each weight's palette index
    (conformance cases pass a buffer with guard cells around it)."""
    if symbols_out is not None:
        check_tensor(symbols_out, "symbols_out", dtype=torch.uint8, shape=form.shape, device=form.device)
    if len(form.palette) > 16:
        raise KernelInputError(f"the palette form needs a palette of at most 16 entries, this one has "
                               f"{len(form.palette)}")
    from fast.codec.encode import palette_form_from_symbols

    sym = _run(form, mode=1, out=symbols_out)
    return palette_form_from_symbols(form.layout, form.palette, sym, form.sm, form.vchunks, form.vexp)
