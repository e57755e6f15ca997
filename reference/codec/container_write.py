"""Writing the checkpoint container (FORMAT.md section 6); ``container_read.py`` reads it.

    compress_checkpoint("minilm", "minilm.unweight.safetensors", to_bf16=True)
    decompress_checkpoint("minilm.unweight.safetensors", "minilm.bf16.safetensors")

Big checkpoints never sit in memory at once: arrays are parked in a scratch file next to the output
and memory-mapped back. ``mode="rans"`` stores the tensors in the rANS form (FORMAT.md section 9)
instead of the Unweight Huffman form. The config and tokenizer of the source travel in the container
(``reference/model/carried.py``), so that the container alone serves.

Nothing is lost on the way: the output appears complete or not at all (``atomic_output``), the
scratch file goes on every exit path, an output that is the input is refused, and so is a container
given as the source.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from reference.bf16 import float32_to_bf16
from reference.codec import rans
from reference.codec.codec import encode
from reference.codec.container_read import (
    CASTABLE,
    CONTAINER_VERSION,
    FORMS,
    HEADER_CRC,
    SEP,
    Compressed,
    Container,
    Encoder,
    HuffmanDecoder,
    RansDecoder,
    header_crc,
    huffman_form,
)
from reference.codec.errors import CodecError
from reference.codec.format import FORMAT_NAME, VERSION, crc32
from reference.codec.paths import check_output, input_paths
from reference.model.carried import MODEL_KEY, ContainerFile, model_entry
from reference.model.errors import WeightError
from reference.model.safetensors_io import (
    DTYPES,
    SafetensorsError,
    SafetensorsFile,
    write_safetensors,
    write_safetensors_stream,
)
from reference.model.weights import open_weights
from reference.safe_write import discard, temporary_file

# smaller tensors (norms, biases) pass through: their header would cost more than they save
MIN_ELEMENTS = 4096
MODES = {"unweight": "huffman", "rans": rans.FORM}  # a mode (the CLI's --mode) writes one form
STORED_DTYPE = {np.dtype(np.uint8): "U8", np.dtype(np.uint16): "U16", np.dtype(np.uint32): "U32"}


def compress_checkpoint(source: str | Path, out: str | Path, *, to_bf16: bool = False,
                        min_elements: int = MIN_ELEMENTS, progress: bool = False,
                        mode: str = "unweight",
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
        # tensors waiting to be encoded as one batch
        pending: list[tuple[str, np.ndarray, str]] = []

        def store(ct: Compressed, source_dtype: str) -> None:
            for key, a in ct.arrays().items():
                scratch.put(f"{ct.name}{SEP}{key}", a, STORED_DTYPE[a.dtype])
            header = ct.header() | {"source_dtype": source_dtype}
            metadata[f"{FORMAT_NAME}{SEP}{ct.name}"] = _header_json(ct.name, header)

        def flush() -> None:
            batch = form.encode_many([a for _, a, _ in pending], names=[n for n, _, _ in pending],
                                     **params)
            for ct, (_, _, source_dtype) in zip(batch, pending, strict=True):
                store(ct, source_dtype)
            pending.clear()

        for name in tqdm(names, desc=f"compress {weights.label}", disable=not progress,
                         unit="tensor"):
            array, dtype = np.asarray(weights.get(name)), weights.dtype(name)
            if dtype in CASTABLE and to_bf16:
                array, source_dtype, dtype = (
                    float32_to_bf16(array.astype(np.float32)),
                    dtype,
                    "BF16",
                )
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
        metadata[FORMAT_NAME] = json.dumps({"format": FORMAT_NAME, "version": CONTAINER_VERSION,
                                            "tensors": names})
        scratch.write(out, metadata)
    return counts


def decompress_checkpoint(path: str | Path, out: str | Path, *, progress: bool = False,
                          decoder: HuffmanDecoder | None = None,
                          rans_decoder: RansDecoder | None = None) -> int:
    """Write every tensor of a container back as a plain safetensors file (compressed ones as BF16).

    ``decoder`` and ``rans_decoder`` decode the Huffman-form and rANS-form tensors (see
    ``Container``). Every tensor's dtype and shape are in the container's headers, so the output's
    header is written first and each tensor's bytes follow as its batch is decoded, straight from
    the decoded buffer (``write_safetensors_stream``): one write per tensor, no scratch copy."""
    out = Path(out)
    check_output(out, [Path(path)])
    with Container(path, decoder=decoder, rans_decoder=rans_decoder) as c:
        entries = [_output_entry(c, name) for name in c.names]
        arrays = (array for _, array, _ in c.items(progress=progress))
        try:
            write_safetensors_stream(out, entries, arrays, c.user_metadata)
        except TypeError as e:  # a decoded tensor that does not match its header
            raise CodecError(f"{path}: {e}") from None
        return len(c.names)


def _output_entry(c: Container, name: str) -> tuple[str, str, list[int]]:
    """(name, safetensors dtype, shape) of a container's tensor in the decompressed file, from its
    header (checked here: the header comes from the file)."""
    header = c.headers[name]
    dtype = "BF16" if c.is_compressed(name) else header.get("dtype")
    shape = header.get("shape")
    if dtype not in DTYPES or not isinstance(shape, list) or not all(
            type(d) is int and d >= 0 for d in shape):
        raise CodecError(f"{c.path}: tensor {name!r}: bad dtype {dtype!r} or shape {shape!r} in "
                         "its header")
    return name, dtype, shape


def _header_json(name: str, header: dict[str, Any]) -> str:
    """A tensor's metadata value: its header with ``header_crc32`` added."""
    return json.dumps(header | {HEADER_CRC: header_crc(name, header)}, separators=(",", ":"))


def _raw_header(name: str, array: np.ndarray, dtype: str) -> str:
    return _header_json(name, {"format": FORMAT_NAME, "version": VERSION, "form": "raw",
                               "dtype": dtype,
                               "shape": list(array.shape), "crc32": {"data": crc32(array)}})


def _source_metadata(weights: Any) -> dict[str, str]:
    """The source safetensors files' own metadata (GGUF key/values are not strings: not kept).

    A source that is itself a container is refused: its tensors would pass through as opaque arrays
    and the output could no longer be decompressed to the weights.
    """
    meta: dict[str, str] = {}
    for f in weights.files:
        if isinstance(f, ContainerFile):
            raise CodecError(f"{f.path} is already an {FORMAT_NAME} container: compress the "
                             "original "
                             "checkpoint, or decompress this file first")
        if isinstance(f, SafetensorsFile):
            if any(k == FORMAT_NAME or k.startswith(FORMAT_NAME + SEP) for k in f.metadata):
                raise CodecError(f"{f.path} is already an {FORMAT_NAME} container: compress the "
                                 "original "
                                 "checkpoint, or decompress this file first")
            for k, v in f.metadata.items():
                if not k.startswith(FORMAT_NAME):
                    meta.setdefault(k, v)
    return meta


class _Scratch:
    """Arrays parked in a temporary file beside the output, then memory-mapped back for writing."""

    def __init__(self, out: Path):
        # removed by remove_temporary_files
        fd, self.path = temporary_file(out.parent, out.name + ".", ".scratch")
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
        arrays = {name: np.memmap(self.path, dtype, "r", offset,
                                  shape) if np.prod(shape) else np.zeros(shape, dtype)
                  for name, (offset, dtype, shape, _) in self.entries.items()}
        write_safetensors(out, arrays, dtypes={n: e[3] for n, e in self.entries.items()},
                          metadata=metadata)

    def __enter__(self) -> _Scratch:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()
        discard(self.path)
