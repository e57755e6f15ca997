"""The CPU decoder: Huffman form -> bf16 in C (``native/decode.c``), every check of FORMAT.md 3.6 kept.

    bits = decode_cpu(ct)                      # ct: reference.codec.CompressedTensor; uint16, its shape
    bits = decode_cpu(ct, threads=2)           # blocks of groups, taken in turn by POSIX threads

Conformance level: bit-exact against ``reference.codec.decode`` (the plain decoder of FORMAT.md 3.5):
the same bits for every valid tensor, and CodecError (never wrong data) for every damaged one
(``conformance/cases/cpu_decode_cases.py``, ``tests/test_decode_cpu.py``).

Python checks the header (``CompressedTensor.check_header``: ranges, palette, code lengths, every
array's dtype and length); the C code checks the contents (CRC-32 of every array and of the decoded
data, offsets, verbatim ids and chunks, the tail bits, every code, every group's end) in the same pass
that decodes. Its CRC-32 (``native/crc32.h``) folds with 512-bit or 128-bit carry-less multiplication
where the CPU has it (VPCLMULQDQ ~47 GB/s, PCLMULQDQ ~14 GB/s, tables ~2 GB/s on one AMD EPYC core);
with the tables alone the CRCs would cost more than the whole decode.
How the decode loop is made fast: see the comment atop decode.c.

``UNFIRE_CPU_ISA`` (``fast.cpu_isa``) caps the paths: the AVX2 + BMI2 build and PCLMULQDQ from ``avx2`` on, the
AVX-512BW assembly of bf16 and the VPCLMULQDQ CRC from ``avx512`` on, ARM's CRC32 instructions from ``neon`` on;
``scalar`` runs the portable build with the CRC tables. Every path gives the same bits; a set this CPU lacks raises
``CpuIsaError`` at the first decode.

Without a C compiler (or with ``UNFIRE_NATIVE=0``) ``decode_cpu`` runs the lockstep NumPy decoder
(``reference.codec.lockstep``): the same bits, several times slower.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np

from fast import build_c
from reference.codec.errors import CodecError
from reference.codec.format import CompressedTensor
from reference.codec.layout import Layout
from reference.codec.lockstep import decode_many

SOURCE = Path(__file__).with_name("native") / "decode.c"
_lock = threading.Lock()
_state: dict[str, Any] = {}  # the library ("lib") and the UNFIRE_CPU_ISA it was given ("isa")
_P, _I64, _INT, _U32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32
_SIGNATURES = {  # name: (return type, argument types), as in native/decode.c
    "unw_crc32": (_U32, [_P, _I64, _INT]),
    "unw_crc_use": (_INT, [_INT]),
    "unw_decode_use": (_INT, [_INT]),
    "unw_assemble_use": (_INT, [_INT]),
    "unw_isa": (_INT, [_INT]),
    "unw_tables": (None, [_P, _P, _INT, _INT, _P, _P]),
    "unw_decode": (_INT, [_P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _INT, _P, _P, _INT,
                          _I64, _I64, _I64, _I64, _INT, _I64, _P, _P]),
}
MIN_WEIGHTS_PER_THREAD = 1 << 18  # fewer, and starting a thread costs more than it saves
BLOCK_WEIGHTS = 1 << 16  # threads take blocks of about this many weights in turn (a slowed thread takes fewer)
ERRORS = {  # unw_decode's return codes
    1: "group offsets must rise from 0 to stream_bits",
    2: "verbatim chunk ids must be increasing and below the number of chunks (entry {0})",
    3: "padding bytes of short verbatim chunks must be 0 (verbatim chunk {0})",
    4: "verbatim chunk {0} holds only palette exponents (the verbatim rule is iff)",
    5: "bits after the end of the stream must be 0",
    6: "corrupt Huffman stream: group {0} starts with an invalid code",
    7: "corrupt Huffman stream: group {0} ended at bit {1}, not at the next group's offset",
    9: "out of memory",
}
CRC_ORDER = ("sm", "stream", "offsets", "vchunks", "vexp", "data")


def library() -> ctypes.CDLL | None:
    """The compiled decoder, built on first use, capped by ``UNFIRE_CPU_ISA``; None if it cannot be built (or
    ``UNFIRE_NATIVE=0``)."""
    return build_c.load(_state, _lock, SOURCE, _SIGNATURES, "the C decoder", "the NumPy lockstep decoder",
                        isa="unw_isa")


def _ptr(a: np.ndarray) -> int:
    """The address of a contiguous array's first byte. Through the buffer protocol where the array is writable
    and not empty (a third of the time of ``__array_interface__``, which builds a dict: a decode asks seven
    times), else through ``__array_interface__``."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.__array_interface__["data"][0]


@functools.lru_cache(maxsize=64)
def tables(palette: tuple[int, ...], code_lengths: tuple[int, ...], max_code_length: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int, int]]:
    """The decoding tables of one code (lengths checked by ``check_lengths``), built by ``unw_tables``: the
    one-symbol table (exponent | length << 8, uint16 [2^L]), the multi-symbol table (uint64 [2^L]), the
    palette (uint8), and the three arrays' addresses (kept with them: the cache keeps them alive)."""
    size = 1 << max_code_length
    # one allocation, one address: multi (uint64 [size]), single (uint16 [size]), palette, lengths (uint8 [256])
    block = np.empty(10 * size + 512 + 64, np.uint8)
    base = _ptr(block)
    start = -base % 64  # multi on a cache line
    multi = block[start:start + 8 * size].view(np.uint64)
    single = block[start + 8 * size:start + 10 * size].view(np.uint16)
    palette_array = block[start + 10 * size:start + 10 * size + len(palette)]
    lengths = block[start + 10 * size + 256:start + 10 * size + 256 + len(code_lengths)]
    palette_array[:], lengths[:] = palette, code_lengths
    at = base + start
    library().unw_tables(at + 10 * size + 256, at + 10 * size, len(palette), max_code_length, at + 8 * size, at)
    for t in (single, multi, palette_array, block):
        t.flags.writeable = False
    return single, multi, palette_array, (at + 8 * size, at, at + 10 * size)


def crc32(data: np.ndarray, threads: int = 1) -> int:
    """zlib.crc32 of an array's bytes (C order), computed in C (carry-less multiplication where it can)."""
    data = np.ascontiguousarray(data)
    return int(library().unw_crc32(_ptr(data), data.nbytes, threads))


def _line_aligned(n: int) -> np.ndarray:
    """An uninitialised uint16 [n] starting on a 64-byte line. The decoder writes whole lines of output past
    the cache with the CRC folded from its registers, and runs start at multiples of 4 groups (8192 weights
    by default): on a line-aligned buffer most runs start and end on whole lines, where the unaligned head and
    tail of each run otherwise take a CRC of bytes read back from memory just written (MiniLM, one thread,
    60 alternating rounds of the bare C calls: 13.98 ms against 14.91, 2026-12-06)."""
    buf = np.empty(n + 32, np.uint16)
    skip = (-_ptr(buf) % 64) // 2  # numpy's buffers start on at least 2 bytes
    return buf[skip:skip + n]


def decode_cpu(ct: CompressedTensor, *, threads: int = 1, native: bool | None = None) -> np.ndarray:
    """Decompress a Huffman-form tensor on the CPU: its bf16 bits (uint16, original shape). Raises CodecError.

    ``threads`` decodes tensors of at least ``2 * MIN_WEIGHTS_PER_THREAD`` weights in that many threads, which
    take blocks of about ``BLOCK_WEIGHTS`` weights in turn.
    ``native=None`` uses the C decoder when it builds, ``False`` the NumPy lockstep decoder, ``True`` C or raise.
    """
    lib = library() if native is not False else None
    if lib is None:
        if native:
            raise CodecError("decode_cpu: the C decoder is not available (no C compiler, or UNFIRE_NATIVE=0)")
        return decode_many([ct])[0]
    ct.check_header()
    layout = Layout(ct.shape, ct.chunk_size, ct.chunks_per_group)
    stream, offsets, vchunks, vexp, sm = (np.ascontiguousarray(a) for a in (ct.stream, ct.offsets, ct.vchunks,
                                                                           ct.vexp, ct.sm))
    if ">" in (stream.dtype.byteorder, offsets.dtype.byteorder, vchunks.dtype.byteorder):  # uint8 has none
        # check_header accepts either byte order; C reads native order
        big = [f"{k} {a.dtype}" for k, a in (("stream", stream), ("offsets", offsets), ("vchunks", vchunks))
               if a.dtype.byteorder == ">"]
        raise CodecError(f"{ct.where()}decode_cpu takes native-order arrays, got {', '.join(big)}")
    *_, (single, multi, palette) = tables(tuple(ct.palette), tuple(ct.code_lengths),
                                                          ct.max_code_length)
    crc = ct.crc
    io = np.array([crc["sm"], crc["stream"], crc["offsets"], crc["vchunks"], crc["vexp"], crc["data"], 0, 0],
                  np.uint32)  # the expected CRCs in, where an error was found out
    n = math.prod(ct.shape)
    out = _line_aligned(n)
    threads = max(1, min(threads, n // MIN_WEIGHTS_PER_THREAD, 64))
    error = lib.unw_decode(
        _ptr(stream), stream.size, ct.stream_bits, _ptr(offsets), _ptr(vchunks), vchunks.size, _ptr(vexp), _ptr(sm),
        palette, len(ct.palette), single, multi, ct.max_code_length, layout.rows, layout.cols,
        layout.chunk_size, layout.chunks_per_group, threads, BLOCK_WEIGHTS, _ptr(io), _ptr(out))
    if error:
        where, info = ct.where(), io[6:].astype(np.int64)
        if error == 8:
            key = CRC_ORDER[int(info[0])]
            what = "decoded data" if key == "data" else f"array {key}"
            raise CodecError(f"{where}{what} fails its CRC-32 check: the data is corrupt")
        raise CodecError(where + ERRORS.get(error, f"C decoder error {error}").format(int(info[0]), int(info[1])))
    return out.reshape(ct.shape)
