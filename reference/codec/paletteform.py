"""The palette form (FORMAT.md section 4) and the transcode between it and the Huffman form.

The palette form is what inference uses: every weight has a fixed-size slot, a 4-bit palette
index and its sign/mantissa byte, so a kernel tile can find its weights by arithmetic alone.
Verbatim chunks are listed per row (``row_vstart``) so a tile finds the few it must patch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reference.codec.codec import CHUNKS_PER_GROUP, MAX_CODE_LENGTH, encode
from reference.codec.errors import CodecError
from reference.codec.format import CompressedTensor, crc32
from reference.codec.layout import Layout
from reference.codec.lockstep import decode_symbols, place_chunks

PALETTE_FORM_SLOTS = 16


@dataclass
class PaletteTensor:
    """A bf16 tensor in palette form. Arrays are plain NumPy, ready to hand to a kernel."""

    shape: tuple[int, ...]
    chunk_size: int
    palette_size: int  # P <= 16; palette[P:] is zero padding
    palette: np.ndarray  # uint8 [16]
    idx: np.ndarray  # uint8 [R, ceil(C / 2)]: low nibble = even column
    sm: np.ndarray  # uint8 [R, C]
    vchunks: np.ndarray  # uint32 [V]
    vexp: np.ndarray  # uint8 [V, chunk_size]
    row_vstart: np.ndarray  # uint32 [R + 1]
    name: str = ""

    @property
    def layout(self) -> Layout:
        return Layout(self.shape, self.chunk_size)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.palette, self.idx, self.sm, self.vchunks, self.vexp,
                                      self.row_vstart))


def to_palette(ct: CompressedTensor, verify: bool = True) -> PaletteTensor:
    """Huffman form -> palette form. With ``verify`` the result is checked against the data CRC."""
    ct.check()
    if len(ct.palette) > PALETTE_FORM_SLOTS:
        raise CodecError(f"tensor {ct.name!r}: a palette of {len(ct.palette)} does not fit 4-bit "
                         "indices")
    layout = ct.layout
    symbols = decode_symbols([ct])[0]
    # verbatim weights get index 0
    verbatim_nibbles = np.zeros((ct.n_verbatim, ct.chunk_size), np.uint8)
    nibbles = layout.unchunk(place_chunks(ct, symbols, verbatim_nibbles), 0, layout.n_chunks)
    palette = np.zeros(PALETTE_FORM_SLOTS, np.uint8)
    palette[: len(ct.palette)] = ct.palette
    pt = PaletteTensor(
        shape=ct.shape, chunk_size=ct.chunk_size, palette_size=len(ct.palette), palette=palette,
        idx=pack_nibbles(nibbles.reshape(layout.rows, layout.cols)),
        sm=ct.sm.reshape(layout.rows, layout.cols),
        vchunks=ct.vchunks.copy(), vexp=ct.vexp.copy(), row_vstart=row_vstart(layout, ct.vchunks),
        name=ct.name,
    )
    if verify and crc32(palette_to_bf16(pt)) != ct.crc["data"]:
        raise CodecError(f"tensor {ct.name!r}: palette form fails the data CRC-32 check (corrupt "
                         "header)")
    return pt


def from_palette(
    pt: PaletteTensor, *, chunks_per_group: int = CHUNKS_PER_GROUP,
    max_code_length: int = MAX_CODE_LENGTH
) -> CompressedTensor:
    """Palette form -> Huffman form, keeping the palette. Byte-identical to the original
    encoding."""
    bits = palette_to_bf16(pt)
    return encode(bits, chunk_size=pt.chunk_size, chunks_per_group=chunks_per_group,
                  max_code_length=max_code_length, palette=pt.palette[: pt.palette_size].tolist(),
                  name=pt.name)


def palette_to_bf16(pt: PaletteTensor) -> np.ndarray:
    """The bf16 bits of a palette-form tensor (uint16, original shape)."""
    check_palette_tensor(pt)
    layout = pt.layout
    exponent = pt.palette[unpack_nibbles(pt.idx, layout.cols)].reshape(-1)
    exponent[_verbatim_weights(layout, pt.vchunks)] = pt.vexp[
        layout.column_mask(0, layout.n_chunks)[pt.vchunks.astype(np.int64)]
    ]
    sm = pt.sm.reshape(-1).astype(np.uint16)
    exponent = exponent.astype(np.uint16)
    return (((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)).reshape(pt.shape)


def pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """[R, C] values < 16 -> [R, ceil(C / 2)] bytes, even column in the low nibble."""
    rows, cols = nibbles.shape
    padded = np.zeros((rows, cols + cols % 2), np.uint8)
    padded[:, :cols] = nibbles
    return padded[:, 0::2] | (padded[:, 1::2] << 4)


def unpack_nibbles(idx: np.ndarray, cols: int) -> np.ndarray:
    """Inverse of ``pack_nibbles``: [R, ceil(C / 2)] bytes -> [R, C] values."""
    out = np.empty((idx.shape[0], idx.shape[1] * 2), np.uint8)
    out[:, 0::2] = idx & 0x0F
    out[:, 1::2] = idx >> 4
    return out[:, :cols]


def row_vstart(layout: Layout, vchunks: np.ndarray) -> np.ndarray:
    """CSR index over rows: row r's verbatim chunks are vchunks[row_vstart[r] : row_vstart[r +
    1]]."""
    row_first_chunk = np.arange(layout.rows + 1, dtype=np.int64) * layout.chunks_per_row
    return np.searchsorted(vchunks.astype(np.int64), row_first_chunk).astype(np.uint32)


def _verbatim_weights(layout: Layout, vchunks: np.ndarray) -> np.ndarray:
    """Flat indices of every weight in the given chunks."""
    k = vchunks.astype(np.int64)
    index = layout.chunk_start(k)[:, None] + np.arange(layout.chunk_size)
    return index[np.arange(layout.chunk_size) < layout.chunk_length(k)[:, None]]


def check_palette_tensor(pt: PaletteTensor) -> None:
    """Raise CodecError unless the palette form's arrays have the dtypes and shapes FORMAT.md
    gives."""
    layout = pt.layout
    v = len(pt.vchunks)
    expected = {
        "palette": (np.uint8, (16,)),
        "idx": (np.uint8, (layout.rows, -(-layout.cols // 2))),
        "sm": (np.uint8, (layout.rows, layout.cols)),
        "vchunks": (np.uint32, (v,)),
        "vexp": (np.uint8, (v, pt.chunk_size)),
        "row_vstart": (np.uint32, (layout.rows + 1,)),
    }
    for key, (dtype, shape) in expected.items():
        a = getattr(pt, key)
        if a.dtype != np.dtype(dtype) or a.shape != shape:
            raise CodecError(f"palette form of {pt.name!r}: {key} is {a.dtype}{list(a.shape)}, "
                             f"expected {np.dtype(dtype)}{list(shape)}")
    k = pt.vchunks.astype(np.int64)
    if not 0 <= pt.palette_size <= PALETTE_FORM_SLOTS or (k.size and (np.any(np.diff(k) <= 0)
                                                                      or k[-1] >= layout.n_chunks)):
        raise CodecError(f"palette form of {pt.name!r}: bad palette size or verbatim chunk ids")
    if not np.array_equal(pt.row_vstart, row_vstart(layout, pt.vchunks)):
        raise CodecError(f"palette form of {pt.name!r}: row_vstart does not index vchunks by row")
