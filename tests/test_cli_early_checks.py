"""The conformance and experiments command lines check their paths before any work (issue 13, items
10 and 11), driven in a subprocess as a user runs them: a one-line error, exit 2, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


@pytest.mark.parametrize(("target", "words"), [
    ("a_dir", "a_dir: is a directory"),
    ("a_file/results.json", "a_file is not a directory"),
    ("a_file/deeper/results.json", "a_file is not a directory"),
])
def test_conformance_json_path_is_checked_before_the_run(tmp_path: Path, target: str, words: str) -> None:
    """Item 10: the unwritable path used to be found only after the whole run, with a traceback."""
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("keep")
    before = listing(tmp_path)
    start = time.monotonic()
    r = run("conformance", "--device", "cpu", "--json", str(tmp_path / target), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert words in r.stderr and r.stdout == "", (r.stdout, r.stderr)  # no case ran
    assert time.monotonic() - start < 60
    assert listing(tmp_path) == before and (tmp_path / "a_file").read_text() == "keep"


def test_conformance_json_into_a_new_folder_is_written(tmp_path: Path) -> None:
    r = run("conformance", "--device", "cpu", "-k", "no-case-has-this-name", "--json",
            str(tmp_path / "new" / "r.json"), cwd=tmp_path)
    assert r.returncode == 2 and "no conformance case matches" in r.stderr  # got past the path check


def test_experiments_weights_path_is_checked_before_any_work(tmp_path: Path) -> None:
    """Item 11: `reproduce --weights PATH` started running experiments before opening PATH."""
    results = ROOT / "experiments" / "results"
    before = {p: p.stat().st_mtime_ns for p in results.rglob("*")} if results.exists() else {}
    (tmp_path / "notes.txt").write_text("not weights")
    for weights, words in ((tmp_path / "missing.safetensors", "no such file or directory"),
                           (tmp_path / "notes.txt", "not weights: a text file")):
        r = run("experiments", "reproduce", "--only", "U1", "--weights", str(weights), cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"--weights {weights}" in r.stderr and words in r.stderr, r.stderr
        assert "==" not in r.stdout, r.stdout  # no experiment started
    after = {p: p.stat().st_mtime_ns for p in results.rglob("*")} if results.exists() else {}
    assert after == before
    assert listing(tmp_path) == ["notes.txt"]
