"""The codec command line never loses a file (issue 13, items 1-4), driven as a user drives it: in a
subprocess, with real signals. Each test asserts the one-line error (exit 2), that no input file
changed, and that no stray file (temporary, scratch) is left.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from reference.codec import CodecError, compress_checkpoint
from reference.codec.__main__ import main
from reference.model.safetensors_io import SafetensorsFile, write_safetensors

ROOT = Path(__file__).resolve().parents[1]
rng = np.random.default_rng(5)
SMALL = {"w": (rng.standard_normal((64, 128)) * 0.02).astype(np.float32), "b": np.arange(8, dtype=np.int64)}


def start(*args: object, cwd: Path) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "reference.codec", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def cli(*args: object, cwd: Path) -> tuple[int, str]:
    p = start(*args, cwd=cwd)
    _, err = p.communicate(timeout=120)
    return p.returncode, err


def snapshot(d: Path) -> dict[str, str]:
    """Every entry under d: files by content hash, directories and links by kind."""
    out = {}
    for p in sorted(d.rglob("*")):
        key = str(p.relative_to(d))
        if p.is_symlink():
            out[key] = f"link to {os.readlink(p)}"
        elif p.is_dir():
            out[key] = "dir"
        else:
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_one_line_error(rc: int, err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    assert "Traceback" not in err and all(w in lines[0] for w in words), err


@pytest.fixture
def work(tmp_path: Path) -> Path:
    write_safetensors(tmp_path / "model.safetensors", SMALL)
    (tmp_path / "existing_dir").mkdir()
    (tmp_path / "existing_dir" / "keep.txt").write_text("mine")
    return tmp_path


def test_compressing_a_container_is_refused(work: Path) -> None:
    """Item 1: a container as compress input, to a new path and over itself."""
    assert cli("compress", "model.safetensors", "c.safetensors", "--to-bf16", cwd=work)[0] == 0
    before = snapshot(work)
    assert_one_line_error(*cli("compress", "c.safetensors", "c.safetensors", cwd=work), "already an unweight container")
    assert snapshot(work) == before
    with pytest.raises(CodecError, match="already an unweight container"):  # the library refuses it too
        compress_checkpoint(work / "c.safetensors", work / "again.safetensors")
    assert snapshot(work) == before


def test_output_that_is_the_input_is_refused(work: Path, capsys: pytest.CaptureFixture) -> None:
    """Item 2: `compress X X --to-bf16` would replace float32 weights by bf16 ones without a word."""
    before = snapshot(work)
    assert_one_line_error(*cli("compress", "model.safetensors", "model.safetensors", "--to-bf16", cwd=work),
                          "is the input")
    assert snapshot(work) == before
    # the same through other names of the same file (in-process: the same main(), quicker)
    os.symlink("model.safetensors", work / "link.safetensors")
    os.link(work / "model.safetensors", work / "hard.safetensors")
    before = snapshot(work)
    for other in ("link.safetensors", "hard.safetensors", "existing_dir/../model.safetensors"):
        assert main(["compress", str(work / "model.safetensors"), str(work / other), "--to-bf16"]) == 2
        assert_one_line_error(2, capsys.readouterr().err, "is the input")
    (work / "ckpt").mkdir()
    write_safetensors(work / "ckpt" / "model.safetensors", SMALL)
    assert main(["compress", str(work / "ckpt"), str(work / "ckpt" / "model.safetensors")]) == 2  # a shard
    assert_one_line_error(2, capsys.readouterr().err, "is the input")
    assert main(["compress", str(work / "model.safetensors"), str(work / "c.safetensors")]) == 0
    capsys.readouterr()
    before = snapshot(work)
    assert main(["decompress", str(work / "c.safetensors"), str(work / "existing_dir/../c.safetensors")]) == 2
    assert_one_line_error(2, capsys.readouterr().err, "is the input")
    assert snapshot(work) == before


def test_output_in_a_missing_directory_or_on_a_directory(work: Path, capsys: pytest.CaptureFixture) -> None:
    """Item 3: one-line errors, exit 2, and no `<dir>.tmp` left behind."""
    before = snapshot(work)
    assert_one_line_error(*cli("compress", "model.safetensors", "existing_dir", cwd=work), "is a directory")
    assert_one_line_error(*cli("compress", "model.safetensors", "missing/out.safetensors", cwd=work),
                          "does not exist")
    assert snapshot(work) == before
    assert main(["compress", str(work / "model.safetensors"), str(work / "c.safetensors")]) == 0
    capsys.readouterr()
    before = snapshot(work)
    for out, words in (("existing_dir", "is a directory"), ("missing/d.safetensors", "does not exist")):
        assert main(["decompress", str(work / "c.safetensors"), str(work / out)]) == 2
        assert_one_line_error(2, capsys.readouterr().err, words)
    assert snapshot(work) == before


def big_checkpoint(d: Path, n_tensors: int) -> None:
    """float16 tensors of random bits: with --to-bf16 they are cast and compressed (slow, the scratch
    phase); without it they pass through (fast: the final write and its fsync dominate)."""
    t = {f"layer{i}.weight": rng.integers(0, 2**16, (512, 1024), dtype=np.uint16) for i in range(n_tensors)}
    write_safetensors(d / "model.safetensors", t, dtypes=dict.fromkeys(t, "F16"))


def interrupt_when(p: subprocess.Popen, d: Path, pattern: str, sig: int) -> bool:
    """Send ``sig`` as soon as a file matching ``pattern`` appears in d; False if the run ended first."""
    deadline = time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline:
        if any(d.glob(pattern)):
            p.send_signal(sig)
            return True
        time.sleep(0.0005)
    return False


@pytest.mark.parametrize(("sig", "phase", "pattern", "extra"), [
    (signal.SIGTERM, "compress", "out.safetensors.*.scratch", ["--to-bf16"]),
    (signal.SIGINT, "final write", ".out.safetensors.*.tmp", []),
])
def test_interrupted_run_leaves_no_file_and_keeps_the_old_output(work: Path, sig: int, phase: str, pattern: str,
                                                                   extra: list[str]) -> None:
    """Item 4: a real signal in each phase. The old output stays as it was, nothing else appears."""
    big_checkpoint(work, 8)
    (work / "out.safetensors").write_bytes(b"the previous output")
    before = snapshot(work)
    for _attempt in range(3):  # the phase is short: if the run ends before the signal, try again
        p = start("compress", "model.safetensors", "out.safetensors", *extra, cwd=work)
        hit = interrupt_when(p, work, pattern, sig)
        _, err = p.communicate(timeout=120)
        if hit and p.returncode == 128 + sig:
            break
        assert p.returncode == 0, err  # not interrupted: it must have succeeded
        (work / "out.safetensors").write_bytes(b"the previous output")
    else:
        pytest.fail(f"could not interrupt the {phase} phase in 3 runs")
    assert f"interrupted by {signal.Signals(sig).name}" in err and "Traceback" not in err, err
    assert snapshot(work) == before


def test_a_completed_output_is_whole_and_readable(work: Path) -> None:
    """The atomic write keeps the usual permissions (not the private mode of a temporary file)."""
    assert cli("compress", "model.safetensors", "c.safetensors", cwd=work)[0] == 0
    umask = os.umask(0o022)
    os.umask(umask)
    assert (work / "c.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    with SafetensorsFile(work / "c.safetensors") as f:
        assert "unweight" in f.metadata
