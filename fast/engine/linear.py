"""The projection matrices of the fast model: plain (``DenseLinear``) or served compressed (``CompressedLinear``).

A compressed matrix is an ``UnweightLinear`` (``fast/codec/linear.py``): the bf16 weight held in the
palette form, 12 bits per weight instead of 16, and decoded when used. Lossless: the decoded weight
is the bf16 weight bit for bit, so a model served compressed gives exactly the outputs of the same
model with plain bf16 weights. In a float32 model the decoded bf16 weight is widened to float32
(then equal to a float32 model whose weights were rounded to bf16).

Where the decode runs:
* on a GPU, bf16: ``UnweightLinear`` itself (the fused decode+matmul kernel for a few rows; decode
  then cuBLAS for many);
* on a CPU with AVX-512 BF16 and AMX (``fast.codec.matmul_c.available()``): the weight is held in
  tile order (``fast/codec/matmul_c.py``), one copy, and every product goes through the C tile
  products, which decode each compressed tile inside the product (AVX-512 BF16 in registers for up
  to 4 rows, AMX from an L1/L2 buffer above). Plain matrices take the same products on their plain
  tiles. Every output sums its products in order of k whatever the number of rows, the rows' place
  in the batch or the thread count, so the engine is batch-invariant here (a sequence's tokens do
  not depend on what it is batched with, nor on the topology: P/D, pipeline, fleet), and plain and
  compressed serving give the same logits bit for bit. ``UNFIRE_TILE_MATMUL=0`` switches this off
  (oneDNN's packed products: faster for plain prefill of 64+ rows, not batch-invariant);
* on other CPUs: the plain torch decoder, then ``F.linear``. Triton's interpreter would be far too slow
  for a whole model, so the interpreter is never used here.
"""

from __future__ import annotations

import functools
import os
from typing import Protocol

import torch
import torch.nn.functional as F

from fast.codec import matmul_c
from fast.codec.decode_torch import decode_palette_torch
from fast.codec.encode import encode
from fast.codec.linear import UnweightLinear
from fast.codec.matmul_c import TileWeight

PROBE_ROWS = (3, 5, 17, 64)  # packed oneDNN must equal F.linear at these row counts to be used


class Linear(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """y = x W^T with a plain weight [out, in] in the model's dtype.

    Where the tile products run (``tile_products()``, bf16) the weight is held once, in tile order,
    and every product goes through it (see the module docstring). Elsewhere on a CPU in bf16 it is
    held in oneDNN's blocked layout (``cpu_packed``), so each call skips re-laying the weight out
    (1.2-1.8x faster at decode batch sizes), bit-identical to ``F.linear`` (checked on probes when
    packing; else not packed).
    """

    def __init__(self, weight: torch.Tensor, *, pack: bool = True):
        self.out_features = weight.shape[0]
        bf16_cpu = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        self.tiles = TileWeight.from_dense(weight) if pack and bf16_cpu and tile_products() else None
        self.packed = cpu_packed(weight) if pack and self.tiles is None else None
        self._weight = weight if self.tiles is None else None  # the tiles are the one copy

    @property
    def weight(self) -> torch.Tensor:
        """The weight [out, in] (rebuilt from the tiles when they are the only copy)."""
        return self._weight if self._weight is not None else self.tiles.dense()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return self.tiles.matmul(x, threads=tile_threads(x))
        if self.packed is not None and x.dtype == self.packed.dtype and x.device.type == "cpu":
            return _packed_linear(x, self.packed)
        return F.linear(x, self.weight)

    def nbytes(self) -> int:
        """Resident bytes of the weight's copies (row-major, tiles, oneDNN's packed)."""
        parts = [t for t in (self._weight, self.packed) if t is not None]
        return sum(t.numel() * t.element_size() for t in parts) + (self.tiles.nbytes() if self.tiles else 0)


def rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


def tile_threads(x: torch.Tensor) -> int:  # noqa: ARG001 (one rule for every product today)
    """Threads for a tile product: torch's count. Threads share out the output features (each output is
    summed by one thread), so the count never changes a result, only the speed; they stay alive between
    products (fast/codec/native/threads.h), so even a decode step's short products can share them."""
    return torch.get_num_threads()


@functools.cache
def tile_products() -> bool:
    """True when the CPU's products go through ``fast.codec.matmul_c`` (see the module docstring)."""
    return os.environ.get("UNFIRE_TILE_MATMUL", "1") != "0" and matmul_c.available()


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
        gen = torch.Generator().manual_seed(0)
        probes = [torch.randn((m, weight.shape[1]), generator=gen).to(weight.dtype) for m in PROBE_ROWS]
        same = all(torch.equal(_packed_linear(p, packed), F.linear(p, weight)) for p in probes)
    except (AttributeError, RuntimeError):
        return None
    return packed if same else None


class CompressedLinear:
    """y = x W^T with W held compressed (palette form, or its tile order on a CPU with the tile products)."""

    def __init__(self, unweight: UnweightLinear, dtype: torch.dtype):
        self.dtype = dtype
        self.out_features = unweight.out_features
        on_cpu = unweight.sm.device.type == "cpu" and dtype == torch.bfloat16
        self.tiles = TileWeight.from_palette(unweight.form) if on_cpu and tile_products() else None
        self.unweight = unweight if self.tiles is None else None  # one resident copy

    def weight(self) -> torch.Tensor:
        """The decoded weight in the model's dtype (a temporary)."""
        if self.tiles is not None:
            return self.tiles.dense()
        if self.unweight.sm.device.type == "cuda":
            w = self.unweight.decoded_weight()
        else:
            w = decode_palette_torch(self.unweight.form)
        return w.to(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return self.tiles.matmul(x, threads=tile_threads(x))
        if x.device.type == "cuda" and self.dtype == torch.bfloat16:
            return self.unweight(x)
        return F.linear(x, self.weight())

    def arrays(self) -> dict[str, torch.Tensor]:
        """The resident arrays of the compressed weight by name (tile order or palette form)."""
        if self.tiles is not None:
            names = ("sm", "idx", "palette", "pstart", "pword", "pexp")
            return {n: getattr(self.tiles, n) for n in names}
        return dict(self.unweight.named_buffers())

    def nbytes(self) -> int:
        """Bytes the compressed weight occupies."""
        if self.tiles is not None:
            return self.tiles.nbytes()
        return sum(b.numel() * b.element_size() for b in self.unweight.buffers())


def compress(weight: torch.Tensor, dtype: torch.dtype) -> CompressedLinear:
    """Compress ``weight`` [out, in] (rounded to bf16 first if it is float32) for serving in ``dtype``."""
    bf16 = weight.to(torch.bfloat16).contiguous()
    _, form = encode(bf16, with_palette_form=True)
    return CompressedLinear(UnweightLinear(form), dtype)
