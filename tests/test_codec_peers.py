"""The codec benchmark's peers (experiments/unweight/bench_codec_peers.py): each installed one round-trips a small
bf16 file byte for byte through the calls the benchmark times; a missing one is skipped with a line saying so."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from experiments.unweight import bench_codec_peers as peers

os.environ.setdefault("BIGSMALL_DISABLE_VERSION_CHECK", "1")  # bigsmall's import would ask PyPI for its version


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    tensors = {f"layer.{i}.weight": (rng.standard_normal((64, 256)) * 0.02).astype(np.float32) for i in range(3)}
    bits = {n: (t.view(np.uint32) >> 16).astype(np.uint16) for n, t in tensors.items()}
    path = tmp_path_factory.mktemp("peers") / "model.safetensors"
    peers.write_model_file(bits, path)
    return path, bits


def test_every_installed_coder_gives_the_file_back_byte_for_byte(model: tuple[Path, dict[str, np.ndarray]],
                                                                 tmp_path: Path) -> None:
    src, tensors = model
    skipped: list[str] = []
    coders = peers.coders(skipped.append)
    assert [c.name for c in coders[:3]] == ["ours_unweight", "ours_rans", "zipnn"]
    assert len(coders) + len(skipped) == 3 + len(peers.OPTIONAL)
    for c in coders:
        dst = tmp_path / c.name
        c.compress(src, dst)
        assert peers.identical(c.decode(dst), tensors, src.read_bytes()), c.name
        assert c.version and c.version != "?"


def test_a_missing_peer_is_skipped_with_a_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "OPTIONAL", {"nosuchcoder": ("nosuchcoder_module_xyz", None)})
    lines: list[str] = []
    coders = peers.coders(lines.append)
    assert [c.name for c in coders] == ["ours_unweight", "ours_rans", "zipnn"]
    assert lines == [f"skipped nosuchcoder: not installed ({peers.PEERS_EXTRA})"]


def test_identical_compares_tensors_or_the_whole_file() -> None:
    t = {"a": np.arange(4, dtype=np.uint16)}
    assert peers.identical({"a": np.arange(4, dtype=np.uint16)}, t, b"")
    assert not peers.identical({"a": np.arange(1, 5, dtype=np.uint16)}, t, b"")
    assert not peers.identical({"b": t["a"]}, t, b"")
    assert peers.identical([b"ab", bytearray(b"c")], t, b"abc")
    assert not peers.identical([b"ab"], t, b"abc")


def test_u3_section_reads_the_stored_comparison(tmp_path: Path) -> None:
    import json

    from experiments.report import codec_peers_lines

    assert codec_peers_lines(tmp_path) == []
    coder = {"ratio": 1.5, "decode_GBps_median": 0.5, "decode_vs_zipnn_median": 1.0}
    (tmp_path / "bench_codec_peers.json").write_text(json.dumps({
        "versions": {"ours_rans": "commit abc", "zipnn": "0.5.4"}, "repeat": 3, "cpu": "X", "commit": "abc",
        "date": "d", "models": [{"weights": "minilm", "coders": {"ours_rans": coder, "zipnn": coder}}]}))
    lines = codec_peers_lines(tmp_path)
    assert "| model | ours_rans | zipnn 0.5.4 |" in lines
    assert "| minilm | 1.5000x, 0.5 GB/s (1.00x) | 1.5000x, 0.5 GB/s (1.00x) |" in lines
    (tmp_path / "bench_codec_peers.json").write_text("{}")
    assert codec_peers_lines(tmp_path) == []
