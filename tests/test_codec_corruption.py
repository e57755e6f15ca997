"""Corrupt, truncated and malformed compressed tensors: always CodecError, never a hang, never wrong data.

The property in every test: decoding damaged input either raises CodecError or returns exactly the
original tensor (a mutation that changes nothing the data depends on is allowed to pass).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.codec import CompressedTensor, decode, encode, to_palette
from reference.codec.errors import CodecError
from reference.codec.format import crc32
from tests.codec_strategies import JUNK, bf16_tensors, codec_params, tampered_header

rng = np.random.default_rng(7)
TRAINED = (rng.standard_normal((96, 200)) * 0.02).astype(np.float32).view(np.uint32) >> 16
TRAINED = TRAINED.astype(np.uint16)
TRAINED[3, 5] = 0x0001  # a subnormal: an out-of-palette exponent, so there is a verbatim chunk
BASE = encode(TRAINED, chunks_per_group=4)
ARRAYS = list(BASE.arrays())


def decodes_exactly_or_raises(header: object, arrays: dict[str, np.ndarray], original: np.ndarray) -> None:
    try:
        ct = CompressedTensor.from_parts(header, arrays)  # type: ignore[arg-type]
        out = decode(ct)
        pal = to_palette(ct) if len(ct.palette) <= 16 else None
    except CodecError:
        return
    assert out.shape == original.shape and np.array_equal(out, original)
    assert pal is None or pal.sm.size == original.size


@given(st.sampled_from(ARRAYS), st.integers(0, 2**40), st.integers(0, 7))
def test_flipped_bit_in_any_array_is_caught(key: str, where: int, bit: int) -> None:
    arrays = {k: np.array(v) for k, v in BASE.arrays().items()}
    raw = arrays[key].view(np.uint8).reshape(-1)
    if raw.size == 0:
        return
    raw[where % raw.size] ^= 1 << bit
    with pytest.raises(CodecError, match="CRC|corrupt|must|bits"):
        decode(CompressedTensor.from_parts(BASE.header(), arrays))


@given(st.sampled_from(ARRAYS), st.integers(0, 2**40), st.integers(0, 7))
def test_flipped_bit_with_recomputed_array_crc_is_still_caught(key: str, where: int, bit: int) -> None:
    """Defeat the array CRC: the structural checks and the data CRC must still catch it."""
    arrays = {k: np.array(v) for k, v in BASE.arrays().items()}
    raw = arrays[key].view(np.uint8).reshape(-1)
    if raw.size == 0:
        return
    raw[where % raw.size] ^= 1 << bit
    header = BASE.header()
    header["crc32"][key] = crc32(arrays[key])
    with pytest.raises(CodecError):
        decode(CompressedTensor.from_parts(header, arrays))


@given(st.sampled_from([*BASE.header(), "crc32.sm", "crc32.data", "extra"]), JUNK)
def test_tampered_header_field(key: str, value: object) -> None:
    decodes_exactly_or_raises(tampered_header(BASE.header(), key, value), BASE.arrays(), TRAINED)


@given(st.sampled_from(["palette", "code_lengths", "offsets", "vchunks", "shape"]), st.integers(0, 100),
       st.integers(-2, 2**32 + 2))
def test_out_of_range_entries(key: str, index: int, value: int) -> None:
    header, arrays = copy.deepcopy(BASE.header()), {k: np.array(v) for k, v in BASE.arrays().items()}
    if key in arrays:
        if arrays[key].size == 0 or not 0 <= value < 2**32:
            return
        arrays[key][index % arrays[key].size] = value
        header["crc32"][key] = crc32(arrays[key])
    else:
        header[key][index % len(header[key])] = value
    decodes_exactly_or_raises(header, arrays, TRAINED)


@given(st.sampled_from(ARRAYS), st.integers(0, 10**6), st.booleans())
def test_truncated_arrays(key: str, keep: int, flat: bool) -> None:
    arrays = dict(BASE.arrays())
    a = arrays[key].reshape(-1) if flat else arrays[key]
    arrays[key] = a[: keep % len(a)] if len(a) else a[:0]
    if arrays[key].shape == BASE.arrays()[key].shape:
        return
    with pytest.raises(CodecError):
        CompressedTensor.from_parts(BASE.header(), arrays)


@given(bf16_tensors(max_elements=3000), codec_params(), st.data())
def test_fuzz_random_tensors_and_random_damage(bits: np.ndarray, params: dict, data: st.DataObject) -> None:
    ct = encode(bits, **params)
    header, arrays = ct.header(), {k: np.array(v) for k, v in ct.arrays().items()}
    key = data.draw(st.sampled_from([k for k in arrays if arrays[k].size]) if bits.size else st.just("sm"))
    if arrays[key].size:
        raw = arrays[key].view(np.uint8).reshape(-1)
        raw[data.draw(st.integers(0, raw.size - 1))] ^= 1 << data.draw(st.integers(0, 7))
        if data.draw(st.booleans()):
            header["crc32"][key] = crc32(arrays[key])  # also defeat the array checksum
    decodes_exactly_or_raises(header, arrays, bits)


def test_wrong_version_and_form_are_named() -> None:
    for key, value, words in [("version", 2, "version"), ("format", "zip", "unweight"), ("form", "palette", "form")]:
        header = BASE.header() | {key: value}
        with pytest.raises(CodecError, match=words):
            CompressedTensor.from_parts(header, BASE.arrays())


@pytest.mark.parametrize("shape", [[0, 2**70], [2**40, 2**40], [-1, 3]])
def test_absurd_header_shapes_are_codec_errors(shape: list[int]) -> None:
    """Dimensions beyond 2^48 (even in an empty tensor) must not overflow inside NumPy."""
    ct = encode(np.zeros((0, 3), dtype=np.uint16))
    header = ct.header()
    header["shape"] = shape
    with pytest.raises(CodecError, match="shape"):
        CompressedTensor.from_parts(header, ct.arrays())
