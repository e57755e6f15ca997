"""experiments/engine/bench_engine_ab: this checkout's fast engine against a baseline commit or checkout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.engine import bench_engine_ab

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.mark.skipif(git("rev-parse", "HEAD").returncode != 0, reason="not a git checkout")
def test_a_commit_baseline_runs_in_alternation_and_its_worktree_is_removed(tmp_path):
    out = tmp_path / "ab.json"
    done = subprocess.run([sys.executable, "-m", "experiments.engine.bench_engine_ab", "--baseline", "HEAD", "--tiny",
                           "--pairs", "2", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["setup"]["baseline_commit"] == git("rev-parse", "--short=12", "HEAD").stdout.strip()
    for side in ("candidate", "baseline"):
        runs = result["runs"][side]
        assert len(runs) == 2 and all(r["useful_tok_s"] > 0 for r in runs)
    tok = result["candidate_over_baseline"]["useful_tok_s"]
    assert 0 < tok["min"] <= tok["median"] <= tok["max"]
    assert "candidate" in done.stdout and "over baseline" in done.stdout
    assert "unfire-baseline-" not in git("worktree", "list").stdout  # the temporary worktree is gone
    assert result["figures"] == ["ab.png"] and (tmp_path / "ab.png").stat().st_size > 0
    (tmp_path / "ab.png").unlink()
    bench_engine_ab.main(["--plot", str(out)])  # drawn again from the stored file
    assert (tmp_path / "ab.png").stat().st_size > 0


def test_a_baseline_that_is_neither_a_commit_nor_a_checkout_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_engine_ab.main(["--baseline", "no-such-commit-0123", "--tiny", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "neither a folder nor a commit" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_engine_ab.main(["--baseline", str(tmp_path), "--tiny", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "holds no bench_engine" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_engine_ab.main(["--baseline", str(ROOT), "--pairs", "0"])
    assert e.value.code == 2 and "--pairs must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        bench_engine_ab.main(["--plot", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "not a bench_engine_ab results file" in capsys.readouterr().err


def test_the_bench_is_found_in_either_layout(tmp_path):
    assert bench_engine_ab.bench_module(ROOT) == "experiments.engine.bench_engine"
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "bench_engine.py").write_text("")
    assert bench_engine_ab.bench_module(tmp_path) == "experiments.bench_engine"
