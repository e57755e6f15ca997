"""The checkpoint container: a safetensors file of compressed streams (FORMAT.md section 6).

    compress_checkpoint("minilm", "minilm.unweight.safetensors", to_bf16=True)
    with Container("minilm.unweight.safetensors") as c:
        bits = c.get("encoder.layer.0.intermediate.dense.weight")   # bf16 bits, verified
    decompress_checkpoint("minilm.unweight.safetensors", "minilm.bf16.safetensors")

Any safetensors tool opens the container: each compressed tensor is a few plain arrays
(``name::sm`` ...), its header is a JSON string in ``__metadata__``. Big checkpoints never sit in
memory at once: arrays are parked in a scratch file next to the output and memory-mapped back.
``mode="rans"`` stores the tensors in the rANS form (FORMAT.md section 9) instead of the Unweight
Huffman form; a container may hold both, each tensor's header says which.

Nothing is lost on the way: the output appears complete or not at all (``atomic_output``), the
scratch file goes on every exit path, an output that is the input is refused, and so is a container
given as the source. Each tensor's header carries a CRC-32 of itself and the tensor's name
(``header_crc32``, FORMAT.md section 6.1), so a changed shape or dtype is caught, not decoded.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from reference import jsonsafe
from reference.bf16 import float32_to_bf16
from reference.codec import rans
from reference.codec.codec import encode
from reference.codec.errors import CodecError
from reference.codec.format import ARRAY_DTYPES, FORMAT_NAME, VERSION, CompressedTensor, crc32
from reference.codec.lockstep import decode_many
from reference.codec.paths import check_output, input_paths
from reference.model.carried import MODEL_KEY, ContainerFile, model_entry
from reference.model.errors import WeightError
from reference.model.safetensors_io import DTYPES, SafetensorsError, SafetensorsFile, write_safetensors
from reference.model.weights import open_weights
from reference.safe_write import discard, temporary_file

MIN_ELEMENTS = 4096  # smaller tensors (norms, biases) pass through: their header would cost more than they save
CASTABLE = ("F32", "F16")  # cast to bf16 (round-to-nearest-even) with to_bf16=True
DECODE_BATCH = 1 << 24  # weights decoded together in one lockstep pass
SEP = "::"
MODES = {"unweight": "huffman", "rans": rans.FORM}  # a mode (the CLI's --mode) writes one form
CONTAINER_VERSION = 2  # version 2 added each tensor's header_crc32 (FORMAT.md section 6.1)
HEADER_CRC = "header_crc32"
Encoder = Callable[..., CompressedTensor]  # encode(bits, name=..., **params): the Huffman form
HuffmanDecoder = Callable[[list[CompressedTensor]], list[np.ndarray]]  # Huffman-form tensors -> their bits
RansDecoder = Callable[[list[rans.RansTensor]], list[np.ndarray]]  # rANS-form tensors -> their bits
Compressed = CompressedTensor | rans.RansTensor


class Form(NamedTuple):
    """What the container needs of a compressed form; FORMS maps the header's ``form`` value to it.

    The tensor type has ``from_parts(header, arrays, name=...)``, ``header()``, ``arrays()``, ``n``
    and ``nbytes``; ``encode_many(bit arrays, names=..., **params)`` and ``decode_many(tensors)`` work
    on lists; the container gathers ``batch_weights`` weights before it encodes (0: one at a time)."""

    arrays: dict[str, type]
    tensor: type
    encode_many: Callable[..., list[Compressed]]
    decode_many: Callable[[list[Any]], list[np.ndarray]]
    batch_weights: int


def huffman_form(encoder: Encoder = encode, decoder: HuffmanDecoder = decode_many) -> Form:
    """The Unweight Huffman form (FORMAT.md sections 3-6), with a given encoder and decoder."""
    def encode_many(tensors: list[np.ndarray], *, names: list[str], **params: Any) -> list[CompressedTensor]:
        return [encoder(bits, name=name, **params) for bits, name in zip(tensors, names, strict=True)]

    return Form(ARRAY_DTYPES, CompressedTensor, encode_many, decoder, 0)


RANS_FORM = Form(rans.ARRAY_DTYPES, rans.RansTensor, rans.encode_rans_many, rans.decode_rans_many, rans.ENCODE_BATCH)
FORMS = {"huffman": huffman_form(), rans.FORM: RANS_FORM}
STORED_DTYPE = {np.dtype(np.uint8): "U8", np.dtype(np.uint16): "U16", np.dtype(np.uint32): "U32"}


def compress_checkpoint(source: str | Path, out: str | Path, *, to_bf16: bool = False,
                        min_elements: int = MIN_ELEMENTS, progress: bool = False, mode: str = "unweight",
                        encoder: Encoder = encode, **params: Any) -> dict[str, int]:
    """Compress every bf16 tensor of ``source`` (anything ``open_weights`` accepts) into ``out``.

    Returns counts: ``compressed``, ``passed`` (through unchanged) and ``castable_passed`` (float
    tensors left as they were because ``to_bf16`` was not given). ``mode`` is "unweight" (the
    Huffman form) or "rans"; ``params`` go to ``encoder`` (default the reference ``encode``; the
    fast CLI passes the C encoder, which gives the same bytes) or ``encode_rans_many``.
    """
    from tqdm import tqdm

    if mode not in MODES:
        raise CodecError(f"unknown mode {mode!r}; the modes are {list(MODES)}")
    form = huffman_form(encoder) if MODES[mode] == "huffman" else FORMS[MODES[mode]]
    try:
        weights = open_weights(source)
    except (WeightError, SafetensorsError) as e:
        raise CodecError(str(e)) from None
    out = Path(out)
    metadata = _source_metadata(weights)  # (refuses a container first: the more useful message)
    check_output(out, input_paths(source, weights))
    carried = model_entry(weights)  # the config and tokenizer, so that the container alone serves
    if carried is not None:
        metadata[MODEL_KEY] = carried
    names, counts = weights.names(), {"compressed": 0, "passed": 0, "castable_passed": 0}
    with _Scratch(out) as scratch:
        pending: list[tuple[str, np.ndarray, str]] = []  # tensors waiting to be encoded as one batch

        def store(ct: Compressed, source_dtype: str) -> None:
            for key, a in ct.arrays().items():
                scratch.put(f"{ct.name}{SEP}{key}", a, STORED_DTYPE[a.dtype])
            header = ct.header() | {"source_dtype": source_dtype}
            metadata[f"{FORMAT_NAME}{SEP}{ct.name}"] = _header_json(ct.name, header)

        def flush() -> None:
            batch = form.encode_many([a for _, a, _ in pending], names=[n for n, _, _ in pending], **params)
            for ct, (_, _, source_dtype) in zip(batch, pending, strict=True):
                store(ct, source_dtype)
            pending.clear()

        for name in tqdm(names, desc=f"compress {weights.label}", disable=not progress, unit="tensor"):
            array, dtype = np.asarray(weights.get(name)), weights.dtype(name)
            if dtype in CASTABLE and to_bf16:
                array, source_dtype, dtype = float32_to_bf16(array.astype(np.float32)), dtype, "BF16"
            else:
                source_dtype = dtype
            if dtype == "BF16" and array.size >= min_elements:
                pending.append((name, array, source_dtype))
                if sum(a.size for _, a, _ in pending) >= form.batch_weights:
                    flush()
                counts["compressed"] += 1
            else:
                scratch.put(name, array, dtype)
                metadata[f"{FORMAT_NAME}{SEP}{name}"] = _raw_header(name, array, dtype)
                counts["passed"] += 1
                counts["castable_passed"] += dtype in CASTABLE
        if pending:
            flush()
        metadata[FORMAT_NAME] = json.dumps({"format": FORMAT_NAME, "version": CONTAINER_VERSION, "tensors": names})
        scratch.write(out, metadata)
    return counts


def decompress_checkpoint(path: str | Path, out: str | Path, *, progress: bool = False,
                          decoder: HuffmanDecoder | None = None, rans_decoder: RansDecoder | None = None) -> int:
    """Write every tensor of a container back as a plain safetensors file (compressed ones as BF16).

    ``decoder`` and ``rans_decoder`` decode the Huffman-form and rANS-form tensors (see ``Container``)."""
    out = Path(out)
    check_output(out, [Path(path)])
    with Container(path, decoder=decoder, rans_decoder=rans_decoder) as c, _Scratch(out) as scratch:
        for name, array, dtype in c.items(progress=progress):
            scratch.put(name, array, dtype)
        scratch.write(out, c.user_metadata)
        return len(c.names)


class Container:
    """A container file, opened and checked. ``get(name)`` decodes and verifies one tensor."""

    def __init__(self, path: str | Path, *, decoder: HuffmanDecoder | None = None,
                 rans_decoder: RansDecoder | None = None):
        """``decoder``: decodes a list of Huffman-form tensors whose headers are checked but whose arrays
        are not (it checks them itself, as the C decoder does); None: the arrays are checked here and
        the lockstep NumPy decoder runs. ``rans_decoder``: the same for the rANS form."""
        self.forms = dict(FORMS)
        if decoder is not None:
            self.forms["huffman"] = huffman_form(decoder=decoder)
        if rans_decoder is not None:
            self.forms[rans.FORM] = RANS_FORM._replace(decode_many=rans_decoder)
        self._checks_itself = {"huffman": decoder is not None, rans.FORM: rans_decoder is not None}
        self.path = Path(path)
        try:
            self._file = SafetensorsFile(self.path)
        except SafetensorsError as e:
            raise CodecError(f"not a readable container: {e}") from None
        meta = self._file.metadata
        try:
            top = jsonsafe.loads(meta[FORMAT_NAME])
            assert isinstance(top, dict) and isinstance(top.get("tensors"), list)
        except (KeyError, ValueError, AssertionError):
            raise CodecError(f"{self.path}: no valid '{FORMAT_NAME}' entry in the metadata: not a container") from None
        if top.get("format") == FORMAT_NAME and top.get("version") == 1:
            raise CodecError(f"{self.path}: container version 1 has no header checks (FORMAT.md section 6.1); "
                             "compress the original checkpoint again")
        if top.get("format") != FORMAT_NAME or top.get("version") != CONTAINER_VERSION:
            raise CodecError(f"{self.path}: unsupported container version {top.get('version')!r} "
                             f"(this reader: {CONTAINER_VERSION})")
        self.names: list[str] = top["tensors"]
        if not all(isinstance(n, str) for n in self.names) or len(set(self.names)) != len(self.names):
            raise CodecError(f"{self.path}: the tensor list must hold distinct names")
        self.headers = {n: self._header(n) for n in self.names}
        expected: set[str] = set()
        for n in self.names:
            expected |= {f"{n}{SEP}{k}" for k in self._arrays_of(n)} if self.is_compressed(n) else {n}
        if set(self._file) != expected:
            extra, missing = sorted(set(self._file) - expected)[:3], sorted(expected - set(self._file))[:3]
            raise CodecError(f"{self.path}: stored tensors do not match the metadata "
                             f"(extra: {extra}, missing: {missing})")
        self.user_metadata = {k: v for k, v in meta.items() if not k.startswith(FORMAT_NAME)}

    def _header(self, name: str) -> dict[str, Any]:
        try:
            header = jsonsafe.loads(self._file.metadata[f"{FORMAT_NAME}{SEP}{name}"])
        except (KeyError, ValueError):
            raise CodecError(f"{self.path}: tensor {name!r} has no valid header in the metadata") from None
        if not isinstance(header, dict):
            raise CodecError(f"{self.path}: tensor {name!r}: header must be a JSON object")
        stored = header.pop(HEADER_CRC, None)
        if type(stored) is not int or stored != header_crc(name, header):
            raise CodecError(f"{self.path}: tensor {name!r}: its header fails its CRC-32 check ({HEADER_CRC}): "
                             "the header was changed or damaged")
        return header

    def is_compressed(self, name: str) -> bool:
        return self.headers[name].get("form") != "raw"

    def _form_of(self, name: str) -> Form:
        form = self.headers[name].get("form")
        if form not in self.forms:
            raise CodecError(f"{self.path}: tensor {name!r}: unknown form {form!r} (this reader knows "
                             f"{sorted(self.forms)} and 'raw')")
        return self.forms[form]

    def _arrays_of(self, name: str) -> dict[str, type]:
        return self._form_of(name).arrays

    def compressed(self, name: str, *, check_arrays: bool = True) -> Compressed:
        """A compressed tensor in its stored form (Huffman or rANS), every field checked (with
        ``check_arrays=False``, the array contents are left to its decoder)."""
        header = dict(self.headers[name])
        source_dtype = header.pop("source_dtype", None)
        if source_dtype not in ("BF16", *CASTABLE):
            raise CodecError(f"{self.path}: tensor {name!r}: bad source_dtype {source_dtype!r}")
        arrays = {k: self._file[f"{name}{SEP}{k}"] for k in self._arrays_of(name)}
        tensor = self._form_of(name).tensor
        return tensor.from_parts(header, arrays, name=name, check_arrays=check_arrays)

    def get(self, name: str) -> np.ndarray:
        return next(a for _, a, _ in self.items([name]))

    def items(self, names: list[str] | None = None, progress: bool = False) -> Iterator[tuple[str, np.ndarray, str]]:
        """(name, array, safetensors dtype) for each tensor, decoded and verified, in file order."""
        from tqdm import tqdm

        names = self.names if names is None else names
        pending: list[str] = []  # names read but not yet yielded: their batch is not decoded yet
        batch: list[Compressed] = []
        for i, name in enumerate(tqdm(names, desc=f"decompress {self.path.name}", disable=not progress, unit="tensor")):
            pending.append(name)
            if self.is_compressed(name):
                checks_itself = self._checks_itself.get(self.headers[name].get("form"), False)
                batch.append(self.compressed(name, check_arrays=not checks_itself))
            if i + 1 == len(names) or sum(weight_count(ct) for ct in batch) >= DECODE_BATCH:
                decoded = self._decode(batch)
                for n in pending:
                    yield (n, decoded[n], "BF16") if n in decoded else (n, self._raw(n), self.headers[n]["dtype"])
                pending, batch = [], []

    def _decode(self, batch: list[Compressed]) -> dict[str, np.ndarray]:
        """Decode a batch of compressed tensors, each form's in one call: {name: bits}."""
        out: dict[str, np.ndarray] = {}
        for form in self.forms.values():
            mine = [ct for ct in batch if type(ct) is form.tensor]
            out |= {ct.name: bits for ct, bits in zip(mine, form.decode_many(mine) if mine else [], strict=True)}
        return out

    def _raw(self, name: str) -> np.ndarray:
        header, info = self.headers[name], self._file.info(name)
        array = self._file[name]
        expected = {"format": FORMAT_NAME, "version": VERSION, "form": "raw", "dtype": info.dtype,
                    "shape": list(info.shape), "crc32": header.get("crc32")}
        if header != expected:
            raise CodecError(f"{self.path}: tensor {name!r}: raw header {header} does not match the stored tensor")
        if header["crc32"] != {"data": crc32(array)}:
            raise CodecError(f"{self.path}: tensor {name!r} fails its CRC-32 check: the data is corrupt")
        return np.array(array)

    @property
    def model_entry(self) -> str | None:
        """The carried config and tokenizer (``unweight.model``, FORMAT.md section 6.2), unparsed, or None."""
        return self._file.metadata.get(MODEL_KEY)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def weight_count(ct: Compressed) -> int:
    """Number of weights of a compressed tensor of either form."""
    return ct.n


def header_crc(name: str, header: dict[str, Any]) -> int:
    """CRC-32 of a tensor's name and header (every key but ``header_crc32``) in a canonical JSON form:
    keys sorted, no spaces, ASCII only (FORMAT.md section 6.1)."""
    entry = {"name": name, "header": {k: v for k, v in header.items() if k != HEADER_CRC}}
    return zlib.crc32(json.dumps(entry, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii"))


def _header_json(name: str, header: dict[str, Any]) -> str:
    """A tensor's metadata value: its header with ``header_crc32`` added."""
    return json.dumps(header | {HEADER_CRC: header_crc(name, header)}, separators=(",", ":"))


def _raw_header(name: str, array: np.ndarray, dtype: str) -> str:
    return _header_json(name, {"format": FORMAT_NAME, "version": VERSION, "form": "raw", "dtype": dtype,
                               "shape": list(array.shape), "crc32": {"data": crc32(array)}})


def _source_metadata(weights: Any) -> dict[str, str]:
    """The source safetensors files' own metadata (GGUF key/values are not strings: not kept).

    A source that is itself a container is refused: its tensors would pass through as opaque arrays
    and the output could no longer be decompressed to the weights.
    """
    meta: dict[str, str] = {}
    for f in weights.files:
        if isinstance(f, ContainerFile):
            raise CodecError(f"{f.path} is already an {FORMAT_NAME} container: compress the original "
                             "checkpoint, or decompress this file first")
        if isinstance(f, SafetensorsFile):
            if any(k == FORMAT_NAME or k.startswith(FORMAT_NAME + SEP) for k in f.metadata):
                raise CodecError(f"{f.path} is already an {FORMAT_NAME} container: compress the original "
                                 "checkpoint, or decompress this file first")
            for k, v in f.metadata.items():
                if not k.startswith(FORMAT_NAME):
                    meta.setdefault(k, v)
    return meta


class _Scratch:
    """Arrays parked in a temporary file beside the output, then memory-mapped back for writing."""

    def __init__(self, out: Path):
        fd, self.path = temporary_file(out.parent, out.name + ".", ".scratch")  # removed by remove_temporary_files
        self._f = os.fdopen(fd, "wb")
        self.entries: dict[str, tuple[int, np.dtype, tuple[int, ...], str]] = {}

    def put(self, name: str, array: np.ndarray, dtype: str) -> None:
        if name in self.entries:
            raise CodecError(f"two tensors would be stored as {name!r}")
        array = np.asarray(array, order="C")
        self.entries[name] = (self._f.tell(), DTYPES[dtype], array.shape, dtype)
        self._f.write(array.astype(DTYPES[dtype].newbyteorder("<"), copy=False).tobytes())

    def write(self, out: Path, metadata: dict[str, str]) -> None:
        self._f.close()
        arrays = {name: np.memmap(self.path, dtype, "r", offset, shape) if np.prod(shape) else np.zeros(shape, dtype)
                  for name, (offset, dtype, shape, _) in self.entries.items()}
        write_safetensors(out, arrays, dtypes={n: e[3] for n, e in self.entries.items()}, metadata=metadata)

    def __enter__(self) -> _Scratch:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()
        discard(self.path)
