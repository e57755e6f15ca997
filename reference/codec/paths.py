"""Where the codec may write: checks made before any work, so no input is ever lost.

An output must not be a directory, must sit in an existing, writable directory, and must not be
any file the command reads (the same path, a symbolic or hard link to it, ``dir/../file``): the
output replaces its path only at the very end (``atomic_output``), and the input would be gone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from reference.codec.errors import CodecError


def check_output(out: Path, inputs: list[Path]) -> None:
    """Refuse, before any work, an output path that cannot be written or would destroy an input."""
    if out.is_dir():
        raise CodecError(f"{out} is a directory: give the path of the file to write")
    if not out.parent.is_dir():
        raise CodecError(f"{out}: the directory {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise CodecError(f"{out}: the directory {out.parent} is not writable")
    for p in inputs:
        if same_file(out, p):
            raise CodecError(f"{out} is the input {p}: write the output to another path (the input "
                             "would be lost)")


def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare the resolved paths
        return os.path.realpath(a) == os.path.realpath(b)


def input_paths(source: str | Path, weights: Any) -> list[Path]:
    """Every file a compression reads: the weight files, and a checkpoint directory's index."""
    paths = [Path(f.path) for f in weights.files]
    if Path(source).is_dir():
        paths.append(Path(source) / "model.safetensors.index.json")
    return paths
