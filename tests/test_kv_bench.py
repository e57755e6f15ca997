"""The KV decode-attention benchmark runs end to end on tiny shapes under the interpreter (no GPU here)."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.engine import bench_kv


def test_bench_kv_tiny_runs_and_checks_itself(tmp_path: Path) -> None:
    out = tmp_path / "bench_kv.json"
    assert bench_kv.main(["--tiny", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["tiny"] and res["interpreter"] and res["commit"]
    rows = res["rows"]
    want = [(d, b) for d in ("bfloat16", "fp8") for b in bench_kv.TINY_BATCHES]
    assert [(r["dtype"], r["batch"]) for r in rows] == want
    assert all(r["triton_GBps"] > 0 and r["gather_sdpa_GBps"] > 0 and r["max_abs_diff"] < 0.05 for r in rows)
    assert all("contiguous_sdpa_GBps" in r for r in rows if r["dtype"] == "bfloat16")


def test_kv_bytes_counts_k_v_and_fp8_scales() -> None:
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 16, "block_size": 16}
    assert bench_kv.kv_bytes(3, 40, shape, "bfloat16") == 3 * 40 * 2 * 2 * 16 * 2
    assert bench_kv.kv_bytes(3, 40, shape, "fp8") == 3 * (40 * 2 * 2 * 16 + 2 * 2 * 3)
