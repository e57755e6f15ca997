"""Huffman form -> palette form on the CPU through the C decoder (``decode_c.decode_cpu``).

    form = transcode_cpu(ct)    # ct: reference.codec.CompressedTensor; a fast.codec.forms.PaletteForm

The C decoder decodes and checks the tensor (every check of FORMAT.md 3.6, CRC-32s included); a
coded weight's palette index is then its exponent's place in the palette (the palette's entries are
distinct), and ``palette_form_from_symbols`` assembles the form exactly as the torch and Triton
transcodes do (verbatim weights get index 0 there, whatever they hold here). So the result is the
same bytes as ``decode_torch.transcode_torch`` (``tests/test_transcode_c.py`` compares them), ~100x
faster on one core: a model's projections load in the palette form in a fraction of a second.
"""

from __future__ import annotations

import numpy as np
import torch

from fast.codec.decode_c import decode_cpu
from fast.codec.encode import palette_form_from_symbols
from fast.codec.forms import PaletteForm
from fast.errors import KernelInputError
from reference.codec.format import CompressedTensor
from reference.codec.layout import Layout


def transcode_cpu(ct: CompressedTensor, *, threads: int = 1) -> PaletteForm:
    """The palette form of a Huffman-form tensor (palette of at most 16 entries). Raises CodecError if
    the tensor is damaged, KernelInputError if its palette is too long for the palette form."""
    if len(ct.palette) > 16:
        raise KernelInputError(f"the palette form needs a palette of at most 16 entries, this one has "
                               f"{len(ct.palette)}")
    bits = decode_cpu(ct, threads=threads).reshape(-1)
    place = np.zeros(256, np.uint8)
    place[np.asarray(ct.palette, np.int64)] = np.arange(len(ct.palette), dtype=np.uint8)
    sym = place[(bits >> 7).astype(np.uint8)]  # the exponent byte (the sign bit is cut off)
    layout = Layout(tuple(ct.shape), ct.chunk_size, ct.chunks_per_group)
    return palette_form_from_symbols(layout, list(ct.palette), torch.from_numpy(sym),
                                     torch.from_numpy(np.array(ct.sm, order="C")),
                                     torch.from_numpy(ct.vchunks.astype(np.int64)),
                                     torch.from_numpy(np.array(ct.vexp, order="C")))
