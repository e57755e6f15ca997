"""The two forms of a compressed tensor (reference/codec/FORMAT.md), held as torch tensors.

Field names follow FORMAT.md; ``layout`` (rows, columns, chunks, groups: FORMAT.md section 1) is the
reference's ``Layout``. Both forms are built with keywords only. torch's unsigned 32-bit type supports
few operations, so uint32 arrays are kept as int32 tensors holding the same bits (``stream``) or
widened to int64 when they are small and their values may reach 2^31 (``offsets``, ``vchunks``,
``row_vstart``). Both forms live on one device; ``.to(device)`` moves them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from fast.errors import KernelInputError
from reference.codec.layout import Layout


@dataclass(kw_only=True)
class HuffmanForm:
    """Huffman form: sm bytes, the MSB-first bit stream with per-group offsets, verbatim chunks."""

    layout: Layout
    max_code_length: int
    palette: list[int]  # P exponent values, most frequent first
    code_lengths: list[int]  # P lengths (0 = unused)
    sm: torch.Tensor  # uint8 [n]
    stream: torch.Tensor  # int32 [ceil(B / 32) + 1], the uint32 words' bits
    stream_bits: int  # B
    offsets: torch.Tensor  # int64 [n_groups + 1]
    vchunks: torch.Tensor  # int64 [V]
    vexp: torch.Tensor  # uint8 [V, chunk_size]
    extra: dict = field(default_factory=dict)  # header keys this side does not interpret (crc32, ...)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @property
    def device(self) -> torch.device:
        return self.sm.device

    def to(self, device: str | torch.device) -> HuffmanForm:
        return replace(self, sm=self.sm.to(device), stream=self.stream.to(device), offsets=self.offsets.to(device),
                       vchunks=self.vchunks.to(device), vexp=self.vexp.to(device))

    def nbytes(self) -> int:
        """Bytes of the five arrays (what the compressed size counts, less the header)."""
        return (self.sm.numel() + 4 * self.stream.numel() + 4 * self.offsets.numel() + 4 * self.vchunks.numel()
                + self.vexp.numel())


@dataclass(kw_only=True)
class PaletteForm:
    """Palette form: a 4-bit palette index and the sm byte per weight, verbatim chunks, CSR row index."""

    layout: Layout
    palette: torch.Tensor  # uint8 [16], zero-padded
    idx: torch.Tensor  # uint8 [R, ceil(C / 2)], low nibble = even column
    sm: torch.Tensor  # uint8 [R, C]
    vchunks: torch.Tensor  # int64 [V]
    vexp: torch.Tensor  # uint8 [V, chunk_size]
    row_vstart: torch.Tensor  # int64 [R + 1]
    n_palette: int = 16  # P, the palette's real length (entries past it are padding)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @property
    def device(self) -> torch.device:
        return self.sm.device

    def to(self, device: str | torch.device) -> PaletteForm:
        return replace(self, palette=self.palette.to(device), idx=self.idx.to(device), sm=self.sm.to(device),
                       vchunks=self.vchunks.to(device), vexp=self.vexp.to(device),
                       row_vstart=self.row_vstart.to(device))

    def nbytes(self) -> int:
        return (16 + self.idx.numel() + self.sm.numel() + 4 * self.vchunks.numel() + self.vexp.numel()
                + 4 * self.row_vstart.numel())

    def check(self) -> None:
        """Raise KernelInputError if the arrays do not have the shapes and dtypes the layout implies.

        Kernels index with these arrays, so a wrong length would read past an end.
        """
        g = self.layout
        want = {
            "palette": (self.palette, torch.uint8, (16,)),
            "idx": (self.idx, torch.uint8, (g.rows, -(-g.cols // 2))),
            "sm": (self.sm, torch.uint8, (g.rows, g.cols)),
            "vchunks": (self.vchunks, torch.int64, (self.vchunks.shape[0],)),
            "vexp": (self.vexp, torch.uint8, (self.vchunks.shape[0], g.chunk_size)),
            "row_vstart": (self.row_vstart, torch.int64, (g.rows + 1,)),
        }
        for name, (t, dtype, shape) in want.items():
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                raise KernelInputError(f"palette form: {name} must be a contiguous {dtype} tensor of shape {shape}, "
                                       f"got {t.dtype} {tuple(t.shape)}")
            if t.device != self.sm.device:
                raise KernelInputError(f"palette form: {name} is on {t.device}, sm on {self.sm.device}")
