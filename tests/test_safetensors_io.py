"""The safetensors reader/writer (reference/model/safetensors_io.py) against the `safetensors` package."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

from reference.model.safetensors_io import SafetensorsError, SafetensorsFile, write_safetensors

TMP = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=7)
bits16 = st.integers(0, 2**16 - 1)


@TMP
@given(shape=shapes, data=st.data())
def test_reads_bf16_f16_f32_written_by_safetensors(tmp_path: Path, shape: tuple[int, ...], data: st.DataObject) -> None:
    b = data.draw(hnp.arrays(np.uint16, shape, elements=bits16))  # any bit pattern, NaNs included
    h = data.draw(hnp.arrays(np.uint16, shape, elements=bits16)).view(np.float16)
    f = data.draw(hnp.arrays(np.uint32, shape, elements=st.integers(0, 2**32 - 1))).view(np.float32)
    path = tmp_path / "t.safetensors"
    torch_save_file({
        "b": torch.from_numpy(b.view(np.int16).copy()).view(torch.bfloat16),
        "h": torch.from_numpy(h.copy()),
        "f": torch.from_numpy(f.copy()),
    }, str(path), metadata={"k": "v"})
    with SafetensorsFile(path) as st_file:
        assert st_file.metadata == {"k": "v"}
        assert st_file.info("b").dtype == "BF16" and st_file["b"].dtype == np.uint16
        assert np.array_equal(st_file["b"], b)
        assert np.array_equal(st_file["h"].view(np.uint16), h.view(np.uint16))
        assert np.array_equal(st_file["f"].view(np.uint32), f.view(np.uint32))


@TMP
@given(shape=shapes, data=st.data())
def test_our_writer_is_read_by_safetensors(tmp_path: Path, shape: tuple[int, ...], data: st.DataObject) -> None:
    b = data.draw(hnp.arrays(np.uint16, shape, elements=bits16))
    f = data.draw(hnp.arrays(np.float32, shape))
    i = data.draw(hnp.arrays(np.int64, shape))
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, {"b": b, "f": f, "i": i}, dtypes={"b": "BF16"}, metadata={"x": "1"})
    theirs = torch_load_file(str(path))
    assert theirs["b"].dtype == torch.bfloat16
    # (torch views a 0-d bf16 tensor as shape (1,), so compare flattened)
    assert theirs["b"].shape == b.shape
    assert np.array_equal(theirs["b"].reshape(-1).view(torch.int16).numpy().view(np.uint16), b.reshape(-1))
    assert np.array_equal(theirs["f"].numpy().view(np.uint32), f.view(np.uint32))
    assert np.array_equal(theirs["i"].numpy(), i)
    with SafetensorsFile(path) as ours:  # and back through our own reader
        assert ours.metadata == {"x": "1"} and np.array_equal(ours["b"], b)


def test_empty_file_of_tensors(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    np_save_file({"z": np.zeros((0, 3), np.float32)}, str(path))
    with SafetensorsFile(path) as f:
        assert f["z"].shape == (0, 3)


def _raw(tmp_path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    blob = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
    return path


@pytest.mark.parametrize("header,data,length,message", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None, "past the end"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, None, "needs 16"),
    ({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "unknown dtype"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "shape"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, None, "backwards"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, b"\0" * 4, None, "data_offsets"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, "overlap"),
    ({"__metadata__": {"k": 1}}, b"", None, "__metadata__"),
    ([1, 2], b"", None, "JSON object"),
    (b"{not json", b"", None, "not valid"),
    ({}, b"", 10**6, "truncated"),
    ({}, b"", 2**63, "limit"),
])
def test_malformed_files_are_rejected_with_the_file_named(tmp_path: Path, header: object, data: bytes,
                                                          length: int | None, message: str) -> None:
    path = _raw(tmp_path, header, data, length)
    with pytest.raises(SafetensorsError, match=message) as e:
        SafetensorsFile(path)
    assert str(path) in str(e.value)


def test_missing_and_tiny_files(tmp_path: Path) -> None:
    with pytest.raises(SafetensorsError, match="no such file"):
        SafetensorsFile(tmp_path / "nope.safetensors")
    (tmp_path / "tiny.safetensors").write_bytes(b"\1\2\3")
    with pytest.raises(SafetensorsError, match="truncated"):
        SafetensorsFile(tmp_path / "tiny.safetensors")


@TMP
@given(cut=st.integers(0, 200))
def test_every_truncation_is_rejected(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "whole.safetensors"
    write_safetensors(path, {"a": np.arange(20, dtype=np.float32), "b": np.arange(9, dtype=np.uint16)},
                      dtypes={"b": "BF16"})
    whole = path.read_bytes()
    cut = min(cut, len(whole) - 1)
    short = tmp_path / "short.safetensors"
    short.write_bytes(whole[:cut])
    with pytest.raises(SafetensorsError):
        SafetensorsFile(short)


@TMP
@given(flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 7)), min_size=1, max_size=4))
def test_corrupted_headers_never_crash_elsewhere(tmp_path: Path, flips: list[tuple[int, int]]) -> None:
    """Flipping bits in the length or header gives a valid file or a SafetensorsError: nothing else."""
    path = tmp_path / "c.safetensors"
    write_safetensors(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int64)})
    raw = bytearray(path.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    for pos, bit in flips:
        raw[pos % header_end] ^= 1 << bit
    path.write_bytes(bytes(raw))
    try:
        with SafetensorsFile(path) as f:
            for name in f:
                arr = f[name]
                assert arr.nbytes == f.info(name).end - f.info(name).begin
    except SafetensorsError:
        pass


def test_writer_rejects_unstorable_arrays(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="no safetensors dtype"):
        write_safetensors(tmp_path / "x.safetensors", {"c": np.zeros(2, np.complex64)})
    with pytest.raises(TypeError, match="cannot be stored"):
        write_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(2, np.float32)}, dtypes={"a": "BF16"})
    assert not (tmp_path / "x.safetensors").exists()
