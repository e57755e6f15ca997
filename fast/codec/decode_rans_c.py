"""The CPU decoder of the rANS mode: rANS form -> bf16 in C (``native/rans_decode.c``), every check of FORMAT.md 9.6.

    bits = decode_rans_cpu(t)                  # t: reference.codec.rans.RansTensor; uint16, its shape
    bits = decode_rans_cpu(t, threads=2)       # blocks taken in turn by POSIX threads
    many = decode_rans_many([t, u])            # several tensors into one buffer (each array a view of it)

Conformance level: bit-exact against ``reference.codec.decode_rans`` (the lockstep NumPy decoder of
FORMAT.md 9.4): the same bits for every valid tensor, and CodecError (never wrong data) for every
damaged one (``conformance/cases/cpu_decode_cases.py``, ``tests/test_rans_cpu.py``).

Python runs the checks on the header (``RansTensor.check_header``) and the zero padding of the last packed group
of ``raw`` and ``escapes``; C, in the same call that decodes, first the CRC-32 of the small arrays (alphabet,
tables, block index) and those of ``RansTensor.check_index`` (``unw_rans_check``: the same verdicts and messages,
in microseconds), then the rest in the pass that decodes: the CRC-32 of raw, stream, escapes and the decoded
data, and per block that it reads exactly its own words and escapes and that every lane ends in state 2^16.

Both forms of FORMAT.md 9: one stage, and two stages (``low_bits`` > 0: the low mantissa bits coded with a table
chosen by the value's symbol; ``symbol_class`` and ``low_freqs`` are CRC'd with the other small arrays); the
first-stage tables by block or by context (``context_period`` > 0: a weight's table chosen by its column or row,
``context_table`` CRC'd here too).

Without a C compiler (or with ``UNFIRE_NATIVE=0``) ``decode_rans_cpu`` runs the NumPy decoder of
``reference.codec.rans``: the same bits, about ten times slower.

``UNFIRE_CPU_ISA`` (``fast.cpu_isa``) caps the paths: the AVX2 lanes (the AVX2 + BMI2 build) from ``avx2`` on, the
CRC as in ``decode_c``; same bits on every path; a set this CPU lacks raises ``CpuIsaError`` at the first decode.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import numpy as np

from fast import build_c
from reference.codec.errors import CodecError
from reference.codec.rans import RansTensor, decode_rans
from reference.codec.rans.model import field_group

SOURCE = Path(__file__).with_name("native") / "rans_decode.c"
_lock = threading.Lock()
_state: dict[str, Any] = {}  # the library ("lib") and the UNFIRE_CPU_ISA it was given ("isa")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {  # name: (return type, argument types), as in native/rans_decode.c
    "unw_rans_decode": (_INT, [_P, _I64, _P, _INT, _P, _INT, _P, _I64, _P, _P, _P, _P, _I64, _P, _I64,
                               _I64, _I64, _INT, _INT, _INT, _INT, _P, _P, _INT, _P, _I64, _I64, _INT, _P, _P]),
    "unw_rans_use": (_INT, [_INT]),
    "unw_rans_use512": (_INT, [_INT]),
    "unw_rans_isa": (_INT, [_INT]),
    "unw_rans_lanes_taken": (_INT, []),
}
MIN_WEIGHTS_PER_THREAD = 1 << 18  # fewer, and starting a thread costs more than it saves
SMALL_ARRAYS = ("alphabet", "tables", "block_words", "states", "block_table", "block_escapes", "symbol_class",
                "low_freqs", "context_table")  # CRC'd and checked (unw_rans_check) first, in unw_rans_decode
BAD_INDEX = 5  # unw_rans_decode's code for a failed index check (INDEX_ERRORS[crc_io[4]])
ERRORS = {  # unw_rans_decode's return codes
    1: "rANS stream is corrupt: block {0} does not end where it should (wrong number of words read, or a lane "
       "not back in its start state)",
    2: "the stream's escapes do not match block_escapes in block {0} (corrupt)",
    4: "out of memory",
}
CRC_ORDER = ("raw", "stream", "escapes", "data")
INDEX_ERRORS = {  # unw_rans_check's return codes: RansTensor.check_index's messages, in its order
    1: "the alphabet must hold distinct values < 2^(8 + mantissa_bits)",
    2: "a tensor with blocks needs at least one table",
    3: "every table's frequencies must sum to 2^prob_bits = {m}",
    4: "a block or a context names a table that does not exist",
    5: "a tensor with low bits and blocks needs at least one second-stage table",
    6: "every second-stage table's frequencies must sum to 2^prob_bits = {m}",
    7: "a symbol names a second-stage table that does not exist",
    8: "block_words must rise from 0 to {words}",
    9: "block_escapes must rise from 0 to {escapes}",
    10: "a block has more escapes than weights",
    11: "a lane's starting state is below 2^16: corrupt",
}


def library() -> ctypes.CDLL | None:
    """The compiled decoder, built on first use, capped by ``UNFIRE_CPU_ISA``; None if it cannot be built (or
    ``UNFIRE_NATIVE=0``)."""
    return build_c.load(_state, _lock, SOURCE, _SIGNATURES, "the C rANS decoder", "the NumPy rANS decoder",
                        isa="unw_rans_isa")


def _padding_is_zero(packed: np.ndarray, width: int, count: int) -> bool:
    """Whether the fields after the first ``count`` in the last packed group are 0 (FORMAT.md 9.1)."""
    per_group, nbytes = field_group(width)
    if packed.size == 0:
        return True
    used = count - (packed.size // nbytes - 1) * per_group  # the last group's fields in use
    return int.from_bytes(packed[-nbytes:].tobytes(), "little") >> (used * width) == 0


def decode_rans_many(tensors: list[RansTensor], *, threads: int = 1, native: bool | None = None) -> list[np.ndarray]:
    """Decompress rANS-form tensors as ``decode_rans_cpu`` does, into one buffer: each array returned is a view of
    it (the buffer is freed once every array of the call is gone). Why: writing the first time to fresh memory
    costs a page fault per 4 KB page, and these cost less in one large allocation than in many of a few MB (on
    this project's Intel Xeon VM, a container's 269 MB of SmolLM2 weights in 211 arrays: 135 ms of faults
    against 78 ms in one buffer per batch)."""
    sizes = [int(t.n) for t in tensors]
    starts = np.concatenate([[0], np.cumsum([-(-n // 32) * 32 for n in sizes], dtype=np.int64)])  # 64-byte aligned
    buffer = np.empty(int(starts[-1]), np.uint16)
    return [decode_rans_cpu(t, threads=threads, native=native, out=buffer[starts[i]:starts[i] + n])
            for i, (t, n) in enumerate(zip(tensors, sizes, strict=True))]


def decode_rans_cpu(t: RansTensor, *, threads: int = 1, native: bool | None = None,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Decompress a rANS-form tensor on the CPU: its bf16 bits (uint16, original shape). Raises CodecError.

    ``threads`` decodes tensors of at least ``2 * MIN_WEIGHTS_PER_THREAD`` weights in that many threads,
    which take the blocks in turn. ``native=None`` uses the C decoder when it builds, ``False`` the NumPy
    decoder, ``True`` C or raise. ``out``: a writeable, contiguous uint16 array of the tensor's weight count to
    decode into (returned reshaped; on an error its contents are undefined).
    """
    where = f"tensor {t.name!r}: " if t.name else ""
    if out is not None and not (isinstance(out, np.ndarray) and out.dtype == np.uint16 and out.size == t.n
                                and out.flags.c_contiguous and out.flags.writeable):
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"{where}decode_rans_cpu: out must be a writeable contiguous uint16 array of {t.n} "
                         f"weights, got {got}")
    lib = library() if native is not False else None
    if lib is None:
        if native:
            raise CodecError("decode_rans_cpu: the C rANS decoder is not available (no C compiler, or UNFIRE_NATIVE=0)")
        bits = decode_rans(t)
        if out is None:
            return bits
        out[...] = bits.reshape(-1)
        return out.reshape(t.shape)
    t.check_header()
    arrays = {k: np.ascontiguousarray(v) for k, v in t.arrays().items()}
    for key, a in arrays.items():
        if a.dtype.byteorder == ">":  # check_header accepts either byte order; C reads native order
            raise CodecError(f"{where}decode_rans_cpu takes native-order arrays, got {a.dtype} for {key}")
    a = arrays
    p = {k: v.ctypes.data for k, v in arrays.items()}  # each pointer once (~1 us each)
    if not (_padding_is_zero(arrays["raw"], t.raw_bits, t.n)
            and _padding_is_zero(arrays["escapes"], t.escape_bits, t.n_escapes)):
        raise CodecError(f"{where}the padding of the raw bits or of the escapes must be 0")
    # the CRCs the C checks: the big arrays' and the data's, two outputs, the small arrays'
    io = np.array([t.crc[k] for k in CRC_ORDER] + [0, 0] + [t.crc[k] for k in SMALL_ARRAYS], np.uint32)
    out = np.empty(t.n, np.uint16) if out is None else out.reshape(-1)
    threads = max(1, min(threads, t.n // MIN_WEIGHTS_PER_THREAD, 64))
    error = lib.unw_rans_decode(
        p["raw"], a["raw"].size, p["alphabet"], t.alphabet_size, p["tables"], t.n_tables, p["stream"],
        t.stream_words, p["block_words"], p["states"], p["block_table"], p["escapes"], a["escapes"].size,
        p["block_escapes"], t.n_escapes, t.n, t.block_size, t.lanes, t.prob_bits, t.mantissa_bits, t.low_bits,
        p["symbol_class"], p["low_freqs"], t.low_tables, p["context_table"], t.context_stride, t.context_period,
        threads, io.ctypes.data, out.ctypes.data)
    if error == BAD_INDEX:  # RansTensor.check_index's verdict and message, from unw_rans_check
        raise CodecError(where + INDEX_ERRORS[int(io[4])].format(m=1 << t.prob_bits, words=t.stream_words,
                                                                 escapes=t.n_escapes))
    if error == 3:
        key = (*CRC_ORDER, *SMALL_ARRAYS)[int(io[4])]
        what = "decoded data" if key == "data" else f"array {key}"
        raise CodecError(f"{where}{what} fails its CRC-32 check: the data is corrupt")
    if error:
        raise CodecError(where + ERRORS.get(error, f"C rANS decoder error {error}").format(int(io[4]), int(io[5])))
    return out.reshape(t.shape)
