"""Probes of the file door: the safetensors reader and the container reader, through both codec
command lines (``python -m reference.codec``, ``python -m fast.codec``) and both reading commands.

A header (or a container's metadata entry) holding JSON nested 100,000 deep must give exit 2 and
one line, as a process and in-process; hypothesis then feeds random header bytes and random
mutations of real headers to both readers: each either loads cleanly or exits 2 with one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference.codec import compress_checkpoint
from reference.codec.__main__ import main as reference_main
from reference.model.safetensors_io import SafetensorsError, SafetensorsFile, write_safetensors

ROOT = Path(__file__).resolve().parent.parent
DEEP = "[" * 100_000 + "]" * 100_000
TENSORS = {"w": (np.random.default_rng(3).standard_normal((64, 64)) * 0.02).astype(np.float32)}


def raw_safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    return path


def replace_metadata(container: Path, out: Path, key_filter, value: str) -> Path:
    """A copy of ``container`` with the metadata entries whose key passes ``key_filter`` set to ``value``."""
    blob = container.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    header["__metadata__"] = {k: value if key_filter(k) else v for k, v in header["__metadata__"].items()}
    return raw_safetensors(out, json.dumps(header).encode(), blob[8 + n:])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("probe_files")
    plain = d / "plain.safetensors"
    write_safetensors(plain, TENSORS, metadata={"format": "pt"})
    container = d / "packed.safetensors"
    compress_checkpoint(plain, container, to_bf16=True, min_elements=1)
    out = {"plain": plain, "container": container,
           "deep_header": raw_safetensors(d / "deep_header.safetensors", DEEP.encode()),
           "deep_entry": replace_metadata(container, d / "deep_entry.safetensors", lambda k: k == "unweight",
                                          DEEP),
           "deep_tensor_header": replace_metadata(container, d / "deep_tensor.safetensors",
                                                  lambda k: k.startswith("unweight") and k != "unweight", DEEP)}
    meta = SafetensorsFile(container).metadata
    assert "unweight" in meta and any(k.startswith("unweight") and k != "unweight" for k in meta), sorted(meta)
    return out


def cli(module: str, *args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=180, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def assert_one_line_exit_2(rc: int, err: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err[-2000:])
    assert "Traceback" not in err and "RecursionError" not in err


def codec_main(module: str):
    if module == "fast.codec":
        pytest.importorskip("torch")
        from fast.codec.__main__ import main

        return main
    return reference_main


@pytest.mark.parametrize("module", ["reference.codec", "fast.codec"])
def test_json_nested_100k_deep_in_a_header_exits_2_with_one_line(files, module, tmp_path, capsys):
    main = codec_main(module)
    for name in ("deep_header", "deep_entry", "deep_tensor_header"):
        for command in (["inspect", files[name]], ["decompress", files[name], tmp_path / "out.safetensors"]):
            rc = main([str(a) for a in command])
            err = capsys.readouterr().err
            assert_one_line_exit_2(rc, err)
            assert not (tmp_path / "out.safetensors").exists()
            if name == "deep_header":
                assert "nested more than" in err, err


@pytest.mark.parametrize("module", ["reference.codec", pytest.param("fast.codec", marks=pytest.mark.slow)])
def test_as_a_process_too(files, module, tmp_path):
    """The same, in a real process (the recursion limit of a fresh interpreter, no pytest around it)."""
    codec_main(module)
    p = cli(module, "decompress", files["deep_tensor_header"], tmp_path / "out.safetensors")
    assert_one_line_exit_2(p.returncode, p.stderr)
    p = cli(module, "inspect", files["deep_header"])
    assert_one_line_exit_2(p.returncode, p.stderr)


def test_the_probe_files_are_readable_when_not_tampered_with(files, tmp_path, capsys):
    assert reference_main(["inspect", str(files["container"])]) == 0
    assert reference_main(["decompress", str(files["container"]), str(tmp_path / "back.safetensors")]) == 0


def _run_reader(path: Path, capsys: pytest.CaptureFixture) -> None:
    """Both readers on ``path``: a clean load, or exit 2 with one line; never an exception."""
    try:
        SafetensorsFile(path)
    except SafetensorsError as e:
        assert "\n" not in str(e)
    rc = reference_main(["inspect", str(path)])
    err = capsys.readouterr().err
    if rc != 0:
        assert_one_line_exit_2(rc, err)


header_bytes = (st.binary(max_size=300)
                | st.text(alphabet='[]{}",:0123456789 abdefnorstuxlFU8\\', max_size=300).map(str.encode))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=header_bytes, declared=st.none() | st.integers(0, 2**64 - 1), data=st.binary(max_size=64))
def test_random_header_bytes_load_cleanly_or_exit_2(tmp_path, capsys, header, declared, data):
    path = tmp_path / "random.safetensors"
    blob = header + data
    size = len(header) if declared is None else declared
    path.write_bytes(size.to_bytes(8, "little") + blob)
    _run_reader(path, capsys)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.integers(0, 10**6), how=st.sampled_from(["flip", "cut", "insert", "brackets"]),
       byte=st.integers(0, 255), count=st.integers(1, 200))
def test_mutated_container_headers_load_cleanly_or_exit_2(files, tmp_path, capsys, where, how, byte, count):
    blob = bytearray(files["container"].read_bytes())
    n = int.from_bytes(blob[:8], "little")
    header = bytearray(blob[8:8 + n])
    i = where % len(header)
    if how == "flip":
        header[i] ^= byte or 1
    elif how == "cut":
        del header[i:i + count]
    elif how == "insert":
        header[i:i] = bytes([byte]) * count
    else:
        header[i:i] = b"[" * (count * 50)
    path = tmp_path / "mutated.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + bytes(header) + bytes(blob[8 + n:]))
    _run_reader(path, capsys)
