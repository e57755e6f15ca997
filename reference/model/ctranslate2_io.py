"""A reader for CTranslate2's ``model.bin``, written from the format, in NumPy.

CTranslate2 (https://github.com/OpenNMT/CTranslate2) writes the file in
``python/ctranslate2/specs/model_spec.py`` (``ModelSpec._serialize``) and reads it in
``src/models/model.cc`` (``Model::load``). Every integer is unsigned little-endian (the writer
packs them in native order, and every platform it ships for is little-endian):

    u32        the binary version, 1 to 6
    string     the model spec's name, e.g. "WhisperSpec"          (version >= 2)
    u32        the spec's revision                                 (version >= 2)
    u32        V, the number of variables; then V times:
      string   the variable's name, e.g. "decoder/embeddings/weight"
      u8       its rank R, then R x u32, its shape (row-major, as NumPy's)
      u8       its dtype id (below)                                (version >= 4)
      u32      the number of bytes of its data                     (version >= 4)
      u8, u32  item size (4: float32, 2: int16, 1: int8), count    (version <= 3)
      bytes    the data, little-endian, C order
    u32        A, the number of aliases; then A times two strings:  (version >= 3)
               an alias and the variable it names (a tied weight is stored once)

    string     u16 L, the length counting a terminating NUL, then L bytes of UTF-8 ending in NUL
    dtype ids  0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16

The reader trusts nothing in the file: every count and length is checked against the bytes that
remain before it is used, a variable's byte count must match its shape and dtype, and the file must
end exactly after its last record. Anything else raises ``CTranslate2Error`` naming the file, the
byte offset and what was wrong. The data is memory-mapped and arrays are read-only views of it.
Dtypes are given in safetensors spelling ("F16", "BF16", ...); bfloat16 comes back as uint16 bit
patterns, as in the safetensors reader.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reference.model.errors import WeightError

MAX_BINARY_VERSION = 6  # the newest layout CTranslate2 writes (CURRENT_BINARY_VERSION)

# dtype id (version >= 4) -> (safetensors spelling, the NumPy dtype we hold it in)
DTYPE_IDS: dict[int, tuple[str, np.dtype]] = {
    0: ("F32", np.dtype("<f4")),
    1: ("I8", np.dtype("<i1")),
    2: ("I16", np.dtype("<i2")),
    3: ("I32", np.dtype("<i4")),
    4: ("F16", np.dtype("<f2")),
    5: ("BF16", np.dtype("<u2")),
}
# item size (version <= 3) -> dtype id, CTranslate2's old rule
LEGACY_ITEM_SIZES: dict[int, int] = {4: 0, 2: 2, 1: 1}


class CTranslate2Error(WeightError):
    """An unreadable model.bin: the message names the file, the offset and the problem."""


@dataclass(frozen=True)
class Variable:
    """Where one variable's data lies in the file."""

    dtype: str  # safetensors spelling
    shape: tuple[int, ...]
    offset: int  # of its first data byte
    nbytes: int


class _Cursor:
    """Reads the file's fields in order, refusing to read past its end."""

    def __init__(self, data: np.ndarray, path: Path):
        self.data, self.path, self.pos = data, path, 0

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def fail(self, message: str, at: int | None = None) -> CTranslate2Error:
        """The error for a record that starts at byte ``at`` (default: where the cursor is)."""
        return CTranslate2Error(f"{self.path}: at byte {self.pos if at is None else at}: {message}")

    def take(self, n: int, what: str) -> np.ndarray:
        if n > self.remaining():
            raise self.fail(f"{what} needs {n} bytes but only {self.remaining()} remain: truncated")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def uint(self, size: int, what: str) -> int:
        return int.from_bytes(self.take(size, what).tobytes(), "little")

    def string(self, what: str) -> str:
        start = self.pos
        length = self.uint(2, f"the length of {what}")
        if length == 0:
            raise self.fail(f"{what} has length 0 (a string holds at least its NUL)", start)
        raw = self.take(length, what).tobytes()
        if raw[-1] != 0 or 0 in raw[:-1]:
            raise self.fail(f"{what} is not one NUL-terminated string of {length} bytes", start)
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8", start) from None


class CTranslate2File:
    """The variables of one CTranslate2 model.bin, memory-mapped, read-only."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CTranslate2Error(f"{self.path}: no such file")
        if self.path.stat().st_size == 0:
            raise CTranslate2Error(f"{self.path}: empty file")
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.variables: dict[str, Variable] = {}
        self.aliases: dict[str, str] = {}  # alias -> the variable it names
        cur = _Cursor(self._data, self.path)
        self.version = cur.uint(4, "the binary version")
        if not 1 <= self.version <= MAX_BINARY_VERSION:
            raise CTranslate2Error(f"{self.path}: binary version {self.version} is not one this "
                                   f"reader knows (1 to {MAX_BINARY_VERSION}): not a CTranslate2 "
                                   "model.bin, or a newer one")
        self.spec, self.revision = "", 1
        if self.version >= 2:
            self.spec = cur.string("the spec name")
            self.revision = cur.uint(4, "the spec revision")
        for i in range(cur.uint(4, "the number of variables")):
            self._read_variable(cur, i)
        if self.version >= 3:
            for i in range(cur.uint(4, "the number of aliases")):
                start = cur.pos
                alias = cur.string(f"alias {i}")
                target = cur.string(f"the variable alias {alias!r} names")
                if target not in self.variables:
                    raise cur.fail(f"alias {alias!r} names {target!r}, which is no variable", start)
                if alias in self.variables or alias in self.aliases:
                    raise cur.fail(f"alias {alias!r} is defined twice", start)
                self.aliases[alias] = target
        if cur.remaining():
            raise cur.fail(f"{cur.remaining()} bytes follow the last record")

    def _read_variable(self, cur: _Cursor, i: int) -> None:
        """Variable ``i``'s record; its data is located, not read. Errors point at the record."""
        start = cur.pos
        name = cur.string(f"the name of variable {i}")
        if name in self.variables:
            raise cur.fail(f"variable {name!r} is defined twice", start)
        rank = cur.uint(1, f"the rank of {name!r}")
        dims = cur.take(4 * rank, f"the shape of {name!r}")
        shape = tuple(int(d) for d in dims.view("<u4"))
        if self.version >= 4:
            type_id = cur.uint(1, f"the dtype of {name!r}")
            if type_id not in DTYPE_IDS:
                raise cur.fail(f"{name!r} has dtype id {type_id}, not one of {sorted(DTYPE_IDS)}",
                               start)
            nbytes = cur.uint(4, f"the byte count of {name!r}")
        else:
            item_size = cur.uint(1, f"the item size of {name!r}")
            if item_size not in LEGACY_ITEM_SIZES:
                raise cur.fail(f"{name!r} has item size {item_size}, not one of "
                               f"{sorted(LEGACY_ITEM_SIZES)}", start)
            type_id = LEGACY_ITEM_SIZES[item_size]
            nbytes = cur.uint(4, f"the element count of {name!r}") * item_size
        dtype, np_dtype = DTYPE_IDS[type_id]
        expected = math.prod(shape) * np_dtype.itemsize
        if nbytes != expected:
            raise cur.fail(f"{name!r} says {nbytes} data bytes but shape {list(shape)} of {dtype} "
                           f"needs {expected}", start)
        offset = cur.pos
        cur.take(nbytes, f"the data of {name!r}")
        self.variables[name] = Variable(dtype, shape, offset, nbytes)

    def names(self) -> list[str]:
        """The stored variables, in file order (aliases not included: see ``aliases``)."""
        return list(self.variables)

    def dtype(self, name: str) -> str:
        return self._variable(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._variable(name).shape

    def get(self, name: str) -> np.ndarray:
        """The variable (or an alias's variable) as a read-only array; bfloat16 as uint16 bits."""
        v = self._variable(name)
        np_dtype = dict(DTYPE_IDS.values())[v.dtype]
        raw = self._data[v.offset:v.offset + v.nbytes]
        return np.asarray(raw).view(np_dtype).reshape(v.shape)

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.variables:
            yield name, self.get(name)

    def __len__(self) -> int:
        return len(self.variables)

    def _variable(self, name: str) -> Variable:
        try:
            return self.variables[self.aliases.get(name, name)]
        except KeyError:
            raise KeyError(f"{self.path}: no variable named {name!r}") from None
