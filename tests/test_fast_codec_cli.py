"""``python -m fast.codec`` against ``python -m reference.codec``: same arguments, byte-identical files."""

from __future__ import annotations

from pathlib import Path

import pytest

from fast.codec.__main__ import main as fast_main
from reference.codec.__main__ import main as reference_main
from reference.model.safetensors_io import write_safetensors
from tests.test_codec_container import DTYPES, TENSORS


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    write_safetensors(path, TENSORS, dtypes=DTYPES, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("flags", [[], ["--to-bf16"], ["--to-bf16", "--chunk-size", "5", "--chunks-per-group", "3",
                                                       "--max-code-length", "9", "--min-elements", "1"],
                                   ["--palette-size", "256", "--max-code-length", "16"], ["--mode", "rans"]])
def test_fast_cli_writes_the_reference_cli_files_byte_for_byte(checkpoint: Path, tmp_path: Path, flags: list[str],
                                                               capsys: pytest.CaptureFixture) -> None:
    outputs = {}
    for label, main in (("reference", reference_main), ("fast", fast_main)):
        packed, unpacked = tmp_path / f"{label}.unweight.safetensors", tmp_path / f"{label}.bf16.safetensors"
        assert main(["compress", str(checkpoint), str(packed), *flags]) == 0
        assert main(["decompress", str(packed), str(unpacked)]) == 0
        capsys.readouterr()
        assert main(["inspect", str(packed)]) == 0
        outputs[label] = (packed.read_bytes(), unpacked.read_bytes(), capsys.readouterr().out)
    assert outputs["fast"][0] == outputs["reference"][0], "compressed containers differ"
    assert outputs["fast"][1] == outputs["reference"][1], "decompressed checkpoints differ"
    assert outputs["fast"][2] == outputs["reference"][2], "inspect tables differ"


@pytest.mark.parametrize("flags", [[], ["--mode", "rans"]])
def test_fast_cli_refuses_what_the_reference_cli_refuses(checkpoint: Path, tmp_path: Path, flags: list[str],
                                                         capsys: pytest.CaptureFixture) -> None:
    """The shared safe-write path: output = input, a directory as output, a damaged container (both
    forms: the C decoders check the arrays themselves)."""
    packed = tmp_path / "c.safetensors"
    assert fast_main(["compress", str(checkpoint), str(packed), *flags]) == 0
    data = bytearray(packed.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor's arrays
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(bytes(data))
    for argv in (["compress", str(checkpoint), str(checkpoint)], ["decompress", str(packed), str(tmp_path)],
                 ["decompress", str(damaged), str(tmp_path / "out.safetensors")]):
        capsys.readouterr()
        assert fast_main(argv) == 2
        fast_err = capsys.readouterr().err.splitlines()[-1]  # the last line: after any progress bar
        assert reference_main(argv) == 2
        reference_err = capsys.readouterr().err.splitlines()[-1]
        assert fast_err.startswith("error: ") and reference_err.startswith("error: ")
        if argv[1] != str(damaged):  # the same check refuses these; damage may be found by another check
            assert fast_err == reference_err
    assert not (tmp_path / "out.safetensors").exists()
