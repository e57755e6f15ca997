"""The Huffman form of a compressed tensor: its header, its five arrays, and every check on them.

``CompressedTensor`` is what ``encode`` returns and ``decode`` takes. Its arrays are plain NumPy
(uint8 / uint32) so that kernels and the container can take them as they are. ``check()`` validates
everything that can be validated before decoding (FORMAT.md section 3.6); the decoder checks the
rest.
"""

from __future__ import annotations

import json
import math
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from reference.codec.errors import CodecError
from reference.codec.huffman import MAX_SUPPORTED_LENGTH, check_lengths
from reference.codec.layout import Layout
from reference.codec.palette import NOT_IN_PALETTE, symbol_table

FORMAT_NAME = "unweight"
VERSION = 1
ARRAY_DTYPES = {"sm": np.uint8, "stream": np.uint32, "offsets": np.uint32, "vchunks": np.uint32,
                "vexp": np.uint8}
CRC_KEYS = (*ARRAY_DTYPES, "data")
# the same, as dtype objects, in the order of arrays()
_DTYPES = tuple((key, np.dtype(dtype)) for key, dtype in ARRAY_DTYPES.items())
HEADER_KEYS = ("format", "version", "form", "shape", "chunk_size", "chunks_per_group",
               "max_code_length", "palette", "code_lengths", "n_verbatim", "stream_bits", "crc32")
MAX_CHUNK_SIZE, MAX_CHUNKS_PER_GROUP = 4096, 65536
# chunk_size * chunks_per_group: bounds the sequential work of decoding a group
MAX_GROUP_WEIGHTS = 65536
UINT32_LIMIT = 2**32
MAX_WEIGHTS = 2**48  # far above any real tensor; keeps every size computation inside int64


def crc32(array: np.ndarray) -> int:
    """CRC-32 of an array's little-endian bytes (what FORMAT.md calls the array's checksum)."""
    if (isinstance(array, np.ndarray) and array.flags.c_contiguous and array.dtype.byteorder != ">"
            and sys.byteorder == "little"):
        return zlib.crc32(array) if array.size else 0  # its bytes as they are (no copy)
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return zlib.crc32(array.view(np.uint8).reshape(-1)) if array.size else 0


class StoredForm:
    """What every stored form (Huffman, rANS) shares: a header dict and named arrays make the
    container entry."""

    def header(self) -> dict[str, Any]:
        raise NotImplementedError

    def arrays(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def header_json(self) -> str:
        return json.dumps(self.header(), separators=(",", ":"))

    @property
    def nbytes(self) -> int:
        """Compressed size with every overhead counted: the arrays plus the header JSON."""
        return sum(a.nbytes for a in self.arrays().values()) + len(self.header_json().encode())


@dataclass
class CompressedTensor(StoredForm):
    """A bf16 tensor in Huffman form (FORMAT.md section 3). Build it with ``encode`` or
    ``from_parts``."""

    shape: tuple[int, ...]
    chunk_size: int
    chunks_per_group: int
    max_code_length: int
    palette: tuple[int, ...]
    code_lengths: tuple[int, ...]
    stream_bits: int
    crc: dict[str, int]
    sm: np.ndarray  # uint8 [n]
    stream: np.ndarray  # uint32 [ceil(B / 32) + 1]
    offsets: np.ndarray  # uint32 [n_groups + 1]
    vchunks: np.ndarray  # uint32 [V]
    vexp: np.ndarray  # uint8 [V, chunk_size]
    name: str = ""  # used in error messages only

    @property
    def layout(self) -> Layout:
        return Layout(self.shape, self.chunk_size, self.chunks_per_group)

    @property
    def n(self) -> int:
        """Number of weights."""
        return math.prod(self.shape)

    @property
    def n_verbatim(self) -> int:
        return len(self.vchunks)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"sm": self.sm, "stream": self.stream, "offsets": self.offsets,
                "vchunks": self.vchunks, "vexp": self.vexp}

    def header(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "version": VERSION, "form": "huffman",
                "shape": list(self.shape),
                "chunk_size": self.chunk_size, "chunks_per_group": self.chunks_per_group,
                "max_code_length": self.max_code_length, "palette": list(self.palette),
                "code_lengths": list(self.code_lengths), "n_verbatim": self.n_verbatim,
                "stream_bits": self.stream_bits, "crc32": dict(self.crc)}

    @classmethod
    def from_parts(
        cls, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray], name: str = "", *,
        check_arrays: bool = True
    ) -> CompressedTensor:
        """Build from a parsed header and the five arrays, checking every field (raises CodecError).

        ``check_arrays=False`` leaves the checks of the arrays' contents to the decoder (the C
        decoder does them in its own pass); such a tensor must not be used before it is decoded."""
        where = f"tensor {name!r}: " if name else ""
        if not isinstance(header, Mapping):
            raise CodecError(f"{where}header must be a JSON object")
        _check_identity(header, where)
        unknown = set(header) - set(HEADER_KEYS)
        missing = set(HEADER_KEYS) - set(header)
        if unknown or missing:
            raise CodecError(f"{where}header has unknown keys {sorted(unknown)} / lacks keys "
                             f"{sorted(missing)}")
        shape = _int_list(header["shape"], "shape", 0, MAX_WEIGHTS, where)
        if math.prod(shape) > MAX_WEIGHTS:  # Python ints: no overflow before the check
            raise CodecError(f"{where}shape {shape} holds more than 2^48 weights: not a tensor "
                             "this format stores")
        palette = _int_list(header["palette"], "palette", 0, 255, where)
        crc = header["crc32"]
        if not isinstance(crc, Mapping) or set(crc) != set(CRC_KEYS):
            raise CodecError(f"{where}crc32 must have exactly the keys {list(CRC_KEYS)}")
        missing_arrays = set(ARRAY_DTYPES) - set(arrays)
        if missing_arrays:
            raise CodecError(f"{where}missing arrays {sorted(missing_arrays)}")
        ct = cls(
            shape=tuple(shape),
            chunk_size=_int(header["chunk_size"], "chunk_size", 1, MAX_CHUNK_SIZE, where),
            chunks_per_group=_int(header["chunks_per_group"], "chunks_per_group", 1,
                                  MAX_CHUNKS_PER_GROUP, where),
            max_code_length=_int(header["max_code_length"], "max_code_length", 1,
                                 MAX_SUPPORTED_LENGTH, where),
            palette=tuple(palette),
            code_lengths=tuple(_int_list(header["code_lengths"], "code_lengths", 0,
                                         MAX_SUPPORTED_LENGTH, where)),
            stream_bits=_int(header["stream_bits"], "stream_bits", 0, UINT32_LIMIT - 1, where),
            crc={k: _int(crc[k], f"crc32.{k}", 0, UINT32_LIMIT - 1, where) for k in CRC_KEYS},
            name=name,
            **{k: np.asarray(arrays[k]) for k in ARRAY_DTYPES},
        )
        if _int(header["n_verbatim"], "n_verbatim", 0, None, where) != ct.n_verbatim:
            raise CodecError(f"{where}header says {header['n_verbatim']} verbatim chunks, vchunks "
                             f"has {ct.n_verbatim}")
        ct.check_header()
        if check_arrays:
            ct.check_arrays()
        return ct

    def check(self) -> None:
        """Validate header ranges, array dtypes and lengths, offsets, verbatim ids and array
        CRCs."""
        self.check_header()
        self.check_arrays()

    def check_header(self) -> None:
        """The checks that read no array's contents: header ranges, palette, code lengths, array
        dtypes and lengths. A decoder that does the content checks itself (the C one) runs only
        these, once per tensor it decodes, so they are kept cheap (the tensor's name is formatted
        only into an error)."""
        n_chunks = self.layout.n_chunks
        if self.chunk_size * self.chunks_per_group > MAX_GROUP_WEIGHTS:
            raise CodecError(f"{self.where()}chunk_size * chunks_per_group must be <= "
                             f"{MAX_GROUP_WEIGHTS}")
        if len(set(self.palette)) != len(self.palette) or len(self.palette) > 256:
            raise CodecError(f"{self.where()}palette must hold distinct exponents, got "
                             f"{list(self.palette)}")
        if len(self.code_lengths) != len(self.palette):
            raise CodecError(f"{self.where()}{len(self.code_lengths)} code lengths for a palette "
                             f"of {len(self.palette)}")
        try:
            check_lengths(self.code_lengths, self.max_code_length)
        except CodecError as e:
            raise CodecError(f"{self.where()}{e}") from None
        if n_chunks >= UINT32_LIMIT:
            raise CodecError(f"{self.where()}shape {self.shape} has too many chunks for 32-bit "
                             "chunk ids")
        expected = (
            (self.sm, (math.prod(self.shape),)),
            (self.stream, (self.stream_bits // 32 + (self.stream_bits % 32 > 0) + 1,)),
            (self.offsets, (-(-n_chunks // self.chunks_per_group) + 1,)),
            (self.vchunks, (self.n_verbatim,)),
            (self.vexp, (self.n_verbatim, self.chunk_size)),
        )
        for (key, dtype), (a, shape) in zip(_DTYPES, expected, strict=True):
            # a native-order array passes the first test; the other byte order is accepted too
            if (a.dtype != dtype and a.dtype.newbyteorder("=") != dtype) or a.shape != shape:
                raise CodecError(f"{self.where()}array {key} is {a.dtype}{list(a.shape)}, expected "
                                 f"{dtype}{list(shape)} (truncated or corrupt)")

    def where(self) -> str:
        """``tensor 'name': `` for error messages (empty for an unnamed tensor)."""
        return f"tensor {self.name!r}: " if self.name else ""

    def check_arrays(self) -> None:
        """The checks on the arrays' contents (FORMAT.md 3.6): CRCs, offsets, verbatim ids and
        chunks, tail bits.

        Call ``check_header`` first: these read the arrays at the lengths it checked."""
        where = f"tensor {self.name!r}: " if self.name else ""
        layout = self.layout
        for key, a in self.arrays().items():
            if crc32(a) != self.crc[key]:
                raise CodecError(f"{where}array {key} fails its CRC-32 check: the data is corrupt")
        offsets = self.offsets.astype(np.int64)
        if offsets[0] != 0 or offsets[-1] != self.stream_bits or np.any(np.diff(offsets) < 0):
            raise CodecError(f"{where}group offsets must rise from 0 to "
                             f"stream_bits={self.stream_bits}")
        v = self.vchunks.astype(np.int64)
        if v.size and (np.any(np.diff(v) <= 0) or v[-1] >= layout.n_chunks):
            raise CodecError(
                f"{where}verbatim chunk ids must be increasing and < {layout.n_chunks}"
            )
        pad = np.arange(self.chunk_size) >= layout.chunk_length(v)[:, None]
        if np.any(self.vexp[pad]):
            raise CodecError(f"{where}padding bytes of short verbatim chunks must be 0")
        outside = (symbol_table(self.palette)[self.vexp] == NOT_IN_PALETTE) & ~pad
        if not outside.any(axis=1).all():
            raise CodecError(f"{where}a verbatim chunk holds only palette exponents (the verbatim "
                             "rule is iff)")
        n_coded = layout.n - int(layout.chunk_length(v).sum())
        if n_coded > 0 and not any(self.code_lengths):
            raise CodecError(f"{where}{n_coded} weights are coded but no symbol has a code")
        used = [length for length in self.code_lengths if length]
        if not min(used, default=0) * n_coded <= self.stream_bits <= max(used, default=0) * n_coded:
            raise CodecError(f"{where}stream_bits={self.stream_bits} impossible for {n_coded} "
                             "coded weights")
        tail = self.stream_bits % 32
        if (tail and self.stream[self.stream_bits // 32] & ((1 << (32 - tail)) - 1)) or self.stream[
            -1
        ]:
            raise CodecError(f"{where}bits after the end of the stream must be 0")


def _check_identity(header: Mapping[str, Any], where: str) -> None:
    if header.get("format") != FORMAT_NAME:
        raise CodecError(f"{where}not an {FORMAT_NAME} header (format={header.get('format')!r})")
    if header.get("version") != VERSION:
        raise CodecError(f"{where}unsupported format version {header.get('version')!r}; this "
                         f"reader knows {VERSION}")
    if header.get("form") != "huffman":
        raise CodecError(f"{where}expected form 'huffman', got {header.get('form')!r}")


def _int(x: object, what: str, lo: int, hi: int | None, where: str) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < lo or (hi is not None and x > hi):
        raise CodecError(f"{where}{what} must be an integer in [{lo}, "
                         f"{hi if hi is not None else 'inf'}], got {x!r}")
    return x


def _int_list(x: object, what: str, lo: int, hi: int | None, where: str) -> list[int]:
    if not isinstance(x, list):
        raise CodecError(f"{where}{what} must be a list, got {type(x).__name__}")
    return [_int(v, f"{what} entry", lo, hi, where) for v in x]
