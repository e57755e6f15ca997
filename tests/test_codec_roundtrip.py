"""Bit-exact round trips: every bf16 pattern, hypothesis-drawn tensors, the palette form, transcode."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.codec import (
    CompressedTensor,
    decode,
    decode_many,
    encode,
    from_palette,
    palette_to_bf16,
    to_palette,
)
from reference.codec.bitstream import pack_codes
from reference.codec.errors import CodecError
from reference.codec.format import crc32
from tests.codec_strategies import bf16_tensors, codec_params

ALL_PATTERNS = np.arange(65536, dtype=np.uint16)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.uint16 and a.shape == b.shape and np.array_equal(a, b)


@pytest.mark.parametrize("params", [
    {}, {"chunk_size": 1}, {"palette_size": 256, "max_code_length": 16}, {"palette_size": 1},
    {"chunk_size": 100, "chunks_per_group": 3}, {"palette_size": 8, "max_code_length": 4},
])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_every_bf16_pattern_survives(params: dict, order: str) -> None:
    bits = ALL_PATTERNS if order == "sorted" else np.random.default_rng(1).permutation(ALL_PATTERNS)
    for shape in [(65536,), (256, 256), (128, 512), (1, 65536)]:
        ct = encode(bits.reshape(shape), **params)
        assert same_bits(decode(ct), bits.reshape(shape))


@given(bf16_tensors(), codec_params())
def test_random_tensors_round_trip(bits: np.ndarray, params: dict) -> None:
    ct = encode(bits, **params)
    assert same_bits(decode(ct), bits)
    rebuilt = CompressedTensor.from_parts(ct.header(), ct.arrays())  # what the container does
    assert same_bits(decode(rebuilt), bits)


@given(bf16_tensors(), codec_params())
def test_palette_form_and_transcode(bits: np.ndarray, params: dict) -> None:
    params["palette_size"] = min(params["palette_size"], 16)
    params["max_code_length"] = max(params["max_code_length"], 4)
    ct = encode(bits, **params)
    pt = to_palette(ct)
    assert same_bits(palette_to_bf16(pt), bits)
    back = from_palette(pt, chunks_per_group=params["chunks_per_group"], max_code_length=params["max_code_length"])
    assert back.header() == ct.header()
    for key, array in ct.arrays().items():
        assert np.array_equal(back.arrays()[key], array), key


@given(bf16_tensors(), codec_params())
def test_lockstep_decoder_equals_plain_decoder(bits: np.ndarray, params: dict) -> None:
    """decode_many (the lockstep NumPy decoder) is an optimisation of decode (FORMAT.md 3.5 line by line)."""
    ct = encode(bits, **params)
    assert same_bits(decode_many([ct])[0], decode(ct))


@given(bf16_tensors(), codec_params(), st.integers(0, 2**40), st.integers(0, 31))
def test_lockstep_and_plain_decoders_reject_the_same_damaged_streams(bits: np.ndarray, params: dict, where: int,
                                                                    bit: int) -> None:
    """A flipped stream bit (array CRC recomputed, so only decoding can tell): both decoders agree."""
    ct = encode(bits, **params)
    if ct.stream_bits == 0:
        return
    ct.stream = ct.stream.copy()
    ct.stream[(where % ct.stream_bits) // 32] ^= np.uint32(1 << bit)
    ct.crc["stream"] = crc32(ct.stream)
    outcomes = []
    for decoder in (decode, lambda c: decode_many([c])[0]):
        try:
            outcomes.append(same_bits(decoder(ct), bits))
        except CodecError:
            outcomes.append("CodecError")
    assert outcomes[0] == outcomes[1] and outcomes[0] in (True, "CodecError")


def test_decode_many_equals_decode_one_by_one() -> None:
    rng = np.random.default_rng(0)
    tensors = [rng.integers(0, 65536, (n, 70)).astype(np.uint16) for n in (0, 1, 5, 300)]
    tensors += [np.full((40, 64), 0x3F80, np.uint16), ALL_PATTERNS[:10_000]]
    cts = [encode(t, max_code_length=m) for t, m in zip(tensors, [12, 9, 16, 12, 5, 14], strict=True)]
    for got, want in zip(decode_many(cts), tensors, strict=True):
        assert same_bits(got, want)


def test_edge_shapes_and_values() -> None:
    for bits in [np.zeros((0,), np.uint16), np.zeros((3, 0, 2), np.uint16), np.array(0xFFC1, np.uint16),
                 np.full((7, 65), 0x8000, np.uint16), np.full(1000, 0x7FC3, np.uint16)]:
        assert same_bits(decode(encode(bits)), bits)


def test_worst_case_every_chunk_verbatim() -> None:
    bits = ((np.arange(64 * 256) % 256) << 7).astype(np.uint16).reshape(256, 64)  # 256 exponents per chunk
    ct = encode(bits)
    assert ct.n_verbatim == 256 and ct.stream_bits == 0
    assert ct.nbytes >= bits.nbytes  # nothing to gain, and it says so honestly
    assert same_bits(decode(ct), bits)


def test_single_value_costs_one_bit_per_weight() -> None:
    ct = encode(np.full((64, 64), 0x3C00, np.uint16))
    assert ct.code_lengths == (1,) and ct.stream_bits == 64 * 64


def test_palette_rule_and_verbatim_rule() -> None:
    # exponents: 17 distinct; 127 most frequent, then ties broken by value; exponent 200 appears once
    exps = np.array([127] * 300 + [e for e in range(100, 116) for _ in range(10)] + [200], np.uint16)
    bits = (exps << 7).reshape(1, -1)
    ct = encode(bits)
    assert ct.palette == (127, *range(100, 115))
    # 115 and 200 fall outside: the chunks holding them are verbatim
    cols = np.flatnonzero((exps == 115) | (exps == 200))
    assert ct.vchunks.tolist() == sorted(set((cols // 64).tolist()))


def test_palette_form_layout() -> None:
    bits = ((np.arange(2 * 130) % 3 + 120) << 7).astype(np.uint16).reshape(2, 130)
    bits[1, 70] = 5 << 7  # exponent 5 is outside a 3-entry palette: chunk 1 of row 1 is verbatim
    pt = to_palette(encode(bits, palette_size=3))
    assert pt.idx.shape == (2, 65) and pt.sm.shape == (2, 130)
    nib = lambda r, c: (pt.idx[r, c >> 1] >> (4 * (c & 1))) & 0xF  # noqa: E731
    assert pt.palette[nib(0, 0)] == 120 and pt.palette[nib(0, 1)] == 121 and pt.palette[nib(0, 2)] == 122
    assert pt.vchunks.tolist() == [4] and pt.row_vstart.tolist() == [0, 0, 1]  # 3 chunks per row
    assert all(nib(1, c) == 0 for c in range(64, 128))
    assert pt.vexp[0, 70 - 64] == 5


def test_bit_order_example_from_the_spec() -> None:
    acc = np.zeros(2, np.uint64)  # codes 1, 01, 0 -> 0xA0000000 (FORMAT.md 3.4)
    pack_codes(acc, np.array([1, 1, 0]), np.array([1, 2, 1]), np.array([0, 1, 3]))
    assert acc.astype(np.uint32).tolist() == [0xA0000000, 0]


def test_bad_inputs_raise_codec_error() -> None:
    with pytest.raises(CodecError):
        encode(np.zeros(10, np.float32))
    with pytest.raises(CodecError):
        encode(np.zeros(10, np.uint16), chunk_size=0)
    with pytest.raises(CodecError):
        encode(np.zeros(10, np.uint16), palette_size=32, max_code_length=4)
    with pytest.raises(CodecError):
        to_palette(encode(ALL_PATTERNS, palette_size=32))
    with pytest.raises(CodecError):
        encode(ALL_PATTERNS, chunk_size=4096, chunks_per_group=32)  # groups of more than 64 Ki weights
