"""Weight loaders: packaged models, files, checkpoint directories, and their error messages."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reference.model.errors import WeightError
from reference.model.names import tensor_kind
from reference.model.safetensors_io import write_safetensors
from reference.model.weights import open_weights, packaged_path


def test_minilm_is_the_real_checkpoint() -> None:
    w = open_weights("minilm")
    assert w.representative
    assert w.num_params() == 22_713_728  # CLAIMS.md: 22.7 M params (incl. the int64 position ids)
    name = "embeddings.word_embeddings.weight"
    emb = w.get(name)
    assert emb.shape == (30522, 384) and emb.dtype == np.float32 and w.dtype(name) == "F32"
    assert tensor_kind(name) == "embedding"
    assert np.isfinite(emb).all() and 0.01 < float(np.abs(emb).mean()) < 1


def test_smollm2_dequantizes_to_float32_and_is_flagged() -> None:
    w = open_weights("smollm2")
    assert not w.representative and "4-bit" in w.note
    assert len(w) == 272
    q = w.get("blk.0.attn_q.weight")
    assert q.shape == (576, 576) and q.dtype == np.float32
    # Q4_1: every block of 32 consecutive weights holds at most 16 distinct values
    blocks = q.reshape(-1, 32)
    assert max(len(np.unique(b)) for b in blocks[:200]) <= 16
    assert w.get("token_embd.weight").shape == (49152, 576)  # Q8_0
    assert w.shape("blk.3.ffn_down.weight") == (576, 1536)
    meta = w.files[0].metadata()
    assert meta["llama.block_count"] == 30 and meta["general.architecture"] == "llama"


def test_directory_of_shards_with_index(tmp_path: Path) -> None:
    a = np.arange(12, dtype=np.uint16).reshape(3, 4)
    b = np.ones(5, np.float32)
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"x.weight": a}, dtypes={"x.weight": "BF16"})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"y.weight": b})
    index = {"weight_map": {"x.weight": "model-00001-of-00002.safetensors",
                            "y.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    w = open_weights(tmp_path)
    assert sorted(w.names()) == ["x.weight", "y.weight"]
    assert w.dtype("x.weight") == "BF16" and np.array_equal(w.get("x.weight"), a)
    assert dict(w)["y.weight"].tolist() == [1.0] * 5


def test_directory_without_index_and_duplicate_names(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", {"t": np.zeros(2, np.float32)})
    assert open_weights(tmp_path).names() == ["t"]
    write_safetensors(tmp_path / "b.safetensors", {"t": np.zeros(2, np.float32)})
    with pytest.raises(WeightError, match="appears in both"):
        open_weights(tmp_path)


def test_errors_name_the_path_and_the_problem(tmp_path: Path) -> None:
    with pytest.raises(WeightError, match="no such file or directory.*packaged models: minilm"):
        open_weights(tmp_path / "missing")
    with pytest.raises(WeightError, match="no weights in this directory"):
        open_weights(tmp_path)
    (tmp_path / "w.bin").write_bytes(b"\0" * 16)
    with pytest.raises(WeightError, match=r"w\.bin: not weights: unrecognised binary data"):
        open_weights(tmp_path / "w.bin")
    bad = tmp_path / "cut.safetensors"
    write_safetensors(bad, {"t": np.zeros(100, np.float32)})
    bad.write_bytes(bad.read_bytes()[:-10])
    with pytest.raises(WeightError, match=r"cut\.safetensors.*past the end"):
        open_weights(bad)
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(WeightError, match="malformed index"):
        open_weights(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"t": "gone.safetensors"}}))
    with pytest.raises(WeightError, match="missing"):
        open_weights(tmp_path)


@pytest.mark.parametrize("keep", [0, 100, 5_000_000, 60_000_000])
def test_truncated_gguf_is_rejected(tmp_path: Path, keep: int) -> None:
    cut = tmp_path / "cut.gguf"
    with open(packaged_path("smollm2"), "rb") as f:
        cut.write_bytes(f.read(keep))
    with pytest.raises(WeightError, match=r"cut\.gguf"):
        open_weights(cut)
