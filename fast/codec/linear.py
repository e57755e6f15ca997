"""``UnweightLinear``: a drop-in for ``nn.Linear`` whose weight stays compressed (palette form) in memory.

Forward picks one of two paths by the number of input rows (batch x tokens):

* ``rows <= fused_max_rows``: the fused kernel, ``fused_matmul``: each weight tile is decoded in
  registers right before ``tl.dot``. Small batches are memory-bound, and the palette form moves 12
  bits per weight instead of 16.
* larger: decode the whole weight to bf16 (``decode_palette``, a temporary) and call
  ``torch.nn.functional.linear`` (cuBLAS on a GPU). Large batches are compute-bound: the decode is
  amortised over many rows and cuBLAS's tensor-core pipeline wins.

On a CPU without Triton's interpreter, both paths fall back to the plain torch decode + F.linear.
"""

from __future__ import annotations

import torch
from torch import nn

from fast.codec.forms import HuffmanForm, PaletteForm
from fast.errors import KernelInputError
from fast.triton_util import on_interpreter
from reference.codec.layout import Layout

_FORM_BUFFERS = ("palette", "idx", "sm", "vchunks", "vexp", "row_vstart")


class UnweightLinear(nn.Module):
    """y = x @ W.T + b with W [out_features, in_features] held in palette form (12 bits per weight)."""

    def __init__(self, form: PaletteForm, bias: torch.Tensor | None = None, fused_max_rows: int = 16,
                 config: object | None = None):
        super().__init__()
        if len(form.shape) != 2:
            raise KernelInputError(f"UnweightLinear: the weight must be 2-D [out, in], got shape {form.shape}")
        form.check()
        self.out_features, self.in_features = form.shape
        self.chunk_size = form.layout.chunk_size
        self.n_palette = form.n_palette
        for name in _FORM_BUFFERS:
            self.register_buffer(name, getattr(form, name))
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise KernelInputError(f"UnweightLinear: bias must have shape ({self.out_features},), "
                                       f"got {tuple(bias.shape)}")
            bias = nn.Parameter(bias.to(torch.bfloat16).to(form.device), requires_grad=False)
        self.bias = bias
        self.fused_max_rows = fused_max_rows
        self.config = config  # a fast.codec.matmul_triton.MatmulConfig for the fused kernel, or None (heuristic)

    # ---- construction ----
    @classmethod
    def from_huffman(cls, form: HuffmanForm, bias: torch.Tensor | None = None, **kw: object) -> UnweightLinear:
        """From a Huffman-form weight: transcoded once to the palette form (Triton if it can run, else torch)."""
        if form.device.type == "cuda" or on_interpreter():
            from fast.codec.decode_triton import transcode
        else:
            from fast.codec.decode_torch import transcode_torch as transcode
        return cls(transcode(form), bias, **kw)

    @classmethod
    def from_container(cls, container: object, weight: str, bias: str | None = None,
                       device: str | torch.device = "cpu", **kw: object) -> UnweightLinear:
        """From a checkpoint container (a path or reference.codec.Container): tensor ``weight``, optional ``bias``."""
        from fast.codec.convert import huffman_from_reference
        from reference.codec import Container

        c = container if isinstance(container, Container) else Container(container)
        if not c.is_compressed(weight):
            raise KernelInputError(f"UnweightLinear.from_container: {weight!r} is stored uncompressed in {c.path}")
        b = None
        if bias is not None:
            b = _as_bf16(c.get(bias), c.headers[bias].get("dtype", "BF16"))
        return cls.from_huffman(huffman_from_reference(c.compressed(weight), device), b, **kw)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw: object) -> UnweightLinear:
        """Compress an nn.Linear's weight (cast to bf16 with round-to-nearest-even) with the torch encoder."""
        from fast.codec.encode import encode

        w = linear.weight.detach().to(torch.bfloat16).contiguous()
        _, form = encode(w, with_palette_form=True)
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        return cls(form, bias, **kw)

    # ---- use ----
    @property
    def form(self) -> PaletteForm:
        return PaletteForm(layout=Layout((self.out_features, self.in_features), self.chunk_size),
                           **{n: getattr(self, n) for n in _FORM_BUFFERS}, n_palette=self.n_palette)

    def decoded_weight(self) -> torch.Tensor:
        """The weight as a bf16 [out, in] tensor (decoded now; not kept)."""
        if self.sm.device.type == "cuda" or on_interpreter():
            from fast.codec.palette_triton import decode_palette

            return decode_palette(self.form)
        from fast.codec.decode_torch import decode_palette_torch

        return decode_palette_torch(self.form)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise KernelInputError(f"UnweightLinear: expected bf16 input, got {got}")
        if x.shape[-1:] != (self.in_features,):
            raise KernelInputError(f"UnweightLinear: expected input [..., {self.in_features}], got {tuple(x.shape)}")
        rows = x.numel() // max(self.in_features, 1)
        triton_ok = x.device.type == "cuda" or on_interpreter()
        if triton_ok and rows <= self.fused_max_rows:
            from fast.codec.matmul_triton import fused_matmul

            return fused_matmul(x.contiguous(), self.form, self.bias, self.config)
        return nn.functional.linear(x, self.decoded_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"palette form, {self.n_palette} palette entries, {self.vchunks.numel()} verbatim chunks, "
                f"fused up to {self.fused_max_rows} rows")


def _as_bf16(bits_or_array: object, dtype: str) -> torch.Tensor:
    """A tensor read from a container as torch.bfloat16 (bf16 bits, or float values cast with RNE)."""
    import numpy as np

    from fast.bf16 import from_numpy_bits
    from reference.bf16 import float32_to_bf16

    a = np.asarray(bits_or_array)
    if a.dtype == np.uint16 and dtype == "BF16":
        return from_numpy_bits(a)
    return from_numpy_bits(float32_to_bf16(a.astype(np.float32)))
