"""Unweight in torch + Triton: the kernels that decode the format of reference/codec/FORMAT.md.

Public API (bf16 tensors are torch.bfloat16; forms are ``fast.codec.forms.HuffmanForm`` / ``PaletteForm``;
``encode`` and ``matmul`` are imported from their modules, ``fast.codec.encode`` and ``fast.codec.matmul_triton``)::

    encode(x, chunk_size=64, chunks_per_group=32, palette_size=16, max_code_length=12,
           with_palette_form=False, native=None)   encoder, byte-identical to reference.codec.encode: on the
                                             CPU in C (codec/native/encode.c, built on first use with the
                                             system compiler), else (GPU, no compiler) torch
    decode_cpu(ct, threads=1) -> bits        the CPU decoder (fast.codec.decode_c; C, native/decode.c):
                                             reference CompressedTensor -> uint16 bits, every FORMAT.md 3.6
                                             check kept; NumPy lockstep fallback without a C compiler
    decode_rans_cpu(t, threads=1) -> bits    the same for the rANS form (fast.codec.decode_rans_c; C,
                                             native/rans_decode.c): RansTensor -> uint16 bits, every
                                             FORMAT.md 9.6 check kept; NumPy fallback without a compiler
    decode_rans_many(ts, threads=1) -> [bits]   several rANS-form tensors into one buffer (the CLI's decoder)
    decode_huffman(hform) -> bf16            Triton: Huffman form -> bf16, one lane per group
    transcode(hform) -> PaletteForm          Triton: Huffman form -> palette form (done once at load)
    decode_palette(pform) -> bf16            Triton: palette form -> bf16, tiles with verbatim patching
    fused_matmul(x, pform, bias=None, config=None)   Triton: y = x @ W.T, W decoded tile by tile in registers
    matmul(x, w, bias=None, config=None)     the same kernel on plain bf16 weights (the same-kernel twin)
    UnweightLinear(pform, bias)              nn.Linear drop-in: fused kernel for small batches, decode +
                                             F.linear (cuBLAS) above ``fused_max_rows``; .from_container(),
                                             .from_huffman(), .from_linear()
    transcode_torch(hform), decode_palette_torch(pform)   plain-torch versions (CPU fallback)
    huffman_from_reference(ct), palette_from_reference(pt), huffman_to_reference(hform)   adapters

Command line: ``python -m fast.codec compress|decompress|inspect``, the arguments and files of
``python -m reference.codec`` with the C encoder and decoder.

Conformance levels (``python -m conformance``): encode, decode_cpu (C and NumPy lockstep, against the
plain reference decoder), decode_rans_cpu (against the reference rANS decoder), decode_huffman,
transcode, decode_palette and the torch versions are bit-exact against the reference and the original
tensor; fused_matmul is same-kernel exact against ``matmul`` on the decoded weights (same config), and bounded against a
float64 product: |y - y64| <= 2^-8 |y64| + (K + 1) 2^-23 (|x| @ |W|^T + |b|).

What the format costs a kernel (notes for whoever changes FORMAT.md):

* Huffman form: decoding is sequential within a group (up to 64 Ki weights, 2,048 by default), so
  the parallelism is one lane per group and a lane's stores are a group apart (no coalescing).
  Decoding is a load-time step (transcode); inference reads the palette form.
* The 2-word peek of FORMAT.md 3.4 is done with one 64-bit load from a derived array of
  overlapping word pairs (built on the fly, 2x the stream's size) instead of two 32-bit loads.
* Palette form: a weight's 12 bits live in two arrays (nibble in ``idx``, byte in ``sm``): two load
  streams per tile, and each nibble's byte is loaded for both of its columns (adjacent addresses,
  the same cache sectors). The palette lookup is a gather from a 16-byte table.
* Verbatim chunks are rare, but every tile must know whether it holds one: each row carries a
  pointer into its (sorted) verbatim chunks, so a tile costs one gathered load per row when it has
  none. Chunks never straddle rows, which keeps this per-row walk simple.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each public name is imported from its module on first use (PEP 562): ``python -m fast.codec decompress`` needs
# only the C decoders, and importing torch and Triton for the rest took ~2 s of its 2.7 s (issue 45).
_HOME = {
    "HuffmanForm": "forms", "PaletteForm": "forms", "MatmulConfig": "matmul_triton", "fused_matmul": "matmul_triton",
    "UnweightLinear": "linear", "decode_cpu": "decode_c", "decode_rans_cpu": "decode_rans_c",
    "decode_rans_many": "decode_rans_c",
    "decode_huffman": "decode_triton", "transcode": "decode_triton", "decode_palette": "palette_triton",
    "decode_palette_torch": "decode_torch", "transcode_torch": "decode_torch",
    "huffman_from_reference": "convert", "huffman_to_reference": "convert", "palette_from_reference": "convert",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
