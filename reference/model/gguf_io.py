"""GGUF weights as NumPy arrays, through the ``gguf`` package (llama.cpp's own reader).

GGUF stores many tensors block-quantized (Q4_1: 32 weights share a scale and a minimum; Q8_0: 32
weights share a scale). We dequantize them to float32 with ``gguf.quants.dequantize``. BF16 tensors
stay uint16 bit patterns and F16 stays float16, as in the safetensors reader.

Names and shapes are GGUF's own (``blk.0.attn_q.weight``, shape (out, in) in NumPy order). Note that
llama.cpp's converter permutes the rows of Llama's q and k projections (its RoPE pairs adjacent
dimensions, Hugging Face's pairs the two halves); the model loader undoes that, not this file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from reference.model.errors import WeightError


def _reader_class(gguf: Any) -> type:
    """``gguf.GGUFReader`` reading the file through a plain ndarray view of its memory map: the same
    bytes, no copy, but slicing it skips ``np.memmap``'s per-slice bookkeeping, which the reader
    does ~250,000 times for SmolLM2's tokenizer fields (opening the file took 2.6-3.3 CPU-s, now
    1.2)."""
    global _READER
    if _READER is None:
        class PlainViewReader(gguf.GGUFReader):
            @property
            def data(self) -> np.ndarray:
                return self._plain

            @data.setter
            def data(self, mapped: np.ndarray) -> None:
                self._plain = np.asarray(mapped)  # a base-class view of the same mapped pages

        _READER = PlainViewReader
    return _READER


_READER: type | None = None


class GGUFFile:
    """Tensors and key/value metadata of one GGUF file (memory-mapped by ``gguf.GGUFReader``)."""

    def __init__(self, path: str | Path):
        import gguf  # imported here so the rest of the loaders work without it

        self.path = Path(path)
        if not self.path.is_file():
            raise WeightError(f"{self.path}: no such file")
        try:
            self._reader = _reader_class(gguf)(self.path, "r")
        except Exception as e:  # the reader raises IndexError/ValueError deep inside on bad files
            raise WeightError(
                f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})"
            ) from None
        size = self.path.stat().st_size
        self._tensors = {}
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise WeightError(
                    f"{self.path}: tensor {t.name!r} needs bytes [{t.data_offset}, "
                    f"{t.data_offset + t.n_bytes}) but the file has {size}: truncated"
                )
            self._tensors[t.name] = t

    def names(self) -> list[str]:
        return list(self._tensors)

    def kind(self, name: str) -> str:
        """GGUF tensor type name, e.g. 'Q4_1', 'Q8_0', 'F32'."""
        return self._tensors[name].tensor_type.name

    def dtype(self, name: str) -> str:
        """The dtype of what ``get`` returns, in safetensors spelling (quantized -> 'F32')."""
        return {"BF16": "BF16", "F16": "F16", "F64": "F64"}.get(self.kind(name), "F32")

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape in NumPy order (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def get(self, name: str) -> np.ndarray:
        """The tensor, dequantized to float32 (BF16 as uint16 bits, F16 as float16)."""
        import gguf

        t = self._tensors[name]
        kind = t.tensor_type.name
        shape = self.shape(name)
        if kind == "BF16":
            return np.asarray(t.data).view(np.uint16).reshape(shape)
        if kind in ("F16", "F32", "F64"):
            return np.asarray(t.data).reshape(shape)
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._tensors:
            yield name, self.get(name)

    def metadata(self) -> dict[str, object]:
        """Key/value fields (architecture, hyper-parameters, tokenizer) as plain Python values."""
        out = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                out[key] = field.contents()
            except Exception:  # an exotic field type: skip it rather than fail the whole load
                continue
        return out
