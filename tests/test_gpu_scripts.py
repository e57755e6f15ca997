"""The GPU benchmark scripts run end to end on tiny shapes under the interpreter (no GPU here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.unweight import bench_encode, gpu_bench


def test_gpu_bench_tiny_runs_and_checks_itself(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert gpu_bench.main(["--tiny", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["tiny"] and res["interpreter"]
    assert res["decode"]["palette"]["out_GBps"] > 0 and res["decode"]["huffman"]["out_GBps"] > 0
    assert [r["batch"] for r in res["matmul"]] == gpu_bench.TINY_BATCHES
    assert all(r["fused_equals_plain_on_decoded"] for r in res["matmul"])
    assert {"palette_decode_TBps", "fused_b1_speedup_vs_cublas", "memory_bound_limit"} <= set(res["goals"])
    assert res["commit"] and res["date"]


@pytest.mark.slow
def test_gpu_check_tiny_runs_both_steps(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "--tiny", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["compile_gate"]["rc"] == 0  # the gate runs first, without a GPU too
    assert summary["conformance"]["passed"] is True and summary["benchmark"]["goals"]
    assert summary["engine"]["rc"] == 0 and summary["engine"]["goals"]


def test_bench_encode_checks_bytes_and_reports_both(capsys) -> None:
    assert bench_encode.main(["--limit", "2", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "ours" in out and "ZipNN" in out
