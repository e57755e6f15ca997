"""The rANS form of a compressed tensor: its header, its twelve arrays, and every check on them
(FORMAT.md 9).

``RansTensor`` is what ``encode_rans`` returns and ``decode_rans`` takes. Like ``CompressedTensor``
its arrays are plain NumPy, ready for a kernel or the container; ``check()`` validates everything
that can be validated before decoding, the decoder checks the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from reference.codec.errors import CodecError
from reference.codec.format import (
    FORMAT_NAME,
    UINT32_LIMIT,
    VERSION,
    StoredForm,
    _int,
    _int_list,
    crc32,
)
from reference.codec.rans.coder import MAX_PROB_BITS, STATE_LOW
from reference.codec.rans.model import packed_length

FORM = "rans"
ARRAY_DTYPES = {"raw": np.uint8, "alphabet": np.uint16, "tables": np.uint16, "stream": np.uint16,
                "block_words": np.uint32, "states": np.uint32, "block_table": np.uint8,
                "escapes": np.uint8, "block_escapes": np.uint32, "symbol_class": np.uint8,
                "low_freqs": np.uint16, "context_table": np.uint8}
CRC_KEYS = (*ARRAY_DTYPES, "data")
_DTYPES = {key: np.dtype(dtype) for key, dtype in ARRAY_DTYPES.items()}  # (built once)
# The second stage (low mantissa bits coded by class) came later: a one-stage tensor written before
# it has no low_bits / low_tables keys, no symbol_class / low_freqs arrays and no CRCs of them. It
# is read as k = 0, C = 0.
SECOND_STAGE_KEYS = ("low_bits", "low_tables")
SECOND_STAGE_ARRAYS = ("symbol_class", "low_freqs")
# Tables chosen by a context (the column or the row of a weight, FORMAT.md 9.2) came later still: a
# tensor written before them has no context_stride / context_period keys, no context_table array and
# no CRC of it.
# It is read as D = 1, P = 0 (each block's table named by block_table).
CONTEXT_KEYS = ("context_stride", "context_period")
CONTEXT_ARRAYS = ("context_table",)
HEADER_KEYS = ("format", "version", "form", "shape", "block_size", "lanes", "prob_bits",
               "mantissa_bits", "low_bits", "low_tables", "alphabet_size", "n_tables",
               "context_stride", "context_period", "stream_words", "n_escapes", "crc32")
MAX_BLOCK_SIZE, MAX_LANES, MAX_TABLES, MAX_ALPHABET = 1 << 24, 1024, 256, 1 << MAX_PROB_BITS
# ceil(block_size / lanes): bounds the sequential work of one lane (a GPU thread)
MAX_LANE_STEPS = 65536
MAX_DIMS = 32  # NumPy's limit
MAX_PERIOD = 1 << 24  # P: the context table's length
MAX_STRIDE = 1 << 48  # D
MIN_PROB_BITS = 1


def written_before_second_stage(header: Mapping[str, Any]) -> bool:
    """A header without any second-stage key (an earlier writer's one-stage tensor)."""
    return not any(k in header for k in SECOND_STAGE_KEYS)


def written_before_context(header: Mapping[str, Any]) -> bool:
    """A header without any context key (an earlier writer's tensor: tables chosen by block)."""
    return not any(k in header for k in CONTEXT_KEYS)


def stored_arrays(header: Mapping[str, Any]) -> tuple[str, ...]:
    """The arrays a container holds for a tensor with this header (an earlier writer's: none of
    the second stage's, none of the context's)."""
    absent = (SECOND_STAGE_ARRAYS if written_before_second_stage(header) else ()) + (
        CONTEXT_ARRAYS if written_before_context(header) else ())
    return tuple(k for k in ARRAY_DTYPES if k not in absent)


@dataclass
class RansTensor(StoredForm):
    """A bf16 tensor in rANS form (FORMAT.md section 9). Build it with ``encode_rans`` or
    ``from_parts``."""

    shape: tuple[int, ...]
    block_size: int
    lanes: int
    prob_bits: int
    mantissa_bits: int
    alphabet_size: int  # A: symbols 0 .. A - 1 are alphabet values, symbol A is the escape
    n_tables: int
    stream_words: int
    n_escapes: int
    crc: dict[str, int]
    raw: np.ndarray  # uint8: the 8 - m raw bits of every weight, packed
    alphabet: np.ndarray  # uint16 [A]: the value of each symbol (symbol A is the escape)
    tables: np.ndarray  # uint16 [n_tables, A + 1]: frequencies, each row summing to 2^prob_bits
    stream: np.ndarray  # uint16 [W]: the words of every block, block after block
    block_words: np.ndarray  # uint32 [n_blocks + 1]: where each block's words start
    states: np.ndarray  # uint32 [n_blocks, lanes]: each lane's starting state
    block_table: np.ndarray  # uint8 [n_blocks]: the table each block uses
    escapes: np.ndarray  # uint8: the escaped weights' values, (8 + m)-bit fields, packed
    block_escapes: np.ndarray  # uint32 [n_blocks + 1]: where each block's escapes start
    symbol_class: np.ndarray  # uint8 [A + 1] (k > 0) or [0]: the second-stage table of each symbol
    # uint16 [low_tables, 2^k]: the second-stage tables, each row summing to 2^prob_bits
    low_freqs: np.ndarray
    # uint8 [P]: with P > 0, weight i's table is context_table[(i // D) % P] (block_table: [0])
    context_table: np.ndarray = None  # type: ignore[assignment]
    # k: mantissa bits coded in the second stage, with a table chosen by the first symbol
    low_bits: int = 0
    low_tables: int = 0  # C: second-stage tables (0 when k = 0)
    context_stride: int = 1  # D
    context_period: int = 0  # P: 0 = each block's table named by block_table
    name: str = ""  # used in error messages only

    def __post_init__(self) -> None:
        if self.context_table is None:
            self.context_table = np.zeros(0, np.uint8)

    @property
    def n(self) -> int:
        return math.prod(self.shape)  # Python integers: a huge shape cannot wrap around

    @property
    def n_blocks(self) -> int:
        return -(-self.n // self.block_size)

    @property
    def raw_bits(self) -> int:
        return 8 - self.mantissa_bits - self.low_bits

    @property
    def escape_bits(self) -> int:
        return 8 + self.mantissa_bits

    def block_lengths(self) -> np.ndarray:
        """Weights per block (int64): block_size, the last one possibly shorter."""
        return np.minimum(
            self.block_size, self.n - self.block_size * np.arange(self.n_blocks, dtype=np.int64)
        )

    def arrays(self) -> dict[str, np.ndarray]:
        return {key: getattr(self, key) for key in ARRAY_DTYPES}

    def header(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "version": VERSION, "form": FORM, "shape": list(self.shape),
                "block_size": self.block_size, "lanes": self.lanes, "prob_bits": self.prob_bits,
                "mantissa_bits": self.mantissa_bits, "low_bits": self.low_bits,
                "low_tables": self.low_tables,
                "alphabet_size": self.alphabet_size,
                "n_tables": self.n_tables,
                "context_stride": self.context_stride, "context_period": self.context_period,
                "stream_words": self.stream_words, "n_escapes": self.n_escapes,
                "crc32": dict(self.crc)}

    @classmethod
    def from_parts(cls, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray], name: str = "",
                   *, check_arrays: bool = True) -> RansTensor:
        """Build from a parsed header and the twelve arrays, checking every field (raises
        CodecError).
        ``check_arrays=False`` checks only the header and the arrays' dtypes and shapes: for a
        decoder that checks the contents itself (the C one)."""
        where = f"tensor {name!r}: " if name else ""
        if not isinstance(header, Mapping):
            raise CodecError(f"{where}header must be a JSON object")
        if written_before_second_stage(header):  # a one-stage tensor of an earlier writer
            crc = header.get("crc32")
            header = {**header, "low_bits": 0, "low_tables": 0}
            empty = crc32(np.zeros(0, np.uint8))
            if isinstance(crc, Mapping):
                header["crc32"] = {**crc, **{k: empty for k in SECOND_STAGE_ARRAYS}}
            arrays = {**arrays, "symbol_class": np.zeros(0, np.uint8),
                      "low_freqs": np.zeros((0, 1), np.uint16)}
        if written_before_context(header):  # tables chosen by block: an earlier writer's tensor
            crc = header.get("crc32")
            header = {**header, "context_stride": 1, "context_period": 0}
            if isinstance(crc, Mapping):
                header["crc32"] = {**crc, "context_table": crc32(np.zeros(0, np.uint8))}
            arrays = {**arrays, "context_table": np.zeros(0, np.uint8)}
        if (
            header.get("format") != FORMAT_NAME
            or header.get("version") != VERSION
            or header.get("form") != FORM
        ):
            raise CodecError(f"{where}not a version-{VERSION} {FORMAT_NAME} header of form "
                             f"{FORM!r} "
                             f"(format={header.get('format')!r}, "
                             f"version={header.get('version')!r}, "
                             f"form={header.get('form')!r})")
        unknown, missing = set(header) - set(HEADER_KEYS), set(HEADER_KEYS) - set(header)
        if unknown or missing:
            raise CodecError(f"{where}header has unknown keys {sorted(unknown)} / lacks keys "
                             f"{sorted(missing)}")
        crc = header["crc32"]
        if not isinstance(crc, Mapping) or set(crc) != set(CRC_KEYS):
            raise CodecError(f"{where}crc32 must have exactly the keys {list(CRC_KEYS)}")
        if set(ARRAY_DTYPES) - set(arrays):
            raise CodecError(f"{where}missing arrays {sorted(set(ARRAY_DTYPES) - set(arrays))}")
        mantissa_bits = _int(header["mantissa_bits"], "mantissa_bits", 0, 7, where)
        t = cls(
            shape=tuple(_int_list(header["shape"], "shape", 0, None, where)),
            block_size=_int(header["block_size"], "block_size", 1, MAX_BLOCK_SIZE, where),
            lanes=_int(header["lanes"], "lanes", 1, MAX_LANES, where),
            prob_bits=_int(header["prob_bits"], "prob_bits", MIN_PROB_BITS, MAX_PROB_BITS, where),
            mantissa_bits=mantissa_bits,
            low_bits=_int(header["low_bits"], "low_bits", 0, 7 - mantissa_bits, where),
            low_tables=_int(header["low_tables"], "low_tables", 0, MAX_TABLES, where),
            alphabet_size=_int(header["alphabet_size"], "alphabet_size", 0, MAX_ALPHABET, where),
            n_tables=_int(header["n_tables"], "n_tables", 0, MAX_TABLES, where),
            context_stride=_int(header["context_stride"], "context_stride", 1, MAX_STRIDE, where),
            context_period=_int(header["context_period"], "context_period", 0, MAX_PERIOD, where),
            stream_words=_int(header["stream_words"], "stream_words", 0, UINT32_LIMIT - 1, where),
            n_escapes=_int(header["n_escapes"], "n_escapes", 0, UINT32_LIMIT - 1, where),
            crc={k: _int(crc[k], f"crc32.{k}", 0, UINT32_LIMIT - 1, where) for k in CRC_KEYS},
            name=name,
            **{k: np.asarray(arrays[k]) for k in ARRAY_DTYPES},
        )
        t.check() if check_arrays else t.check_header()
        return t

    def check(self) -> None:
        """Validate parameters, array dtypes and shapes, CRCs, tables, block index and states."""
        self.check_header()
        self.check_crcs(ARRAY_DTYPES)
        self.check_index()

    def check_header(self) -> None:
        """The checks that read no array's contents: parameters, array dtypes and shapes. A decoder
        that does the rest itself (the C one: CRCs of the big arrays) runs this, ``check_index`` and
        ``check_crcs`` of the small arrays."""
        where = f"tensor {self.name!r}: " if self.name else ""
        if not (
            1 <= self.block_size <= MAX_BLOCK_SIZE
            and 1 <= self.lanes <= MAX_LANES
            and MIN_PROB_BITS <= self.prob_bits <= MAX_PROB_BITS
            and 0 <= self.mantissa_bits <= 7
            and 0 <= self.alphabet_size < 1 << self.prob_bits
            and 0 <= self.n_tables <= MAX_TABLES
            and 0 <= self.low_bits <= 7 - self.mantissa_bits
            and 0 <= self.low_tables <= MAX_TABLES
            and (self.low_bits > 0 or self.low_tables == 0)
            and 1 <= self.context_stride <= MAX_STRIDE
            and 0 <= self.context_period <= MAX_PERIOD
        ):
            raise CodecError(f"{where}block_size, lanes, prob_bits, mantissa_bits, low_bits, "
                             "alphabet_size, n_tables, low_tables, context_stride or "
                             "context_period out of "
                             "range (the alphabet "
                             "needs fewer than 2^prob_bits symbols, m + k <= 7, no second-stage "
                             "tables without low bits)")
        if len(self.shape) > MAX_DIMS or math.prod(max(d, 1) for d in self.shape) >= 1 << 62:
            raise CodecError(f"{where}shape {list(self.shape)} is beyond what an array can hold")
        if -(-self.block_size // self.lanes) > MAX_LANE_STEPS:
            raise CodecError(f"{where}ceil(block_size / lanes) must be <= {MAX_LANE_STEPS}")
        if self.n_blocks >= UINT32_LIMIT:
            raise CodecError(f"{where}shape {self.shape} has too many blocks")
        a, nb = self.alphabet_size, self.n_blocks
        expected = {
            "raw": (packed_length(self.n, self.raw_bits),),
            "alphabet": (a,),
            "tables": (self.n_tables, a + 1),
            "stream": (self.stream_words,),
            "block_words": (nb + 1,),
            "states": (nb, self.lanes),
            "block_table": (0 if self.context_period else nb,),
            "escapes": (packed_length(self.n_escapes, self.escape_bits),),
            "block_escapes": (nb + 1,),
            "symbol_class": (a + 1 if self.low_bits else 0,),
            "low_freqs": (self.low_tables, 1 << self.low_bits),
            "context_table": (self.context_period,),
        }
        arrays = self.arrays()
        for key, dtype in _DTYPES.items():
            array = arrays[key]
            if array.shape != expected[key] or (array.dtype != dtype
                                                and array.dtype.newbyteorder("=") != dtype):
                raise CodecError(f"{where}array {key} is {array.dtype}{list(array.shape)}, "
                                 "expected "
                                 f"{np.dtype(dtype)}{list(expected[key])} (truncated or corrupt)")

    def check_crcs(self, keys: Iterable[str]) -> None:
        """The CRC-32 of each named array (after ``check_header``)."""
        where = f"tensor {self.name!r}: " if self.name else ""
        for key in keys:
            if crc32(getattr(self, key)) != self.crc[key]:
                raise CodecError(f"{where}array {key} fails its CRC-32 check: the data is corrupt")

    def check_index(self) -> None:
        """The alphabet, tables, block index and states (after ``check_header``; the CRCs are
        separate)."""
        where = f"tensor {self.name!r}: " if self.name else ""
        if np.any(self.alphabet >> self.escape_bits) or np.any(
            np.diff(np.sort(self.alphabet)) == 0
        ):
            raise CodecError(f"{where}the alphabet must hold distinct values < 2^(8 + "
                             "mantissa_bits)")
        if self.n_blocks and not self.n_tables:
            raise CodecError(f"{where}a tensor with blocks needs at least one table")
        if np.any(self.tables.astype(np.int64).sum(axis=1) != 1 << self.prob_bits):
            raise CodecError(f"{where}every table's frequencies must sum to 2^prob_bits = "
                             f"{1 << self.prob_bits}")
        if np.any(self.block_table >= self.n_tables) or np.any(self.context_table >= self.n_tables):
            raise CodecError(f"{where}a block or a context names a table that does not exist")
        if self.low_bits and self.n_blocks and not self.low_tables:
            raise CodecError(f"{where}a tensor with low bits and blocks needs at least one "
                             "second-stage table")
        if np.any(self.low_freqs.astype(np.int64).sum(axis=1) != 1 << self.prob_bits):
            raise CodecError(f"{where}every second-stage table's frequencies must sum to "
                             f"2^prob_bits = {1 << self.prob_bits}")
        if np.any(self.symbol_class >= self.low_tables):
            raise CodecError(f"{where}a symbol names a second-stage table that does not exist")
        for key, end in (("block_words", self.stream_words), ("block_escapes", self.n_escapes)):
            starts = self.arrays()[key].astype(np.int64)
            if starts[0] != 0 or starts[-1] != end or np.any(np.diff(starts) < 0):
                raise CodecError(f"{where}{key} must rise from 0 to {end}")
        if np.any(np.diff(self.block_escapes.astype(np.int64)) > self.block_lengths()):
            raise CodecError(f"{where}a block has more escapes than weights")
        if np.any(self.states < STATE_LOW):
            raise CodecError(f"{where}a lane's starting state is below 2^16: corrupt")
