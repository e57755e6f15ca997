"""What makes ``python -m fast.codec decompress`` fast (issue 45), kept: lazy imports, a streaming writer.

The writer's output is byte-identical to ``write_safetensors``'s (and the CLI's to the reference CLI's: see
tests/test_fast_codec_cli.py); bad input to it leaves no file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fast.codec
from fast import _GPU_DRIVER_PATHS
from reference.codec.container_write import compress_checkpoint, decompress_checkpoint
from reference.model.safetensors_io import (
    DTYPES,
    SafetensorsFile,
    header_bytes,
    write_safetensors,
    write_safetensors_stream,
)

REPO = Path(__file__).resolve().parent.parent


def run_python(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environ, check=True, capture_output=True,
                          text=True).stdout


@pytest.mark.skipif(not sys.platform.startswith("linux") or any(os.path.exists(p) for p in _GPU_DRIVER_PATHS),
                    reason="a GPU driver is present: fast/__init__ asks torch whether CUDA is available")
def test_the_command_line_module_loads_neither_torch_nor_triton() -> None:
    out = run_python("import sys, fast.codec.__main__\n"
                     "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    assert out.strip() == "[]"


def test_fast_codec_names_load_on_first_use() -> None:
    from fast.codec import decode_c, decode_torch, forms

    assert fast.codec.decode_cpu is decode_c.decode_cpu
    assert fast.codec.HuffmanForm is forms.HuffmanForm
    assert fast.codec.transcode_torch is decode_torch.transcode_torch
    assert set(fast.codec.__all__) <= set(dir(fast.codec))
    for name in fast.codec.__all__:
        assert getattr(fast.codec, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fast.codec.nope  # noqa: B018


def test_cli_threads_follow_omp_num_threads_without_torch() -> None:
    out = run_python("from fast.codec.__main__ import cli_threads; print(cli_threads())", OMP_NUM_THREADS="3")
    assert out.strip() == "3"


ARRAYS = st.lists(st.tuples(st.sampled_from(["BF16", "F32", "U8", "I64", "F16"]),
                            st.lists(st.integers(0, 4), max_size=3)), min_size=0, max_size=5)


@settings(max_examples=40, deadline=None)
@given(specs=ARRAYS, meta=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
def test_the_streaming_writer_writes_what_write_safetensors_writes(tmp_path_factory: pytest.TempPathFactory,
                                                                  specs: list, meta: dict[str, str]) -> None:
    tmp = tmp_path_factory.mktemp("w")
    rng = np.random.default_rng(len(specs))
    tensors = {f"t{i}": rng.integers(0, 255, size=shape, dtype=np.uint8).astype(DTYPES[dtype])
               for i, (dtype, shape) in enumerate(specs)}
    dtypes = {f"t{i}": dtype for i, (dtype, _) in enumerate(specs)}
    write_safetensors(tmp / "a.safetensors", tensors, dtypes=dtypes, metadata=meta)
    entries = [(n, dtypes[n], t.shape) for n, t in tensors.items()]
    write_safetensors_stream(tmp / "b.safetensors", entries, iter(tensors.values()), meta)
    data = (tmp / "b.safetensors").read_bytes()
    assert data == (tmp / "a.safetensors").read_bytes()
    assert data.startswith(header_bytes(entries, meta))
    with SafetensorsFile(tmp / "b.safetensors") as f:
        assert all(np.array_equal(f[n], t) for n, t in tensors.items())


def test_the_streaming_writer_writes_big_endian_arrays_little_endian(tmp_path: Path) -> None:
    a = np.arange(6, dtype=">f4").reshape(2, 3)
    write_safetensors_stream(tmp_path / "x.safetensors", [("a", "F32", (2, 3))], [a])
    with SafetensorsFile(tmp_path / "x.safetensors") as f:
        assert np.array_equal(f["a"], a)


@pytest.mark.parametrize(("arrays", "message"), [
    ([np.zeros((2, 2), np.uint16)], "shape"),
    ([np.zeros((2, 3), np.float32)], "cannot be stored as BF16"),
    ([], "no array given"),
    ([np.zeros((2, 3), np.uint16), np.zeros(1, np.uint16)], "more arrays"),
])
def test_the_streaming_writer_refuses_arrays_that_do_not_match_and_leaves_no_file(
        tmp_path: Path, arrays: list, message: str) -> None:
    out = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match=message):
        write_safetensors_stream(out, [("a", "BF16", (2, 3))], arrays)
    assert list(tmp_path.iterdir()) == []


def test_header_bytes_refuses_unknown_dtypes_and_repeated_names() -> None:
    with pytest.raises(TypeError, match="unknown safetensors dtype"):
        header_bytes([("a", "Q4", (1,))])
    with pytest.raises(ValueError, match="two tensors"):
        header_bytes([("a", "U8", (1,)), ("a", "U8", (1,))])


@pytest.mark.parametrize("mode", ["unweight", "rans"])
def test_decompress_streams_the_input_back_byte_for_byte(tmp_path: Path, mode: str) -> None:
    rng = np.random.default_rng(1)
    tensors = {"w": (rng.standard_normal((64, 128)) * 0.02).astype(np.float32).view(np.uint32) >> 16,
               "b": np.arange(7, dtype=np.float32)}
    tensors["w"] = tensors["w"].astype(np.uint16)
    src = tmp_path / "in.safetensors"
    write_safetensors(src, tensors, dtypes={"w": "BF16", "b": "F32"}, metadata={"k": "v"})
    packed, out = tmp_path / "c.safetensors", tmp_path / "out.safetensors"
    compress_checkpoint(str(src), packed, mode=mode, min_elements=16)
    assert decompress_checkpoint(packed, out) == 2
    assert out.read_bytes() == src.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors", "in.safetensors", "out.safetensors"]
