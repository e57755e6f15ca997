"""rANS containers written before the second stage (low mantissa bits coded by class) still read.

``tests/data/rans_one_stage_before_low_bits.safetensors`` was written by the rANS writer of the commit before the
second stage came in (``python -m reference.codec compress --mode rans --min-elements 16 --block-size 1024`` of a
64 x 96 bf16 tensor made below): its header has no ``low_bits`` / ``low_tables`` and it stores no
``symbol_class`` / ``low_freqs``. Both readers give back the original bits; a damaged copy is still refused.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reference.bf16 import float32_to_bf16
from reference.codec.container_read import Container
from reference.codec.errors import CodecError

ROOT = Path(__file__).resolve().parents[1]
OLD = ROOT / "tests" / "data" / "rans_one_stage_before_low_bits.safetensors"


def original() -> np.ndarray:
    rng = np.random.default_rng(7)
    return float32_to_bf16((rng.standard_normal((64, 96)) * 0.05).astype(np.float32)).view(np.uint16)


def test_the_reference_reader_decodes_an_earlier_one_stage_file() -> None:
    c = Container(OLD)
    assert "low_bits" not in c.headers["layer.weight"]  # truly the earlier layout
    assert np.array_equal(c.get("layer.weight").view(np.uint16), original())


def test_the_fast_cli_decompresses_it_to_the_original_bits(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "out.safetensors"
    done = subprocess.run([sys.executable, "-m", "fast.codec", "decompress", str(OLD), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from reference.model.safetensors_io import SafetensorsFile  # the output is a plain safetensors file

    got = SafetensorsFile(out)["layer.weight"]
    assert np.array_equal(np.asarray(got).view(np.uint16), original())


def test_a_damaged_earlier_file_is_refused(tmp_path: Path) -> None:
    data = bytearray(OLD.read_bytes())
    data[-100] ^= 0x20  # inside the last stored array
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CodecError):
        Container(bad).get("layer.weight")


# ``tests/data/rans_two_stage_before_context.safetensors``: written by the rANS writer of the commit before tables by
# context came in (``python -m reference.codec compress --mode rans --min-elements 16 --block-size 1024`` of the two
# tensors made below): its headers have no ``context_stride`` / ``context_period`` and it stores no
# ``context_table``; ``two.weight`` took two stages (m = 2, k = 5), ``one.weight`` one.
BEFORE_CONTEXT = ROOT / "tests" / "data" / "rans_two_stage_before_context.safetensors"


def originals_before_context() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    q = rng.integers(-8, 8, (64, 96)).astype(np.float32)
    scale = np.repeat(rng.uniform(0.001, 0.02, (64, 3)).astype(np.float32), 32, axis=1)
    two = float32_to_bf16(q * scale).view(np.uint16)
    one = float32_to_bf16((rng.standard_normal((64, 96)) * 0.05).astype(np.float32)).view(np.uint16)
    return {"two.weight": two, "one.weight": one}


def test_both_readers_decode_an_earlier_two_stage_file() -> None:
    from fast.codec.decode_rans_c import decode_rans_cpu

    with Container(BEFORE_CONTEXT) as c:
        assert "context_period" not in c.headers["two.weight"] and c.headers["two.weight"]["low_bits"] == 5
        for name, bits in originals_before_context().items():
            assert np.array_equal(c.get(name).view(np.uint16), bits)
    with Container(BEFORE_CONTEXT, rans_decoder=lambda ts: [decode_rans_cpu(t) for t in ts]) as c:
        for name, bits in originals_before_context().items():
            assert np.array_equal(c.get(name).view(np.uint16), bits)


def test_a_damaged_earlier_two_stage_file_is_refused(tmp_path: Path) -> None:
    data = bytearray(BEFORE_CONTEXT.read_bytes())
    data[-100] ^= 0x20
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CodecError), Container(bad) as c:
        for name in originals_before_context():
            c.get(name)
