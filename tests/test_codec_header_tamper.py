"""Tamper with every field of a container's header in turn: the reader gives a CodecError or the
original tensors, bit for bit, with their original names, shapes and dtypes (FORMAT.md section 6.1).

The header is the safetensors JSON: each stored array's dtype, shape and offsets, and the metadata,
whose values are JSON themselves (the container's tensor list, each tensor's header). Every leaf
value and every key of it is a field; each gets values that a careless edit or a bug would write:
a reshaped shape of the same size, a dtype of the same width, a neighbour integer, a renamed key,
and any JSON value.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterator
from itertools import permutations
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from reference.codec import CodecError, Container, compress_checkpoint
from reference.model.safetensors_io import DTYPES, SafetensorsFile, write_safetensors
from tests.codec_strategies import JUNK

rng = np.random.default_rng(13)
TENSORS = {
    "w": (rng.standard_normal((24, 192)) * 0.02).astype(np.float32),  # compressed (cast to bf16)
    "norm": np.full(12, 0x3F80, np.uint16),  # tiny bf16: passes through raw
    "ids": np.arange(12, dtype=np.int32).reshape(3, 4),  # raw, same width as F32
    "half": rng.standard_normal((2, 6)).astype(np.float16),  # raw, same width as BF16
    "empty": np.zeros((0, 8), np.uint16),  # compressed, no weights
}
DTYPES_OF = {"norm": "BF16", "empty": "BF16"}
Path_ = tuple[Any, ...]  # a path into the parsed header: keys and list indices


def build(directory: Path, mode: str) -> tuple[Path, dict[str, tuple[str, tuple[int, ...], bytes]]]:
    """A container in ``mode`` and what it must decode to: name -> (dtype, shape, bytes)."""
    src, out = directory / "m.safetensors", directory / f"c_{mode}.safetensors"
    write_safetensors(src, TENSORS, dtypes=DTYPES_OF)
    compress_checkpoint(src, out, to_bf16=True, min_elements=64, mode=mode, **({"block_size": 128} if mode == "rans"
                                                                                else {"chunks_per_group": 4}))
    with Container(out) as c:
        want = {n: (t, a.shape, a.tobytes()) for n, a, t in c.items()}
    assert set(want) == set(TENSORS) and want["w"][0] == "BF16" and want["ids"][0] == "I32"
    return out, want


def split(path: Path) -> tuple[dict[str, Any], bytes]:
    """The parsed header (metadata values that are JSON parsed too) and the data section."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    for k, v in header["__metadata__"].items():
        try:
            header["__metadata__"][k] = json.loads(v)
        except ValueError:
            pass  # the source's own metadata ("format": "pt") is not JSON
    return header, blob[8 + n:]


def join(header: dict[str, Any], data: bytes) -> bytes:
    header = json.loads(json.dumps(header))  # a copy
    meta = header.get("__metadata__")
    if isinstance(meta, dict):
        for k, v in meta.items():
            if not isinstance(v, str) or k.startswith("unweight"):
                meta[k] = json.dumps(v, separators=(",", ":"))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def fields(node: Any, path: Path_ = ()) -> Iterator[tuple[Path_, bool]]:
    """Every (path, is_key) of the parsed header: each value, and each key of each object."""
    yield path, False
    if isinstance(node, dict):
        for k, v in node.items():
            yield (*path, k), True
            yield from fields(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from fields(v, (*path, i))


def get(node: Any, path: Path_) -> Any:
    for step in path:
        node = node[step]
    return node


def tampered(header: dict[str, Any], path: Path_, is_key: bool, value: Any) -> dict[str, Any]:
    header = json.loads(json.dumps(header))
    if not path:
        return value if isinstance(value, dict) else {"x": value}
    parent = get(header, path[:-1])
    if is_key:  # rename the key (to another key of the object, or a new one), keeping the order
        new = value if isinstance(value, str) else f"{path[-1]}x"
        items = [(new if k == path[-1] else k, v) for k, v in parent.items() if k != new or k == path[-1]]
        parent.clear()
        parent.update(items)
    else:
        parent[path[-1]] = value
    return header


def same_size_shapes(shape: list[int]) -> list[list[int]]:
    """Other shapes with as many elements: what a reshape slipped into a header would give."""
    n = math.prod(shape)
    out = [list(p) for p in permutations(shape)] if len(shape) <= 4 else [shape[::-1]]
    out += [[n], [n, 1], [1, n], [1, *shape], [*shape, 1]]
    out += [[d, n // d] for d in range(1, min(n, 64) + 1) if n % d == 0]
    return [s for s in out if s != shape]


def values_for(original: Any, is_key: bool, names: list[str]) -> st.SearchStrategy:
    """What to write over a field: plausible edits of its value, or any JSON value."""
    if is_key:
        return st.sampled_from([*names, *(f"{n}::sm" for n in names), "unweight", "__metadata__", "x", ""])
    plausible: list[Any] = []
    if isinstance(original, bool):
        plausible = [not original]
    elif isinstance(original, int):
        plausible = [original + 1, original - 1, original * 2, 0, 1, 2**32 - 1, float(original)]
    elif isinstance(original, str):
        plausible = [*DTYPES, "huffman", "rans", "raw", "unweight", *names, original + "x", original.upper(), ""]
    elif isinstance(original, list) and all(type(x) is int for x in original):
        plausible = [*same_size_shapes(original), original[::-1], original[:-1], [*original, 0]]
        plausible += [[x + 1 if i == j else x for j, x in enumerate(original)] for i in range(len(original))]
    elif isinstance(original, list):
        plausible = [original[::-1], original[:-1], [*original, original[0]] if original else [0]]
    plausible = [p for p in plausible if p != original or type(p) is not type(original)]
    return st.sampled_from(plausible) | JUNK if plausible else JUNK


def outcome(path: Path, want: dict[str, tuple[str, tuple[int, ...], bytes]]) -> str:
    """"error" or "exact"; anything else (wrong data, another exception) fails the test."""
    try:
        with Container(path) as c:
            got = {n: (t, a.shape, a.tobytes()) for n, a, t in c.items()}
    except CodecError:
        return "error"
    assert got == want, "a tampered header decoded into different tensors"
    return "exact"


@pytest.mark.parametrize("mode", ["unweight", "rans"])
@settings(max_examples=3, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_every_header_field_tampered_in_turn(mode: str, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as d:
        out, want = build(Path(d), mode)
        header, blob = split(out)
        names = list(TENSORS)
        seen = set()
        for path, is_key in fields(header):
            original = path[-1] if is_key else get(header, path)
            value = data.draw(values_for(original, is_key, names), label=f"{'key' if is_key else 'value'} {path}")
            (Path(d) / "t.safetensors").write_bytes(join(tampered(header, path, is_key, value), blob))
            try:
                seen.add(outcome(Path(d) / "t.safetensors", want))
            except Exception as e:  # name the field (shrinking a 270-field example is slow)
                raise AssertionError(f"{'key' if is_key else 'value'} {path} set to {value!r}: {e!r}") from e
        assert "error" in seen  # the tampering reached the reader


@pytest.mark.parametrize("mode", ["unweight", "rans"])
def test_reshaped_header_and_retyped_raw_tensor_are_refused(mode: str, tmp_path: Path) -> None:
    """The two cases of issue 13 item 5: a same-size shape, and a raw tensor's dtype changed in both
    its header and the stored array's entry (int32 <-> float32: same width, other values)."""
    out, _ = build(tmp_path, mode)
    header, blob = split(out)
    header["__metadata__"]["unweight::w"]["shape"] = [48, 96]
    (tmp_path / "t.safetensors").write_bytes(join(header, blob))
    with pytest.raises(CodecError, match="'w'.*header fails its CRC-32 check"):
        Container(tmp_path / "t.safetensors")
    header, blob = split(out)
    header["__metadata__"]["unweight::ids"]["dtype"] = "F32"
    header["ids"]["dtype"] = "F32"
    (tmp_path / "t.safetensors").write_bytes(join(header, blob))
    with pytest.raises(CodecError, match="'ids'.*header fails its CRC-32 check"), Container(tmp_path / "t.safetensors"):
        pass
    with SafetensorsFile(out) as f:  # the untouched file still reads
        assert f.info("ids").dtype == "I32"
