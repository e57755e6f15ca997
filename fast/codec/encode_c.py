"""The encoder's compiled CPU path: ``native/encode.c``, built with the system C compiler on first use.

Why C: eager torch pays a few microseconds per operation and one pass over memory per operation.
The torch encoder (``encode_words``) needs about 25 operations per block of weights: with blocks
small enough to stay in L2 the per-call cost dominates, with large blocks every pass runs at L3
speed. Measured on this 2-core EPYC at one thread: the bit packing alone (lookup, prefix sum,
shifts, ``index_add_``) costs 1.1 ns/weight at its best block size, the whole torch encoder about
2.5-3 ns/weight on large tensors plus ~0.3 ms of per-call work on each tensor, while ZipNN
compresses at about 2 ns/weight. In C each pass is one loop over the tensor: about 1.4 ns/weight
in all, Python included, at one thread (``experiments/results/bench_encode.json``: 1.45x ZipNN's
speed at one thread, 1.4x at two, on MiniLM). Tensors of at least ``2 * MIN_WEIGHTS_PER_THREAD``
weights are split into ``torch.get_num_threads()`` ranges of groups, encoded in POSIX threads.

The build (``build_c.py``): the system C compiler on first use, cached in ``$UNFIRE_CACHE``. No
compiler, a failed build or ``UNFIRE_NATIVE=0``: ``library()`` returns None and
``fast.codec.encode.encode`` uses the torch encoder, which gives the same bytes (both are tested
against the reference encoder).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np
import torch

from fast import build_c
from fast.codec.encode_words import _empty, fast_code_lengths
from fast.codec.forms import HuffmanForm
from fast.errors import KernelInputError
from reference.codec.layout import Layout

SOURCE = Path(__file__).with_name("native") / "encode.c"
_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {  # name: (return type, argument types), as in native/encode.c
    "unw_scan": (_INT, [_P, _I64, _I64, _I64, _I64, _INT, _P, _P, _P, _P]),
    "unw_palette": (_INT, [_P, _INT, _INT, _P]),
    "unw_verbatim": (_I64, [_P, _I64, _I64, _I64, _I64, _INT, _P, _P, _P, _INT, _P, _P]),
    "unw_gather_vexp": (None, [_P, _I64, _I64, _I64, _P, _P, _P]),
    "unw_code_lengths": (_I64, [_P, _P, _INT, _P, _INT, _INT, _P]),
    "unw_pack": (_I64, [_P, _I64, _I64, _I64, _I64, _INT, _P, _P, _INT, _P, _P, _P, _P]),
}
MIN_WEIGHTS_PER_THREAD = 1 << 18  # fewer, and starting a thread costs more than it saves


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None if they cannot be (or ``UNFIRE_NATIVE=0``)."""
    return build_c.load(_state, _lock, SOURCE, _SIGNATURES, "the C encoder", "the torch encoder")


def encode_c(bits: torch.Tensor, g: Layout, max_code_length: int, palette_size: int) -> HuffmanForm:
    """The Huffman form of a tensor's int16 bits (flat, contiguous, on the CPU, at least one weight).

    Buffers are torch tensors: ``data_ptr()`` is far cheaper than NumPy's ``ctypes.data`` (about
    20 pointers per call, on tensors of 100 kB this matters).
    """
    lib = library()
    if lib is None:
        raise KernelInputError("encode_c: the C encoder is not available")
    rows, cols, cs, cpg = g.rows, g.cols, g.chunk_size, g.chunks_per_group
    threads = max(1, min(torch.get_num_threads(), g.n // MIN_WEIGHTS_PER_THREAD, g.n_groups, 64))
    x = bits.data_ptr()
    sm = _empty(g.n, torch.uint8, bits.device)
    counts = torch.zeros((2, threads, 256), dtype=torch.int64)  # per range of groups: all, in verbatim chunks
    chunks = torch.empty((3, g.n_chunks), dtype=torch.uint8)  # min exponent, max exponent, verbatim
    palette = torch.empty(256, dtype=torch.uint8)
    c_all, c_verbatim, c_min, c_max, flags = (counts[0].data_ptr(), counts[1].data_ptr(), chunks[0].data_ptr(),
                                              chunks[1].data_ptr(), chunks[2].data_ptr())
    lib.unw_scan(x, rows, cols, cs, cpg, threads, sm.data_ptr(), c_all, c_min, c_max)  # pass 1
    p = lib.unw_palette(c_all, threads, palette_size, palette.data_ptr())
    n_verbatim = lib.unw_verbatim(x, rows, cols, cs, cpg, threads, c_min, c_max, palette.data_ptr(), p, flags,
                                  c_verbatim)
    vchunks = torch.empty(n_verbatim, dtype=torch.int64)
    vexp = torch.empty((n_verbatim, cs), dtype=torch.uint8)
    lib.unw_gather_vexp(x, rows, cols, cs, flags, vchunks.data_ptr(), vexp.data_ptr())
    lengths = torch.empty(p, dtype=torch.uint8)
    stream_bits = lib.unw_code_lengths(c_all, c_verbatim, threads, palette.data_ptr(), p, max_code_length,
                                       lengths.data_ptr())
    if stream_bits < 0:  # few symbols, many, or an error: in Python
        sym_counts = (counts[0] - counts[1]).sum(0).numpy()[palette[:p].numpy()]  # over the coded chunks
        lengths = torch.tensor(fast_code_lengths(sym_counts, max_code_length), dtype=torch.uint8)
        stream_bits = int(np.dot(sym_counts, lengths.numpy().astype(np.int64)))
    if stream_bits >= 1 << 32:
        raise KernelInputError(f"encode: the stream of {stream_bits} bits exceeds the format's 2^32 - 1 limit")
    stream = _empty(stream_bits // 32 + 6, torch.int32, bits.device)  # pass 2 stores 8 bytes at a time, 16 past
    offsets = torch.empty(g.n_groups + 1, dtype=torch.int64)
    coded = counts[0] - counts[1]  # by range: where each range's bits start
    packed = lib.unw_pack(x, rows, cols, cs, cpg, threads, flags, palette.data_ptr(), p, lengths.data_ptr(),
                          coded.data_ptr(), stream.data_ptr(), offsets.data_ptr())  # pass 2
    if packed < 0:
        raise MemoryError("encode_c: out of memory for the stream")
    if packed != stream_bits:
        raise AssertionError(f"encode_c: packed {packed} bits, expected {stream_bits}")
    return HuffmanForm(layout=g, max_code_length=max_code_length, palette=palette[:p].tolist(),
                       code_lengths=lengths.tolist(), sm=sm, stream=stream[: (stream_bits + 31) // 32 + 1],
                       stream_bits=stream_bits, offsets=offsets, vchunks=vchunks, vexp=vexp)
