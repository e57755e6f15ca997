"""Weights are recognised by content, not by file name (``reference/model/sniff.py``): a container named
``model.uw``, a safetensors file named ``weights.bin``, a GGUF named ``x.dat`` all load, through
``open_weights`` and through a real ``python -m serve --model x.uw`` process; files that are not weights
(PNG, empty, truncated, text) are refused with an error naming what they are."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference.model.carried import ContainerFile
from reference.model.errors import WeightError
from reference.model.gguf_io import GGUFFile
from reference.model.safetensors_io import SafetensorsFile, write_safetensors
from reference.model.sniff import detect_format
from reference.model.weights import open_weights
from tests.test_compressed_model import _served_texts, _start_server
from tests.tiny_checkpoint import write_tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
PNG = b"\x89PNG\r\n\x1a\n" + b"\0\0\0\rIHDR" + bytes(17)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny checkpoint, its weights renamed ``weights.bin``, and its container as ``tiny.uw``."""
    root = tmp_path_factory.mktemp("sniff")
    folder = write_tiny_checkpoint(root / "ckpt")
    container = root / "tiny.uw"
    cmd = [sys.executable, "-m", "reference.codec", "compress", str(folder), str(container), "--min-elements",
           "1024"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr
    renamed = root / "renamed"
    renamed.mkdir()
    for p in folder.iterdir():
        (renamed / ("weights.bin" if p.suffix == ".safetensors" else p.name)).write_bytes(p.read_bytes())
    return {"folder": folder, "uw": container, "renamed": renamed}


def test_odd_names_load_by_content(tiny, tmp_path):
    assert detect_format(tiny["uw"]) == "unweight"
    src = open_weights(tiny["uw"])
    assert isinstance(src.files[0], ContainerFile)
    plain = open_weights(tiny["folder"])
    assert src.names() == plain.names()
    for name in plain.names():
        assert np.array_equal(src.get(name), plain.get(name)), name
    assert detect_format(tiny["renamed"] / "weights.bin") == "safetensors"
    renamed = open_weights(tiny["renamed"] / "weights.bin")
    assert isinstance(renamed.files[0], SafetensorsFile) and renamed.names() == plain.names()
    # a folder with no file named as weights: its files are looked at, so a lone model.uw is found
    folder = tmp_path / "uwfolder"
    folder.mkdir()
    (folder / "model.uw").write_bytes(tiny["uw"].read_bytes())
    (folder / "notes.txt").write_text("the container beside a note")
    assert open_weights(folder).names() == plain.names()


def test_gguf_under_another_name(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "x.dat"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert detect_format(path) == "gguf"
    src = open_weights(path)
    assert isinstance(src.files[0], GGUFFile)
    assert np.array_equal(src.get("t"), np.arange(6, dtype=np.float32).reshape(2, 3))


def _bad_files(tmp_path: Path) -> list[tuple[Path, str]]:
    good = tmp_path / "good.safetensors"
    write_safetensors(good, {"t": np.zeros(100, np.float32)})
    raw = good.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    cases = {
        "pic.uw": (PNG, "a PNG image"),
        "empty.uw": (b"", "the file is empty"),
        "short.uw": (b"\x01\x02\x03", "only 3 bytes"),
        "cut.uw": (raw[: 8 + n // 2], f"truncated safetensors file: its header length says {n} bytes"),
        "notes.uw": (b"these are not the weights you are looking for\n", "a text file"),
        "config.uw": (b'{"hidden_size": 64}\n', "a JSON text file"),
        "ckpt.uw": (b"PK\x03\x04" + bytes(40), "a zip archive"),
        "torch.uw": (b"\x80\x02" + bytes(40), "a Python pickle"),
        "noise.uw": (bytes(range(200, 256)) * 3, "unrecognised binary data"),
        "huge.uw": ((2**40).to_bytes(8, "little") + b'{"a": 1}', "unrecognised binary data"),
    }
    out = []
    for name, (data, words) in cases.items():
        (tmp_path / name).write_bytes(data)
        out.append((tmp_path / name, words))
    return out


def test_wrong_files_are_named_for_what_they_are(tmp_path):
    for path, words in _bad_files(tmp_path):
        with pytest.raises(WeightError) as e:
            open_weights(path)
        assert str(path) in str(e.value) and words in str(e.value), (path.name, str(e.value))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(head=st.binary(max_size=64), length=st.integers(0, 2**64 - 1), tail=st.binary(max_size=64),
       magic=st.sampled_from([b"", b"GGUF", b"{"]))
def test_fuzzed_headers_give_a_format_or_a_weight_error(tmp_path, head, length, tail, magic):
    """Random starts, random header lengths (up to 2^64 - 1) before a ``{``: never an exception other than
    WeightError, never a read past the file, from detect_format and from open_weights."""
    for data in (head, magic + head, length.to_bytes(8, "little") + b"{" + tail,
                 length.to_bytes(8, "little") + b'{"__metadata__": {"unweight": "x"}' + tail):
        path = tmp_path / "f.uw"
        path.write_bytes(data)
        try:
            kind = detect_format(path)
        except WeightError as e:
            assert str(path) in str(e)
            continue
        assert kind in ("gguf", "safetensors", "unweight")
        try:
            open_weights(path)
        except WeightError as e:
            assert str(path) in str(e)


def test_fuzzed_safetensors_header_bytes(tmp_path):
    """A real safetensors file with one header byte changed at a time: a load or a WeightError."""
    good = tmp_path / "good.bin"
    write_safetensors(good, {"a": np.arange(12, dtype=np.float32), "b": np.ones((2, 3), np.uint8)})
    raw = bytearray(good.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    rng = np.random.default_rng(zlib.crc32(bytes(raw)))
    for i in list(range(9)) + [int(j) for j in rng.integers(8, 8 + n, 120)]:
        bad = bytearray(raw)
        bad[i] = int(rng.integers(0, 256))
        path = tmp_path / "m.bin"
        path.write_bytes(bytes(bad))
        try:
            open_weights(path)
        except WeightError as e:
            assert str(path) in str(e)


def test_server_process_serves_a_uw_container(tiny):
    """``python -m serve --model tiny.uw``, plain and ``--compressed``: the checkpoint's greedy text."""
    pytest.importorskip("torch")
    texts = _served_texts([(tiny["folder"], []), (tiny["uw"], []), (tiny["uw"], ["--compressed"])], 8, 180)
    assert texts[0] and texts[1] == texts[0] and texts[2] == texts[0]


def test_server_process_names_a_wrong_file(tmp_path):
    bad = tmp_path / "model.uw"
    bad.write_bytes(PNG)
    proc = _start_server(bad)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "Traceback" not in err, err
    assert f"{bad}: not weights: a PNG image" in err, err
