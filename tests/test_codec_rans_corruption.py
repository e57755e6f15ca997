"""Corrupt, truncated and malformed rANS-form tensors: always CodecError, never a hang, never wrong data.

The same property as for the Unweight mode: decoding damaged input either raises CodecError or
returns exactly the original tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.bf16 import float32_to_bf16
from reference.codec import RansTensor, decode_rans, encode_rans
from reference.codec.errors import CodecError
from reference.codec.format import crc32
from tests.codec_strategies import JUNK, bf16_tensors, tampered_header
from tests.test_codec_rans import encode_or_refuse, rans_params

rng = np.random.default_rng(7)
TRAINED = float32_to_bf16((rng.standard_normal((96, 200)) * 0.02).astype(np.float32))
TRAINED[50:] = float32_to_bf16((rng.standard_normal((46, 200)) * 3.0).astype(np.float32))  # a second table
TRAINED[3, 5:8] = [0x0001, 0x7FC1, 0x4F00]  # rare exponents: escapes
# small values on a coarse grid (as in dequantized weights): their low mantissa bits are 0, worth a class
TRAINED[10:20] = float32_to_bf16((rng.integers(-8, 9, (10, 200)) * 2.0**-12).astype(np.float32))
# two stages: every array of the form is in use; tables by block, and by context (the row, then the column)
BASE = encode_rans(TRAINED, block_size=3000, lanes=8, max_tables=4, mantissa_bits=2, low_bits=5, context="block")
ROWS = encode_rans(TRAINED, block_size=3000, lanes=8, max_tables=4, mantissa_bits=2, low_bits=5, context="row")
TRANSPOSED = np.ascontiguousarray(TRAINED.T)  # columns of two scales
COLUMNS = encode_rans(TRANSPOSED, block_size=3000, lanes=32, max_tables=4, context="column")
BASES = {"block": BASE, "row": ROWS, "column": COLUMNS}
ORIGINALS = {"block": TRAINED, "row": TRAINED, "column": TRANSPOSED}
ARRAYS = list(BASE.arrays())


def test_base_uses_every_feature() -> None:
    assert BASE.n_tables > 1 and BASE.n_escapes >= 3 and BASE.n_blocks > 1 and BASE.n % BASE.block_size
    assert len(set(BASE.block_table.tolist())) > 1
    assert BASE.low_bits == 5 and BASE.low_tables > 1 and len(set(BASE.symbol_class.tolist())) > 1
    assert ROWS.context_period == 96 and ROWS.context_stride == 200 and len(set(ROWS.context_table.tolist())) > 1
    assert ROWS.low_bits == 5 and len(ROWS.block_table) == 0
    assert COLUMNS.context_period == 96 and COLUMNS.context_stride == 1 and COLUMNS.n_tables > 1


def decodes_exactly_or_raises(header: object, arrays: dict[str, np.ndarray], original: np.ndarray) -> None:
    try:
        out = decode_rans(RansTensor.from_parts(header, arrays))  # type: ignore[arg-type]
    except CodecError:
        return
    assert out.shape == original.shape and np.array_equal(out, original)


def damaged(base: RansTensor, key: str, where: int, bit: int) -> dict[str, np.ndarray]:
    arrays = {k: np.array(v) for k, v in base.arrays().items()}
    raw = arrays[key].view(np.uint8).reshape(-1)
    if raw.size:
        raw[where % raw.size] ^= 1 << bit
    return arrays


@pytest.mark.parametrize("which", BASES)
@given(st.sampled_from(ARRAYS), st.integers(0, 2**40), st.integers(0, 7))
def test_flipped_bit_in_any_array_is_caught(which: str, key: str, where: int, bit: int) -> None:
    base = BASES[which]
    if base.arrays()[key].size == 0:
        return
    with pytest.raises(CodecError, match="CRC|corrupt|must|bits"):
        decode_rans(RansTensor.from_parts(base.header(), damaged(base, key, where, bit)))


@pytest.mark.parametrize("which", BASES)
@given(st.sampled_from(ARRAYS), st.integers(0, 2**40), st.integers(0, 7))
def test_flipped_bit_with_recomputed_array_crc_is_still_caught(which: str, key: str, where: int, bit: int) -> None:
    """Defeat the array CRC: the structural checks, the lanes' end states and the data CRC still catch it."""
    base = BASES[which]
    if base.arrays()[key].size == 0:
        return
    arrays = damaged(base, key, where, bit)
    header = base.header()
    header["crc32"][key] = crc32(arrays[key])
    with pytest.raises(CodecError):
        decode_rans(RansTensor.from_parts(header, arrays))


@pytest.mark.parametrize("which", BASES)
@given(st.sampled_from([*BASE.header(), "crc32.raw", "crc32.data", "crc32.context_table", "extra"]), JUNK)
def test_tampered_header_field(which: str, key: str, value: object) -> None:
    base = BASES[which]
    decodes_exactly_or_raises(tampered_header(base.header(), key, value), base.arrays(), ORIGINALS[which])


@pytest.mark.parametrize("which", BASES)
@given(st.sampled_from(["block_words", "block_escapes", "states", "tables", "block_table", "alphabet",
                        "symbol_class", "low_freqs", "context_table"]),
       st.integers(0, 10**6), st.integers(0, 2**32 - 1))
def test_out_of_range_entries_with_valid_crc(which: str, key: str, index: int, value: int) -> None:
    base = BASES[which]
    arrays = {k: np.array(v) for k, v in base.arrays().items()}
    flat = arrays[key].reshape(-1)
    if flat.size == 0:  # (block_table by context, context_table by block)
        return
    flat[index % flat.size] = value % (np.iinfo(flat.dtype).max + 1)
    header = base.header()
    header["crc32"][key] = crc32(arrays[key])
    decodes_exactly_or_raises(header, arrays, ORIGINALS[which])


@pytest.mark.parametrize("which", BASES)
@given(st.sampled_from(["shape", "block_size", "lanes", "prob_bits", "mantissa_bits", "alphabet_size", "n_tables",
                        "stream_words", "n_escapes", "low_bits", "low_tables", "context_stride",
                        "context_period"]), st.integers(-2, 70000))
def test_other_sizes_in_the_header(which: str, key: str, value: int) -> None:
    base = BASES[which]
    header = base.header()
    header[key] = [value, 200] if key == "shape" else value
    original = ORIGINALS[which]
    if key == "shape" and value * 200 == original.size:
        # another shape of as many weights decodes to the same bits: the tensor's form cannot see it, the
        # container's header CRC refuses it (FORMAT.md 6.1; tests/test_codec_header_tamper.py)
        original = original.reshape(value, 200)
    decodes_exactly_or_raises(header, base.arrays(), original)


@pytest.mark.parametrize("which", BASES)
@given(st.sampled_from(ARRAYS), st.integers(0, 10**6), st.booleans())
def test_truncated_arrays(which: str, key: str, keep: int, flat: bool) -> None:
    base = BASES[which]
    arrays = dict(base.arrays())
    a = arrays[key].reshape(-1) if flat else arrays[key]
    arrays[key] = a[: keep % len(a)] if len(a) else a[:0]
    if arrays[key].shape == base.arrays()[key].shape:
        return
    with pytest.raises(CodecError):
        RansTensor.from_parts(base.header(), arrays)


def test_huge_shapes_are_rejected() -> None:
    empty = encode_rans(np.zeros((0,), np.uint16))
    for base in (BASE, empty):
        for shape in ([2**32, 2**32], [2**62, 4], [0, 2**70], [0, 2**40, 2**40], [0] * 40):
            with pytest.raises(CodecError):
                decode_rans(RansTensor.from_parts(base.header() | {"shape": shape}, base.arrays()))


def test_wrong_types_of_arrays_are_rejected() -> None:
    for key in ARRAYS:
        arrays = dict(BASE.arrays())
        arrays[key] = np.array(3.5)  # 0-D, wrong dtype
        with pytest.raises(CodecError, match=key):
            RansTensor.from_parts(BASE.header(), arrays)


@given(bf16_tensors(max_elements=3000), rans_params(), st.data())
def test_fuzz_random_tensors_and_random_damage(bits: np.ndarray, params: dict, data: st.DataObject) -> None:
    t = encode_or_refuse(bits, params)
    if t is None:
        return
    header, arrays = t.header(), {k: np.array(v) for k, v in t.arrays().items()}
    nonempty = [k for k in arrays if arrays[k].size]
    key = data.draw(st.sampled_from(nonempty)) if nonempty else None
    if key is not None:
        raw = arrays[key].view(np.uint8).reshape(-1)
        raw[data.draw(st.integers(0, raw.size - 1))] ^= 1 << data.draw(st.integers(0, 7))
        if data.draw(st.booleans()):
            header["crc32"][key] = crc32(arrays[key])  # also defeat the array checksum
    decodes_exactly_or_raises(header, arrays, bits)


def test_wrong_version_form_and_format_are_named() -> None:
    for key, value in [("version", 2), ("format", "zip"), ("form", "huffman")]:
        with pytest.raises(CodecError, match=key):
            RansTensor.from_parts(BASE.header() | {key: value}, BASE.arrays())
