"""A safetensors reader and writer written from the format, in NumPy.

The format (https://huggingface.co/docs/safetensors) is:

    8 bytes    N, the header length, unsigned little-endian
    N bytes    a JSON object: {"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}}
    the rest   raw little-endian tensor bytes; data_offsets [begin, end) count from here

The reader trusts nothing in the file: every length and offset is checked against the file's real
size before any byte is touched, and the data is memory-mapped, so a multi-GB checkpoint is never
read into memory at once. bfloat16 tensors come back as uint16 bit patterns (see reference/bf16.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reference import jsonsafe
from reference.safe_write import atomic_output

# safetensors dtype name -> the NumPy dtype we hold it in (bf16 and fp8 as raw bits)
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "F8_E4M3": np.dtype("<u1"),
    "F8_E5M2": np.dtype("<u1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}
# the default safetensors dtype for a NumPy array (uint16 means U16: say "BF16" explicitly)
_DEFAULT_NAME = {
    np.dtype(np.bool_): "BOOL",
    np.dtype("u1"): "U8",
    np.dtype("i1"): "I8",
    np.dtype("u2"): "U16",
    np.dtype("i2"): "I16",
    np.dtype("f2"): "F16",
    np.dtype("u4"): "U32",
    np.dtype("i4"): "I32",
    np.dtype("f4"): "F32",
    np.dtype("u8"): "U64",
    np.dtype("i8"): "I64",
    np.dtype("f8"): "F64",
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the reference Rust implementation enforces


class SafetensorsError(ValueError):
    """A safetensors file is missing, truncated or malformed. The message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file, as the header describes it (already validated)."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


class SafetensorsFile(Mapping[str, np.ndarray]):
    """A read-only, memory-mapped view of one .safetensors file: ``f[name]`` is a NumPy array.

    Arrays are views into the mapping (read-only); copy them to keep them past ``close()``.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata, self._infos, self._data_start = _read_header(self.path)
        data_bytes = self.path.stat().st_size - self._data_start
        # a plain view of the mapping: slices of a memmap run Python code each (~3 us a tensor)
        self._map = (
            np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start).view(np.ndarray)
            if data_bytes > 0
            else np.zeros(0, np.uint8)
        )

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def __getitem__(self, name: str) -> np.ndarray:
        info = self.info(name)
        raw = self._map[info.begin : info.end]
        return raw.view(DTYPES[info.dtype]).reshape(info.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def close(self) -> None:
        self._map = np.zeros(0, np.uint8)

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_header(path: Path) -> tuple[dict[str, str], dict[str, TensorInfo], int]:
    """Parse and validate the header; return (metadata, infos in file order, data start)."""
    if not path.exists():
        raise SafetensorsError(f"{path}: no such file")
    if not path.is_file():
        raise SafetensorsError(f"{path}: not a regular file")
    size = path.stat().st_size
    if size < 8:
        raise SafetensorsError(f"{path}: truncated: {size} bytes, too short for the 8-byte header "
                               "length")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte "
                                   "limit")
        if 8 + n > size:
            raise SafetensorsError(
                f"{path}: truncated: header length says {n} bytes but only {size - 8} follow"
            )
        raw = f.read(n)
    try:
        header = jsonsafe.loads(raw, what="header")
    except jsonsafe.JsonError as e:
        raise SafetensorsError(f"{path}: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header must be a JSON object, got {type(header).__name__}")

    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")

    data_size = size - 8 - n
    infos = {name: _parse_entry(path, name, entry, data_size) for name, entry in header.items()}
    _check_no_overlap(path, infos.values())
    return metadata, infos, 8 + n


def _parse_entry(path: Path, name: str, entry: object, data_size: int) -> TensorInfo:
    def bad(why: str) -> SafetensorsError:
        return SafetensorsError(f"{path}: tensor {name!r}: {why}")

    if not isinstance(entry, dict):
        raise bad("entry must be a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"shape must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise bad(f"data_offsets must be two non-negative integers, got {offsets!r}")
    begin, end = offsets
    if begin > end:
        raise bad(f"data_offsets [{begin}, {end}] run backwards")
    if end > data_size:
        raise bad(
            f"data_offsets [{begin}, {end}] point past the end of the data "
            f"({data_size} bytes): the file is truncated or the header is corrupt"
        )
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise bad(f"holds {end - begin} bytes but shape {shape} of {dtype} needs {expected}")
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_no_overlap(path: Path, infos: Iterable[TensorInfo]) -> None:
    spans = sorted((i.begin, i.end, i.name) for i in infos if i.end > i.begin)
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise SafetensorsError(f"{path}: tensors {name_a!r} and {name_b!r} overlap")


def write_safetensors(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    dtypes: Mapping[str, str] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write tensors to a .safetensors file.

    ``dtypes`` overrides the safetensors dtype of a tensor; use it for bf16 (a uint16 array written
    as "BF16") and fp8 (uint8 written as "F8_E4M3"). The file is written to a temporary name and
    renamed, so a crash never leaves a half-written file under ``path`` (see ``atomic_output``).
    """
    dtypes = dict(dtypes or {})
    arrays, entries = [], []
    for name, array in tensors.items():
        array = np.asarray(array, order="C")  # (not ascontiguousarray: it turns 0-d into 1-d)
        dtype = dtypes.get(name) or _DEFAULT_NAME.get(array.dtype.newbyteorder("="))
        if dtype is None:
            raise TypeError(f"tensor {name!r}: no safetensors dtype for NumPy dtype {array.dtype}")
        arrays.append(array)
        entries.append((name, dtype, array.shape))
    write_safetensors_stream(path, entries, arrays, metadata)


def header_bytes(entries: Iterable[tuple[str, str, Iterable[int]]],
                 metadata: Mapping[str, str] | None = None) -> bytes:
    """The first bytes of a safetensors file whose tensors are ``entries`` (name, safetensors dtype,
    shape), in this order, their data back to back: the 8-byte length and the JSON header, padded
    with spaces so that the data starts 8-byte aligned."""
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in DTYPES:
            raise TypeError(f"tensor {name!r}: unknown safetensors dtype {dtype!r}")
        if name in header:
            raise ValueError(f"two tensors named {name!r}")
        shape = [int(d) for d in shape]
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # pad so the data section starts 8-byte aligned
    return len(blob).to_bytes(8, "little") + blob


def write_safetensors_stream(path: str | Path, entries: Iterable[tuple[str, str, Iterable[int]]],
                             arrays: Iterable[np.ndarray],
                             metadata: Mapping[str, str] | None = None) -> None:
    """Write a safetensors file whose tensors are known before their data: ``entries`` (name,
    safetensors dtype, shape), then ``arrays``, one per entry in the same order, consumed one at a
    time (so a generator that decodes them keeps one in memory). The header goes first, then each
    array's bytes straight from its buffer (no copy on a little-endian machine). Each array must
    have its entry's shape and its dtype's item size, else ``TypeError`` and no file. Written
    through ``atomic_output``, as ``write_safetensors``."""
    entries = [(name, dtype, tuple(int(d) for d in shape)) for name, dtype, shape in entries]
    head = header_bytes(entries, metadata)
    with atomic_output(path) as f:
        f.write(head)
        it = iter(arrays)
        for name, dtype, shape in entries:
            array = next(it, None)
            if array is None:
                raise TypeError(f"tensor {name!r}: no array given")
            array = np.asarray(array, order="C")
            if DTYPES[dtype].itemsize != array.dtype.itemsize:
                raise TypeError(f"tensor {name!r}: {array.dtype} cannot be stored as {dtype}")
            if array.shape != shape:
                raise TypeError(f"tensor {name!r}: shape {array.shape}, its entry says {shape}")
            array = array.astype(array.dtype.newbyteorder("<"), copy=False)
            f.write(array.reshape(-1).view(np.uint8).data)
        if next(it, None) is not None:
            raise TypeError(f"more arrays than the {len(entries)} entries")
