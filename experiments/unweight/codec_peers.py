"""The codecs U3 compares, behind one interface: compress a list of bf16 tensors, time it, check it.

Each method returns, per tensor, the compressed size in bytes (every overhead counted), plus the
total encode and decode seconds over all tensors, and it verifies that decoding gives the input
back bit for bit (a method that does not round-trip is reported as an error, not measured).
Encoding is timed once; decoding is the best of DECODE_REPEAT passes (the machine is shared).

* ``unweight``: our codec (palette 16, chunks of 64, max code length 12), decoded as the container
  does (many tensors per lockstep pass);
* ``rans``: our own rANS mode (FORMAT.md section 9: exponent and 2 mantissa bits coded jointly,
  clustered tables, escapes, 32 interleaved lanes per 65536-weight block), batched the same way;
* ``full_alphabet``: the same code with a 256-entry palette (every exponent has a code, no verbatim
  chunk: the DFloat11 idea), max code length 16;
* ``zipnn``: the ``zipnn`` package (byte-grouped bf16, Huffman/zstd), single-threaded;
* ``zstd3`` / ``zstd19``: ``zstandard`` on the raw little-endian bf16 bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from reference.codec import decode_many, decode_rans_many, encode, encode_rans_many
from reference.codec.container_read import DECODE_BATCH, weight_count

DECODE_REPEAT = 3  # decode timings are the best of this many passes


@dataclass
class MethodResult:
    sizes: list[int]  # compressed bytes per tensor
    encode_s: float
    decode_s: float
    ok: bool  # every tensor decoded bit for bit
    compressed: list[Any] | None = None  # our codecs: the compressed tensors themselves (for their breakdown)


def run_unweight(tensors: list[np.ndarray], **params: int) -> MethodResult:
    start = time.perf_counter()
    cts = [encode(t, **params) for t in tensors]
    return decode_in_batches(cts, tensors, decode_many, time.perf_counter() - start)


def run_rans(tensors: list[np.ndarray], **params: Any) -> MethodResult:
    start = time.perf_counter()
    cts = encode_rans_many(tensors, **params)
    return decode_in_batches(cts, tensors, decode_rans_many, time.perf_counter() - start)


def decode_in_batches(cts: list[Any], tensors: list[np.ndarray], decode: Callable[[list[Any]], list[np.ndarray]],
                      encode_s: float) -> MethodResult:
    """Decode in batches of about DECODE_BATCH weights, as the container does; time it, check it."""
    decode_s, ok, i = 0.0, True, 0
    while i < len(cts):
        j = i + 1
        while j < len(cts) and sum(weight_count(c) for c in cts[i:j]) < DECODE_BATCH:
            j += 1
        seconds, out = best_of(lambda b=cts[i:j]: decode(b))
        decode_s += seconds
        ok &= all(np.array_equal(a, b) for a, b in zip(out, tensors[i:j], strict=True))
        i = j
    return MethodResult([c.nbytes for c in cts], encode_s, decode_s, ok, cts)


def best_of(fn: Callable[[], Any], repeat: int = DECODE_REPEAT) -> tuple[float, Any]:
    """(seconds, result) of the fastest of ``repeat`` calls: the machine is shared, the best run is
    the least disturbed one. Used for decoding, which is cheap next to encoding."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def run_bytes_codec(tensors: list[np.ndarray], compress: Callable[[bytes], bytes],
                    decompress: Callable[[bytes], bytes]) -> MethodResult:
    sizes, encode_s, decode_s, ok = [], 0.0, 0.0, True
    for t in tensors:
        raw = np.ascontiguousarray(t).astype("<u2").tobytes()
        start = time.perf_counter()
        blob = compress(bytearray(raw))  # a copy: zipnn 0.5.4 rewrites its input buffer in place
        encode_s += time.perf_counter() - start
        seconds, back = best_of(lambda blob=blob: decompress(blob))
        decode_s += seconds
        ok &= bytes(back) == raw
        sizes.append(len(blob))
    return MethodResult(sizes, encode_s, decode_s, ok)


def run_zipnn(tensors: list[np.ndarray]) -> MethodResult:
    import zipnn

    z = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1)
    return run_bytes_codec(tensors, z.compress, z.decompress)


def run_zstd(tensors: list[np.ndarray], level: int) -> MethodResult:
    import zstandard

    c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
    return run_bytes_codec(tensors, lambda b: c.compress(bytes(b)), d.decompress)


METHODS: dict[str, Callable[[list[np.ndarray]], MethodResult]] = {
    "unweight": run_unweight,
    "rans": run_rans,
    "full_alphabet": lambda ts: run_unweight(ts, palette_size=256, max_code_length=16),
    "zipnn": run_zipnn,
    "zstd3": lambda ts: run_zstd(ts, 3),
    "zstd19": lambda ts: run_zstd(ts, 19),
}
