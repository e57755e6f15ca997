"""Between the reference's NumPy forms (reference.codec) and fast/'s torch forms (fast.codec.forms).

uint32 arrays cross as int32 views (``stream``) or widened to int64 (``offsets``, ``vchunks``,
``row_vstart``); going back they become uint32 again, so the two sides can be compared byte for byte.
"""

from __future__ import annotations

import numpy as np
import torch

from fast.codec.forms import HuffmanForm, PaletteForm
from reference.codec import CompressedTensor, PaletteTensor
from reference.codec.format import crc32
from reference.codec.layout import Layout


def huffman_from_reference(ct: CompressedTensor, device: str | torch.device = "cpu") -> HuffmanForm:
    """The reference's CompressedTensor as a HuffmanForm on ``device`` (call ``ct.check()`` first)."""
    def t(a: np.ndarray, dtype: np.dtype | None = None) -> torch.Tensor:
        a = np.array(a if dtype is None else a.astype(dtype), order="C")  # a copy: file arrays are read-only
        return torch.from_numpy(a).to(device)

    return HuffmanForm(
        layout=Layout(tuple(ct.shape), ct.chunk_size, ct.chunks_per_group),
        max_code_length=ct.max_code_length, palette=list(ct.palette), code_lengths=list(ct.code_lengths),
        sm=t(ct.sm), stream=t(ct.stream.view(np.int32)), stream_bits=ct.stream_bits,
        offsets=t(ct.offsets, np.int64), vchunks=t(ct.vchunks, np.int64), vexp=t(ct.vexp),
        extra={"crc32": dict(ct.crc), "name": ct.name},
    )


def huffman_to_reference(form: HuffmanForm, data_crc: int | None = None, name: str = "") -> CompressedTensor:
    """A HuffmanForm as the reference's CompressedTensor (CRCs computed here; ``data_crc`` of the bf16 bytes)."""
    g = form.layout
    ct = CompressedTensor(
        shape=tuple(g.shape), chunk_size=g.chunk_size, chunks_per_group=g.chunks_per_group,
        max_code_length=form.max_code_length, palette=tuple(form.palette), code_lengths=tuple(form.code_lengths),
        stream_bits=form.stream_bits, crc={}, sm=form.sm.cpu().numpy(),
        stream=form.stream.cpu().numpy().view(np.uint32), offsets=form.offsets.cpu().numpy().astype(np.uint32),
        vchunks=form.vchunks.cpu().numpy().astype(np.uint32), vexp=form.vexp.cpu().numpy(), name=name,
    )
    if data_crc is None:
        data_crc = form.extra.get("crc32", {}).get("data", 0)
    ct.crc = {key: crc32(a) for key, a in ct.arrays().items()} | {"data": int(data_crc)}
    return ct


def palette_from_reference(pt: PaletteTensor, device: str | torch.device = "cpu") -> PaletteForm:
    """The reference's PaletteTensor as a PaletteForm on ``device``."""
    def t(a: np.ndarray, dtype: np.dtype | None = None) -> torch.Tensor:
        a = np.array(a if dtype is None else a.astype(dtype), order="C")
        return torch.from_numpy(a).to(device)

    return PaletteForm(
        layout=Layout(tuple(pt.shape), pt.chunk_size), palette=t(pt.palette), idx=t(pt.idx), sm=t(pt.sm),
        vchunks=t(pt.vchunks, np.int64), vexp=t(pt.vexp), row_vstart=t(pt.row_vstart, np.int64),
        n_palette=pt.palette_size,
    )


def palette_arrays(form: PaletteForm) -> dict[str, np.ndarray]:
    """The palette form's arrays with the reference's dtypes (uint8 / uint32), for byte comparisons."""
    return {
        "palette": form.palette.cpu().numpy(), "idx": form.idx.cpu().numpy(), "sm": form.sm.cpu().numpy(),
        "vchunks": form.vchunks.cpu().numpy().astype(np.uint32), "vexp": form.vexp.cpu().numpy(),
        "row_vstart": form.row_vstart.cpu().numpy().astype(np.uint32),
        "palette_size": np.array([form.n_palette], np.int64),
    }


def reference_palette_arrays(pt: PaletteTensor) -> dict[str, np.ndarray]:
    """The same dict for the reference's PaletteTensor."""
    return {"palette": pt.palette, "idx": pt.idx, "sm": pt.sm, "vchunks": pt.vchunks, "vexp": pt.vexp,
            "row_vstart": pt.row_vstart, "palette_size": np.array([pt.palette_size], np.int64)}


def huffman_arrays(form: HuffmanForm | CompressedTensor) -> dict[str, np.ndarray]:
    """Every byte of a Huffman form (the five arrays and the header's numbers), with the reference's dtypes."""
    if isinstance(form, HuffmanForm):
        form = huffman_to_reference(form)
    header = np.array([form.chunk_size, form.chunks_per_group, form.max_code_length, form.stream_bits,
                       len(form.vchunks), *form.shape], np.int64)
    return {**form.arrays(), "palette": np.array(form.palette, np.int64),
            "code_lengths": np.array(form.code_lengths, np.int64), "header numbers": header}
