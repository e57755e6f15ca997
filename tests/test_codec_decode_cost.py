"""The decode_cost experiment end to end, in a process of its own (it pins itself to one core): a small bf16
checkpoint, two costs, the JSON and the figure it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reference.model.safetensors_io import write_safetensors
from tests.test_codec_rans import coarse, trained

pytest.importorskip("zipnn")


def test_decode_cost_trades_size_for_speed(tmp_path: Path) -> None:
    tensors = {"grid.weight": coarse((256, 1024)), "trained.weight": trained((256, 512))}
    src = tmp_path / "model.safetensors"
    write_safetensors(src, tensors, dtypes={k: "BF16" for k in tensors}, metadata={"format": "pt"})
    out, png = tmp_path / "cost.json", tmp_path / "cost.png"
    run = subprocess.run([sys.executable, "-m", "experiments.unweight.codec_decode_cost", "--weights", str(src),
                          "--costs", "0", "100", "--repeat", "2", "--json", str(out), "--png", str(png)],
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    (model,) = result["models"]
    small, fast = model["rows"]
    assert (small["decode_cost"], fast["decode_cost"]) == (0, 100) and model["tensors"] == 2
    assert small["ratio"] > fast["ratio"] > 1.2  # the smallest form at 0, the fastest form's at 100
    assert any("k0" not in form for form in small["forms"]) and all(
        form.startswith("m") and "k0" in form and " " not in form for form in fast["forms"])  # one stage by block
    assert all(r["decode_s"] > 0 and r["vs_zipnn"] > 0 for r in model["rows"]) and model["zipnn_decode_s"] > 0
    assert png.stat().st_size > 10_000 and result["zipnn_version"] and result["commit"]
    bad = subprocess.run([sys.executable, "-m", "experiments.unweight.codec_decode_cost", "--costs", "-1"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert bad.returncode == 2 and "--costs" in bad.stderr
