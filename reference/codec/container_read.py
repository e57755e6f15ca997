"""Reading the checkpoint container: a safetensors file of compressed streams (FORMAT.md section 6).

    with Container("minilm.unweight.safetensors") as c:
        bits = c.get("encoder.layer.0.intermediate.dense.weight")   # bf16 bits, verified

Any safetensors tool opens the container: each compressed tensor is a few plain arrays
(``name::sm`` ...), its header is a JSON string in ``__metadata__``. ``container_write.py`` writes
it. A container may hold the Unweight Huffman form and the rANS form (FORMAT.md section 9); each
tensor's header says which. Each header carries a CRC-32 of itself and the tensor's name
(``header_crc32``, FORMAT.md section 6.1), so a changed shape or dtype is caught, not decoded.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from reference import jsonsafe
from reference.codec import rans
from reference.codec.codec import encode
from reference.codec.errors import CodecError
from reference.codec.format import ARRAY_DTYPES, FORMAT_NAME, VERSION, CompressedTensor, crc32
from reference.codec.lockstep import decode_many
from reference.model.safetensors_io import SafetensorsError, SafetensorsFile

CASTABLE = ("F32", "F16")  # cast to bf16 (round-to-nearest-even) with to_bf16=True
DECODE_BATCH = 1 << 24  # weights decoded together in one lockstep pass
SEP = "::"
CONTAINER_VERSION = 2  # version 2 added each tensor's header_crc32 (FORMAT.md section 6.1)
HEADER_CRC = "header_crc32"
Encoder = Callable[..., CompressedTensor]  # encode(bits, name=..., **params): the Huffman form
# Huffman-form tensors -> their bits
HuffmanDecoder = Callable[[list[CompressedTensor]], list[np.ndarray]]
RansDecoder = Callable[[list[rans.RansTensor]], list[np.ndarray]]  # rANS-form tensors -> their bits
Compressed = CompressedTensor | rans.RansTensor


class Form(NamedTuple):
    """What the container needs of a compressed form; FORMS maps the header's ``form`` value to it.

    The tensor type has ``from_parts(header, arrays, name=...)``, ``header()``, ``arrays()``, ``n``
    and ``nbytes``; ``encode_many(bit arrays, names=..., **params)`` and ``decode_many(tensors)``
    work on lists; the container gathers ``batch_weights`` weights before it encodes (0: one at a
    time)."""

    arrays: dict[str, type]
    tensor: type
    encode_many: Callable[..., list[Compressed]]
    decode_many: Callable[[list[Any]], list[np.ndarray]]
    batch_weights: int


def huffman_form(encoder: Encoder = encode, decoder: HuffmanDecoder = decode_many) -> Form:
    """The Unweight Huffman form (FORMAT.md sections 3-6), with a given encoder and decoder."""
    def encode_many(tensors: list[np.ndarray], *, names: list[str],
                    **params: Any) -> list[CompressedTensor]:
        return [encoder(bits, name=name, **params) for bits,
                name in zip(tensors, names, strict=True)]

    return Form(ARRAY_DTYPES, CompressedTensor, encode_many, decoder, 0)


RANS_FORM = Form(rans.ARRAY_DTYPES, rans.RansTensor, rans.encode_rans_many, rans.decode_rans_many,
                 rans.ENCODE_BATCH)
FORMS = {"huffman": huffman_form(), rans.FORM: RANS_FORM}


class Container:
    """A container file, opened and checked. ``get(name)`` decodes and verifies one tensor."""

    def __init__(self, path: str | Path, *, decoder: HuffmanDecoder | None = None,
                 rans_decoder: RansDecoder | None = None):
        """``decoder``: decodes a list of Huffman-form tensors whose headers are checked but whose
        arrays are not (it checks them itself, as the C decoder does); None: the arrays are checked
        here and the lockstep NumPy decoder runs. ``rans_decoder``: the same for the rANS form."""
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
            raise CodecError(f"{self.path}: no valid '{FORMAT_NAME}' entry in the metadata: not a "
                             "container") from None
        if top.get("format") == FORMAT_NAME and top.get("version") == 1:
            raise CodecError(f"{self.path}: container version 1 has no header checks (FORMAT.md "
                             "section 6.1); "
                             "compress the original checkpoint again")
        if top.get("format") != FORMAT_NAME or top.get("version") != CONTAINER_VERSION:
            raise CodecError(f"{self.path}: unsupported container version {top.get('version')!r} "
                             f"(this reader: {CONTAINER_VERSION})")
        self.names: list[str] = top["tensors"]
        if not all(isinstance(n, str) for n in self.names) or len(set(self.names)) != len(
            self.names
        ):
            raise CodecError(f"{self.path}: the tensor list must hold distinct names")
        self.headers = {n: self._header(n) for n in self.names}
        expected: set[str] = set()
        for n in self.names:
            expected |= (
                {f"{n}{SEP}{k}" for k in self._arrays_of(n)} if self.is_compressed(n) else {n}
            )
        if set(self._file) != expected:
            extra, missing = (
                sorted(set(self._file) - expected)[:3],
                sorted(expected - set(self._file))[:3],
            )
            raise CodecError(f"{self.path}: stored tensors do not match the metadata "
                             f"(extra: {extra}, missing: {missing})")
        self.user_metadata = {k: v for k, v in meta.items() if not k.startswith(FORMAT_NAME)}

    def _header(self, name: str) -> dict[str, Any]:
        try:
            header = jsonsafe.loads(self._file.metadata[f"{FORMAT_NAME}{SEP}{name}"])
        except (KeyError, ValueError):
            raise CodecError(
                f"{self.path}: tensor {name!r} has no valid header in the metadata"
            ) from None
        if not isinstance(header, dict):
            raise CodecError(f"{self.path}: tensor {name!r}: header must be a JSON object")
        stored = header.pop(HEADER_CRC, None)
        if type(stored) is not int or stored != header_crc(name, header):
            raise CodecError(f"{self.path}: tensor {name!r}: its header fails its CRC-32 check "
                             f"({HEADER_CRC}): "
                             "the header was changed or damaged")
        return header

    def is_compressed(self, name: str) -> bool:
        return self.headers[name].get("form") != "raw"

    def _form_of(self, name: str) -> Form:
        form = self.headers[name].get("form")
        if form not in self.forms:
            raise CodecError(f"{self.path}: tensor {name!r}: unknown form {form!r} (this reader "
                             "knows "
                             f"{sorted(self.forms)} and 'raw')")
        return self.forms[form]

    def _arrays_of(self, name: str) -> dict[str, type]:
        arrays = self._form_of(name).arrays
        if self.headers[name].get("form") == rans.FORM:  # an earlier writer's rANS tensor: fewer
            return {k: arrays[k] for k in rans.stored_arrays(self.headers[name])}
        return arrays

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

    def items(
        self, names: list[str] | None = None, progress: bool = False
    ) -> Iterator[tuple[str, np.ndarray, str]]:
        """(name, array, safetensors dtype) for each tensor, decoded and verified, in file order."""
        from tqdm import tqdm

        names = self.names if names is None else names
        pending: list[str] = []  # names read but not yet yielded: their batch is not decoded yet
        batch: list[Compressed] = []
        for i, name in enumerate(tqdm(names, desc=f"decompress {self.path.name}",
                                      disable=not progress, unit="tensor")):
            pending.append(name)
            if self.is_compressed(name):
                checks_itself = self._checks_itself.get(self.headers[name].get("form"), False)
                batch.append(self.compressed(name, check_arrays=not checks_itself))
            if i + 1 == len(names) or sum(weight_count(ct) for ct in batch) >= DECODE_BATCH:
                decoded = self._decode(batch)
                for n in pending:
                    yield (
                        (n, decoded[n], "BF16")
                        if n in decoded
                        else (n, self._raw(n), self.headers[n]["dtype"])
                    )
                pending, batch = [], []

    def _decode(self, batch: list[Compressed]) -> dict[str, np.ndarray]:
        """Decode a batch of compressed tensors, each form's in one call: {name: bits}."""
        out: dict[str, np.ndarray] = {}
        for form in self.forms.values():
            mine = [ct for ct in batch if type(ct) is form.tensor]
            out |= {ct.name: bits for ct, bits in zip(mine, form.decode_many(mine) if mine else [],
                                                      strict=True)}
        return out

    def _raw(self, name: str) -> np.ndarray:
        header, info = self.headers[name], self._file.info(name)
        array = self._file[name]
        expected = {"format": FORMAT_NAME, "version": VERSION, "form": "raw", "dtype": info.dtype,
                    "shape": list(info.shape), "crc32": header.get("crc32")}
        if header != expected:
            raise CodecError(f"{self.path}: tensor {name!r}: raw header {header} does not match "
                             "the stored tensor")
        if header["crc32"] != {"data": crc32(array)}:
            raise CodecError(f"{self.path}: tensor {name!r} fails its CRC-32 check: the data is "
                             "corrupt")
        return np.array(array)

    @property
    def metadata(self) -> dict[str, str]:
        """The file's whole safetensors metadata (the carried model entry, FORMAT.md section 6.2,
        among it)."""
        return self._file.metadata

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
    """CRC-32 of a tensor's name and header (every key but ``header_crc32``) in a canonical JSON
    form:
    keys sorted, no spaces, ASCII only (FORMAT.md section 6.1)."""
    entry = {"name": name, "header": {k: v for k, v in header.items() if k != HEADER_CRC}}
    return zlib.crc32(json.dumps(entry, sort_keys=True, separators=(",", ":"),
                                 ensure_ascii=True).encode("ascii"))
