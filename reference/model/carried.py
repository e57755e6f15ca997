"""A compressed checkpoint as a model: what an Unweight container carries beside its tensors.

``python -m reference.codec compress`` writes the checkpoint's config and tokenizer into the
container's metadata, under the key ``unweight.model`` (FORMAT.md section 6.2), so one file is
enough to serve:

* from a GGUF file: its key/value metadata (architecture, hyper-parameters, vocabulary, merges,
  chat template), as JSON;
* from a Hugging Face checkpoint: the texts of ``config.json``, ``tokenizer.json``,
  ``tokenizer_config.json`` and ``chat_template.jinja`` found beside the weights.

``ContainerFile`` is a container opened as a weight file: ``open_weights`` gives one for any
``.safetensors`` file whose metadata says it is a container; each tensor is decoded, and verified,
when it is read. The loaders find the carried entry with ``carried_entry(source)``.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from reference.model.errors import WeightError

MODEL_KEY = "unweight.model"  # the metadata key (reserved: it starts with "unweight")
ENTRY_VERSION = 1
HF_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
JSON_SCALARS = (str, int, float, bool)


def entry_crc(entry: dict[str, Any]) -> int:
    """CRC-32 of the entry (every key but ``crc32``) as canonical JSON: keys sorted, no spaces,
    ASCII."""
    body = {k: v for k, v in entry.items() if k != "crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":"),
                                 ensure_ascii=True).encode("ascii"))


def _jsonable(value: Any) -> bool:
    if isinstance(value, list):
        return all(isinstance(v, JSON_SCALARS) for v in value)
    return isinstance(value, JSON_SCALARS) and not (
        isinstance(value, float) and not np.isfinite(value)
    )


def model_entry(source: Any) -> str | None:
    """The ``unweight.model`` metadata value for a WeightSource, or None if it carries no model.

    A GGUF source gives its key/value metadata; a safetensors source the Hugging Face files
    (``HF_FILES``) beside it, if there is at least a ``config.json``."""
    from reference.model.gguf_io import GGUFFile

    gguf = [f for f in source.files if isinstance(f, GGUFFile)]
    if gguf:
        meta = {k: v for k, v in gguf[0].metadata().items() if _jsonable(v)}
        entry: dict[str, Any] = {"format": "unweight", "version": ENTRY_VERSION, "kind": "gguf",
                                 "gguf": meta}
    else:
        folder = Path(source.label)
        folder = folder if folder.is_dir() else folder.parent
        files = {
            n: (folder / n).read_text(encoding="utf-8") for n in HF_FILES if (folder / n).is_file()
        }
        if "config.json" not in files:
            return None
        entry = {"format": "unweight", "version": ENTRY_VERSION, "kind": "hf", "files": files}
    return json.dumps(entry | {"crc32": entry_crc(entry)}, separators=(",", ":"))


def parse_entry(text: str, where: str) -> dict[str, Any]:
    """The carried entry, checked: its CRC, version, kind and the types of its fields."""
    try:
        entry = json.loads(text)
    except ValueError:
        raise WeightError(f"{where}: the {MODEL_KEY} entry is not valid JSON") from None
    if (
        not isinstance(entry, dict)
        or type(entry.get("crc32")) is not int
        or entry["crc32"] != entry_crc(entry)
    ):
        raise WeightError(f"{where}: the {MODEL_KEY} entry fails its CRC-32 check: it was changed "
                          "or damaged")
    if entry.get("format") != "unweight" or entry.get("version") != ENTRY_VERSION:
        raise WeightError(f"{where}: unsupported {MODEL_KEY} entry version "
                          f"{entry.get('version')!r} "
                          f"(this reader: {ENTRY_VERSION})")
    kind = entry.get("kind")
    if kind == "gguf":
        ok = isinstance(entry.get("gguf"), dict)
    elif kind == "hf":
        files = entry.get("files")
        ok = (isinstance(files, dict) and set(files) <= set(HF_FILES) and "config.json" in files
              and all(isinstance(v, str) for v in files.values()))
    else:
        ok = False
    if not ok or set(entry) != {"format", "version", "kind", "crc32",
                                "gguf" if kind == "gguf" else "files"}:
        raise WeightError(f"{where}: malformed {MODEL_KEY} entry (kind {kind!r})")
    return entry


class ContainerFile:
    """A container read as a weight file: names, dtypes and shapes from its headers, tensors decoded
    on ``get``.

    Compressed tensors read as BF16 (uint16 bit patterns), passed-through ones as stored. ``entry``
    is the carried model entry (None in a container written without one). Loaders that take the
    compressed forms themselves read them with ``is_compressed`` and ``compressed``."""

    def __init__(self, path: str | Path, **decoders: Any):
        from reference.codec.container_read import Container
        from reference.codec.errors import CodecError

        self.path = Path(path)
        try:
            self._container = Container(self.path, **decoders)
        except CodecError as e:
            raise WeightError(str(e)) from None
        text = self._container.metadata.get(MODEL_KEY)
        self.entry = None if text is None else parse_entry(text, str(self.path))

    def names(self) -> list[str]:
        return list(self._container.names)

    def dtype(self, name: str) -> str:
        return (
            "BF16"
            if self._container.is_compressed(name)
            else self._container.headers[name]["dtype"]
        )

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self._container.headers[name].get("shape")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise WeightError(f"{self.path}: tensor {name!r}: bad shape {shape!r} in its header")
        return tuple(shape)

    def get(self, name: str) -> np.ndarray:
        """The tensor, decoded and verified (every CRC); a damaged one raises ``WeightError``."""
        from reference.codec.errors import CodecError

        try:
            return self._container.get(name).reshape(self.shape(name))
        except CodecError as e:
            raise WeightError(str(e)) from None

    def is_compressed(self, name: str) -> bool:
        """Whether tensor ``name`` is stored compressed (else passed through as it was)."""
        return self._container.is_compressed(name)

    def compressed(self, name: str, *, check_arrays: bool = True) -> Any:
        """Tensor ``name`` in its stored compressed form (``reference.codec.CompressedTensor`` or
        ``RansTensor``), every field and array checked (``check_arrays=False``: the arrays' contents
        are left to the decoder that reads them, which checks them); a damaged one raises
        ``WeightError``."""
        from reference.codec.errors import CodecError

        try:
            return self._container.compressed(name, check_arrays=check_arrays)
        except CodecError as e:
            raise WeightError(str(e)) from None

    def close(self) -> None:
        self._container.close()


def is_container(metadata: dict[str, str]) -> bool:
    """Does a safetensors file's metadata mark it as an Unweight container?"""
    return "unweight" in metadata


def carried_entry(source: Any) -> tuple[dict[str, Any], str] | None:
    """(entry, file path) of the first container of a WeightSource that carries a model, else
    None."""
    for f in source.files:
        if isinstance(f, ContainerFile) and f.entry is not None:
            return f.entry, str(f.path)
    return None


def no_model_error(source: Any) -> WeightError | None:
    """The error for a container without a carried model (an old one, or compressed from bare
    weights)."""
    from reference.model.config import ConfigError

    for f in source.files:
        if isinstance(f, ContainerFile) and f.entry is None:
            return ConfigError(f"{f.path}: this container carries no config or tokenizer (written "
                               "before "
                               "containers carried them, or compressed from bare weights): "
                               "compress the "
                               "checkpoint again with python -m reference.codec compress")
    return None
