"""The projection matrices of the fast model: plain (``DenseLinear``) or served compressed (``CompressedLinear``).

A compressed matrix is an ``UnweightLinear`` (``fast/codec/linear.py``): the bf16 weight held in the
palette form, 12 bits per weight instead of 16, and decoded when used. Lossless: the decoded weight
is the bf16 weight bit for bit, so a model served compressed gives exactly the outputs of the same
model with plain bf16 weights. In a float32 model the decoded bf16 weight is widened to float32
(then equal to a float32 model whose weights were rounded to bf16).

Where the decode runs:
* on a GPU, bf16: ``UnweightLinear`` itself (the fused decode+matmul kernel for a few rows; decode
  then cuBLAS for many);
* on a CPU: the plain torch decoder, then ``F.linear``. Triton's interpreter would be far too slow
  for a whole model, so the interpreter is never used here.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from fast.codec.decode_torch import decode_palette_torch
from fast.codec.encode import encode
from fast.codec.linear import UnweightLinear


class Linear(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """y = x W^T with a plain weight [out, in] in the model's dtype.

    On a CPU in bf16 the weight is also held in oneDNN's blocked layout (``cpu_packed``), so each call
    skips re-laying the weight out: 1.2-1.8x faster at decode batch sizes (64 down to 8 rows) on this
    project's EPYC, and bit-identical to ``F.linear`` (checked on a probe when packing; else not packed).
    """

    def __init__(self, weight: torch.Tensor, *, pack: bool = True):
        self.weight = weight
        self.out_features = weight.shape[0]
        self.packed = cpu_packed(weight) if pack else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dtype == self.packed.dtype and x.device.type == "cpu":
            return _packed_linear(x, self.packed)
        return F.linear(x, self.weight)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def cpu_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out, in] reordered by oneDNN for ``_packed_linear``, or None where that does not apply.

    Only bf16 weights on a CPU (float32 goes to MKL, whose packed form is not bit-identical). oneDNN's
    ops are private torch API: if they are missing, fail, or differ from ``F.linear`` by one bit on a
    probe input, the weight stays unpacked and ``F.linear`` serves it.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)  # 64: the batch size it is tuned for
        probe = torch.randn((5, weight.shape[1]), generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        same = torch.equal(_packed_linear(probe, packed), F.linear(probe, weight))
    except (AttributeError, RuntimeError):
        return None
    return packed if same else None


class CompressedLinear:
    """y = x W^T with W held compressed (palette form) and decoded at each call."""

    def __init__(self, unweight: UnweightLinear, dtype: torch.dtype):
        self.unweight, self.dtype = unweight, dtype
        self.out_features = unweight.out_features

    def weight(self) -> torch.Tensor:
        """The decoded weight in the model's dtype (a temporary)."""
        if self.unweight.sm.device.type == "cuda":
            w = self.unweight.decoded_weight()
        else:
            w = decode_palette_torch(self.unweight.form)
        return w.to(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" and self.dtype == torch.bfloat16:
            return self.unweight(x)
        return F.linear(x, self.weight())

    def nbytes(self) -> int:
        """Bytes the compressed weight occupies."""
        return sum(b.numel() * b.element_size() for b in self.unweight.buffers())


def compress(weight: torch.Tensor, dtype: torch.dtype) -> CompressedLinear:
    """Compress ``weight`` [out, in] (rounded to bf16 first if it is float32) for serving in ``dtype``."""
    bf16 = weight.to(torch.bfloat16).contiguous()
    _, form = encode(bf16, with_palette_form=True)
    return CompressedLinear(UnweightLinear(form), dtype)
