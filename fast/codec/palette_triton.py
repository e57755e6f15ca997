"""Palette form -> bf16 in Triton, and the tile loader the fused matmul shares.

``palette_tile`` decodes one [rows x columns] tile of a palette-form tensor in registers
(FORMAT.md section 4, "A tile"): the 4-bit index of each weight picks its exponent from the
16-entry palette, the sm byte gives sign and mantissa; then the verbatim chunks that overlap the
tile overwrite their exponents from ``vexp``. Each row carries a pointer ``vptr`` into ``vchunks``
(its next verbatim chunk that ends past the tile's first column), so a row's verbatim chunks are
visited once as the tile walks along the row: in the common case (no verbatim chunk in the tile)
the check is one gathered load per row and no patch.

``decode_palette`` runs the tile loader over the whole tensor: each program owns a block of rows
and walks along their columns (optionally split into column ranges: the starting pointers of each
range come from a ``searchsorted`` on the host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.codec.forms import PaletteForm
from fast.triton_util import DeviceProps, cdiv, check_kernel_device, device_props, on_interpreter
from fast.validate import check_tensor


@triton.jit
def palette_tile(idx_ptr, sm_ptr, palette_ptr, vchunks_ptr, vexp_ptr, rows, row_ok, c0, cols, c_end, half_cols,
                 n_cols, chunks_per_row, vptr, vend, CS: tl.constexpr, NV_ITERS: tl.constexpr):
    """bf16 bits (int32) of the tile rows x cols, and the rows' advanced verbatim pointers.

    ``rows`` [BR] and ``cols = c0 + arange(BC)`` are int64 indices; columns at or past ``c_end`` read as 0.
    ``vptr``/``vend`` [BR]: the row's next verbatim slot (its chunk ends past ``cols[0]``) and the
    end of the row's slots. A tile overlaps at most NV_ITERS = ceil(BC / CS) + 1 chunks of a row.
    """
    mask = row_ok[:, None] & (cols < c_end)[None, :]
    byte = tl.load(idx_ptr + rows[:, None] * half_cols + (cols >> 1)[None, :], mask=mask, other=0).to(tl.int32)
    nib = (byte >> ((cols & 1) * 4).to(tl.int32)[None, :]) & 0xF
    e = tl.load(palette_ptr + nib, mask=mask, other=0).to(tl.int32)
    s = tl.load(sm_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0).to(tl.int32)
    c1 = c0 + cols.shape[0]
    for _ in tl.static_range(NV_ITERS):
        has = row_ok & (vptr < vend)
        chunk = tl.load(vchunks_ptr + vptr, mask=has, other=0)
        start = (chunk - rows * chunks_per_row) * CS  # the chunk's first column
        hit = has & (start < c1)
        if tl.max(hit.to(tl.int32)) > 0:
            inside = hit[:, None] & mask & (cols[None, :] >= start[:, None]) & (cols[None, :] < start[:, None] + CS)
            ve = tl.load(vexp_ptr + vptr[:, None] * CS + (cols[None, :] - start[:, None]), mask=inside, other=0)
            e = tl.where(inside, ve.to(tl.int32), e)
        vptr += (hit & (start + CS <= c1)).to(tl.int64)  # consumed when it ends inside the tile
    return ((s & 0x80) << 8) | (e << 7) | (s & 0x7F), vptr


@triton.jit
def _palette_decode_kernel(idx_ptr, sm_ptr, palette_ptr, vchunks_ptr, vexp_ptr, vstart_ptr, row_vstart_ptr, out_ptr,
                           n_rows, n_cols, half_cols, chunks_per_row, cols_per_split,
                           CS: tl.constexpr, NV_ITERS: tl.constexpr, SPLITS: tl.constexpr,
                           BR: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR).to(tl.int64)
    split = tl.program_id(1)
    row_ok = rows < n_rows
    vptr = tl.load(vstart_ptr + rows * SPLITS + split, mask=row_ok, other=0)
    vend = tl.load(row_vstart_ptr + rows + 1, mask=row_ok, other=0)
    c_begin = split.to(tl.int64) * cols_per_split
    c_end = tl.minimum(c_begin + cols_per_split, n_cols)
    for c0 in range(c_begin, c_end, BC):
        cols = c0 + tl.arange(0, BC).to(tl.int64)
        bits, vptr = palette_tile(idx_ptr, sm_ptr, palette_ptr, vchunks_ptr, vexp_ptr, rows, row_ok, c0, cols, c_end,
                                  half_cols, n_cols, chunks_per_row, vptr, vend, CS, NV_ITERS)
        mask = row_ok[:, None] & (cols < c_end)[None, :]
        tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], bits.to(tl.int16), mask=mask)


def split_vstart(form: PaletteForm, cols_per_split: int, splits: int) -> torch.Tensor:
    """int64 [R, splits]: for each row and column range, the first verbatim slot whose chunk ends past
    the range's first column (= searchsorted(vchunks, r * cpr + first_col // chunk_size))."""
    g = form.layout
    r = torch.arange(g.rows, device=form.device)[:, None] * g.chunks_per_row
    first_chunk = (torch.arange(splits, device=form.device) * cols_per_split // g.chunk_size)[None, :]
    return torch.searchsorted(form.vchunks, (r + first_chunk).reshape(-1)).view(g.rows, splits).contiguous()


def check_palette_form(form: PaletteForm) -> None:
    """Shapes and dtypes of every array (PaletteForm.check) and that kernels can read them here."""
    form.check()
    for name in ("palette", "idx", "sm", "vchunks", "vexp", "row_vstart"):
        check_kernel_device(getattr(form, name), f"palette form {name}")


def kernel_arrays(form: PaletteForm) -> tuple[torch.Tensor, torch.Tensor]:
    """vchunks and vexp as kernels take them (a 1-element dummy when there are no verbatim chunks)."""
    if form.vchunks.numel():
        return form.vchunks, form.vexp
    dev = form.device
    return torch.full((1,), -1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.uint8, device=dev)


def _splits(rows: int, cols: int, br: int, bc: int) -> int:
    """Column ranges per row block: enough programs (about 512) to fill a GPU when there are few rows."""
    return max(1, min(cdiv(cols, 4 * bc), cdiv(512, cdiv(rows, br))))


def decode_config(rows: int, cols: int, props: DeviceProps | None) -> tuple[int, int, int]:
    """(block_rows, block_cols, splits) ``decode_palette`` picks: a pure function of the shape and the GPU
    (``props``); None means the interpreter (few, wide steps: it pays per operation, not per element)."""
    if props is None:
        return min(64, triton.next_power_of_2(max(rows, 1))), 256, 1
    br, bc = 8, 256
    return br, bc, _splits(rows, cols, br, bc)


def decode_palette(form: PaletteForm, block_rows: int | None = None, block_cols: int | None = None,
                   splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a palette-form tensor to torch.bfloat16 (same shape), bit for bit; into ``out`` if given."""
    check_palette_form(form)
    g = form.layout
    if out is not None:
        check_tensor(out, "out", dtype=(torch.bfloat16, torch.int16), shape=g.shape, device=form.device)
        out = out.view(torch.int16).view(g.rows, g.cols)
    else:
        out = torch.empty((g.rows, g.cols), dtype=torch.int16, device=form.device)
    if g.n == 0:
        return out.view(torch.bfloat16).view(g.shape)
    auto = decode_config(g.rows, g.cols, None if on_interpreter() else device_props(form.device))
    br, bc = block_rows or auto[0], block_cols or auto[1]
    if splits is None:
        splits = 1 if on_interpreter() else _splits(g.rows, g.cols, br, bc)
    cols_per_split = cdiv(cdiv(g.cols, splits), bc) * bc
    splits = cdiv(g.cols, cols_per_split)
    vstart = split_vstart(form, cols_per_split, splits)
    vchunks, vexp = kernel_arrays(form)
    _palette_decode_kernel[(cdiv(g.rows, br), splits)](
        form.idx, form.sm, form.palette, vchunks, vexp, vstart, form.row_vstart, out,
        g.rows, g.cols, form.idx.shape[1], g.chunks_per_row, cols_per_split,
        CS=g.chunk_size, NV_ITERS=cdiv(bc, g.chunk_size) + 1, SPLITS=splits, BR=br, BC=bc)
    return out.view(torch.bfloat16).view(g.shape)
