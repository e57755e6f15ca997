"""The C decoder of the rANS mode (fast/codec/native/rans_decode.c via decode_rans_cpu): bit-exact to
the reference decoder on any shape and parameters, every check of FORMAT.md 9.6 kept (damaged input:
CodecError or the exact original, whether or not the damaged array's CRC was recomputed), and the
NumPy fallback when there is no compiler. Damaged tensors are built without ``from_parts`` (which runs
every check in Python), so that what the C code checks is what is tested."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fast import cpu_isa
from fast.codec import decode_rans_c
from fast.codec.decode_rans_c import decode_rans_cpu, decode_rans_many
from reference.bf16 import float32_to_bf16
from reference.codec import RansTensor, decode_rans, encode_rans
from reference.codec.errors import CodecError
from reference.codec.format import crc32
from tests.codec_strategies import bf16_tensors
from tests.test_codec_rans import encode_or_refuse, rans_params
from tests.test_codec_rans_corruption import BASE, ROWS, TRAINED

HAS_C = decode_rans_c.library() is not None
needs_c = pytest.mark.skipif(not HAS_C, reason="no C compiler: the C rANS decoder is not built")
# the decoder's paths: the portable build, the AVX2 build with its AVX2 lanes, with the AVX-512 lanes
PATHS = ("portable", "avx2", "avx512")


@contextlib.contextmanager
def path(name: str) -> Iterator[str]:
    """Decode by one of PATHS where the CPU and UNFIRE_CPU_ISA allow it (else the best below it); yields the path
    that runs."""
    lib = decode_rans_c.library()
    wide = lib.unw_rans_use(int(name != "portable"))
    on512 = lib.unw_rans_use512(int(name == "avx512"))
    try:
        yield "avx512" if on512 else "avx2" if wide else "portable"
    finally:
        lib.unw_rans_use(1)
        lib.unw_rans_use512(1)


def lanes_of(runs: str, two_stages: bool) -> int:
    """What unw_rans_lanes_taken reports after a tensor of 32 lanes and p = 12 went through path ``runs``."""
    return {"portable": 0, "avx2": 1, "avx512": 4}[runs] << int(two_stages)


def _wide_case() -> np.ndarray:
    """40,000 weights for the AVX2 lanes' cases: trained-like rows, rows of a larger scale (a second table), rows
    of dequantized 4-bit blocks (low mantissa bits far from uniform: second-stage classes) and rare exponents
    (escapes)."""
    rng = np.random.default_rng(7)
    bits = float32_to_bf16((rng.standard_normal((40, 1000)) * 0.02).astype(np.float32))
    bits[25:] = float32_to_bf16((rng.standard_normal((15, 1000)) * 3.0).astype(np.float32))
    bits[5:12] = float32_to_bf16((rng.integers(-8, 9, (7, 1000)) * 2.0**-12).astype(np.float32))
    bits[3, 5:8] = [0x0001, 0x7FC1, 0x4F00]
    bits[30, 999] = 0x0002
    return bits


WIDE = _wide_case()
# 32 lanes and p = 12 (the AVX2 lanes' case), 9 blocks: four pairs and one alone, 140.6 steps per block (the
# last partial step in portable C), the last block shorter
WIDE_TWO = encode_rans(WIDE, block_size=4500, mantissa_bits=2, low_bits=5, context="block")
# the same with tables by context: the row (two stages) and the column (one stage), FORMAT.md 9.2
WIDE_ROWS = encode_rans(WIDE, block_size=4500, mantissa_bits=2, low_bits=5, context="row")
WIDE_COLUMNS = encode_rans(WIDE, block_size=4500, mantissa_bits=2, low_bits=0, context="column")
# damaged-input bases: (tensor, original)
DAMAGE_BASES = {"block": (BASE, TRAINED), "row": (ROWS, TRAINED), "wide": (WIDE_TWO, WIDE),
                "wide_rows": (WIDE_ROWS, WIDE), "wide_columns": (WIDE_COLUMNS, WIDE)}


@contextlib.contextmanager
def many_threads() -> Iterator[None]:
    """Let even tiny tensors be decoded by several threads (their taking of blocks and the CRC join)."""
    saved = decode_rans_c.MIN_WEIGHTS_PER_THREAD
    decode_rans_c.MIN_WEIGHTS_PER_THREAD = 1
    try:
        yield
    finally:
        decode_rans_c.MIN_WEIGHTS_PER_THREAD = saved


def with_arrays(t: RansTensor, arrays: dict[str, np.ndarray], fix_crc: bool) -> RansTensor:
    """t with some arrays replaced (their CRC recomputed if fix_crc), no check run."""
    crc = dict(t.crc) | ({k: crc32(a) for k, a in arrays.items()} if fix_crc else {})
    return dataclasses.replace(t, crc=crc, **arrays)


def decodes_exactly_or_raises(t: RansTensor, original: np.ndarray, threads: int = 1) -> None:
    try:
        with many_threads():
            out = decode_rans_cpu(t, threads=threads, native=True)
    except CodecError:
        return
    assert out.shape == original.shape and np.array_equal(out, original)


def flipped(t: RansTensor, key: str, where: int, bit: int) -> dict[str, np.ndarray]:
    a = np.array(getattr(t, key))
    raw = a.view(np.uint8).reshape(-1)
    raw[where % raw.size] ^= 1 << bit
    return {key: a}


@needs_c
@given(bits=bf16_tensors(), params=rans_params(), threads=st.sampled_from([1, 2, 3]), way=st.sampled_from(PATHS))
def test_c_rans_decoder_equals_reference_decoder(bits: np.ndarray, params: dict, threads: int, way: str) -> None:
    """Every path (portable, the AVX2 build's AVX2 lanes, its AVX-512 lanes, where the CPU has them), any shape and
    parameters."""
    t = encode_or_refuse(bits, params)
    if t is None:
        return
    with path(way), many_threads():
        got = decode_rans_cpu(t, threads=threads, native=True)
    assert got.dtype == np.uint16 and got.shape == bits.shape
    assert np.array_equal(got, decode_rans(t)) and np.array_equal(got, bits)


@needs_c
@given(st.sampled_from(list(DAMAGE_BASES)), st.data(), st.integers(0, 2**40), st.integers(0, 7),
       st.booleans(), st.sampled_from([1, 3]))
def test_flipped_bit_in_any_array(which: str, data: st.DataObject, where: int, bit: int, fix_crc: bool,
                                  threads: int) -> None:
    """Without ``fix_crc`` the array's CRC-32 must fail; with it, the other checks (index, lanes' end
    states, words and escapes per block, padding, data CRC) must catch it or the bits be exact. ``wide*``:
    tensors of 32 lanes and p = 12, which the AVX2 lanes decode where the CPU has them; tables by block or by
    context."""
    base, original = DAMAGE_BASES[which]
    key = data.draw(st.sampled_from([k for k, a in base.arrays().items() if a.size]))
    t = with_arrays(base, flipped(base, key, where, bit), fix_crc)
    if not fix_crc:
        with pytest.raises(CodecError, match="CRC|corrupt|must"), many_threads():
            decode_rans_cpu(t, threads=threads, native=True)
    decodes_exactly_or_raises(t, original, threads)


@needs_c
@given(st.sampled_from(list(DAMAGE_BASES)),
       st.sampled_from(["block_words", "block_escapes", "states", "tables", "block_table", "alphabet",
                        "symbol_class", "low_freqs", "context_table"]),
       st.integers(0, 10**6), st.integers(0, 2**32 - 1))
def test_out_of_range_entries_with_valid_crc(which: str, key: str, index: int, value: int) -> None:
    """Offsets and tables far out of range (CRC fixed): nothing read out of bounds, CodecError."""
    base, original = DAMAGE_BASES[which]
    a = np.array(getattr(base, key))
    flat = a.reshape(-1)
    if flat.size == 0:
        return
    flat[index % flat.size] = value % (np.iinfo(flat.dtype).max + 1)
    decodes_exactly_or_raises(with_arrays(base, {key: a}, fix_crc=True), original)


@needs_c
@given(bf16_tensors(max_elements=3000), rans_params(), st.data())
def test_fuzz_random_tensors_and_random_damage(bits: np.ndarray, params: dict, data: st.DataObject) -> None:
    t = encode_or_refuse(bits, params)
    if t is None:
        return
    nonempty = [k for k, a in t.arrays().items() if a.size]
    if nonempty:
        key = data.draw(st.sampled_from(nonempty))
        t = with_arrays(t, flipped(t, key, data.draw(st.integers(0, 2**40)), data.draw(st.integers(0, 7))),
                        fix_crc=data.draw(st.booleans()))
    decodes_exactly_or_raises(t, bits, data.draw(st.sampled_from([1, 2])))


@needs_c
def test_errors_name_the_problem() -> None:
    stream = np.array(BASE.stream)
    stream[5] ^= 0x0100
    with pytest.raises(CodecError, match="array stream fails its CRC-32"):
        decode_rans_cpu(with_arrays(BASE, {"stream": stream}, fix_crc=False), native=True)
    with pytest.raises(CodecError, match="rANS stream is corrupt: block 0"):
        decode_rans_cpu(with_arrays(BASE, {"stream": stream}, fix_crc=True), native=True)
    bad_data = dataclasses.replace(BASE, crc=BASE.crc | {"data": BASE.crc["data"] ^ 1})
    with pytest.raises(CodecError, match="decoded data fails its CRC-32"):
        decode_rans_cpu(bad_data, native=True)
    raw = np.array(BASE.raw)
    raw[-1] |= 0x80  # a padding field of the last group (TRAINED's 19,200 weights leave none: check first)
    if BASE.n % 4:
        with pytest.raises(CodecError, match="padding"):
            decode_rans_cpu(with_arrays(BASE, {"raw": raw}, fix_crc=True), native=True)


def test_numpy_fallback_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    assert np.array_equal(decode_rans_cpu(BASE, native=False), TRAINED)
    monkeypatch.setattr(decode_rans_c, "_state", {})
    monkeypatch.setenv("UNFIRE_NATIVE", "0")
    assert decode_rans_c.library() is None
    assert np.array_equal(decode_rans_cpu(BASE), TRAINED)
    with pytest.raises(CodecError, match="not available"):
        decode_rans_cpu(BASE, native=True)


@needs_c
@pytest.mark.parametrize("params", [
    # m + k = 7 (what the encoder picks): values, escapes and bf16 in one pass
    {"mantissa_bits": 2, "low_bits": 5, "context": "block"},
    # raw bits left besides the sign: the portable join after the AVX2 lanes
    {"mantissa_bits": 1, "low_bits": 3, "context": "block"},
    {"mantissa_bits": 2, "low_bits": 0, "context": "block"},  # one stage
    {},  # the encoder's choice
    {"mantissa_bits": 2, "low_bits": 5, "context": "row"},  # tables by context: the row's, two stages
    {"mantissa_bits": 2, "low_bits": 0, "context": "column"},  # the column's, one stage
    {"mantissa_bits": 1, "low_bits": 3, "context": "column", "max_tables": 16},
    {"mantissa_bits": 7, "low_bits": 0, "context": "block"},  # one stage, the raw bits the signs
    {"mantissa_bits": 3, "low_bits": 4, "context": "column"},  # two stages, m + k = 7, by column
    {"mantissa_bits": 2, "low_bits": 5, "context": "row", "shape": (2500, 16)},  # rows shorter than the 32 lanes
    # one stage, 140 symbols (the AVX-512 lanes' values from four word permutes) and 265 (gathered)
    {"mantissa_bits": 3, "low_bits": 0, "context": "column"},
    {"mantissa_bits": 4, "low_bits": 0, "context": "block"},
])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("block_size", [4500, 4504, 6000, 6004, 7008])
def test_wide_lanes_take_two_stage_tensors(params: dict, threads: int, block_size: int) -> None:
    """At 32 lanes and p = 12 two-stage tensors (and one-stage ones) go through the AVX2 or the AVX-512 lanes where
    the CPU and UNFIRE_CPU_ISA allow them (AVX2: blocks two at a time, an odd block alone; AVX-512: four at a time,
    the last two or three as a pair and one alone: 9 blocks of 4500, 7 of 6000 or 6004, 6 of 7008; partial steps
    in portable C), with the portable build's bits; the portable build and UNFIRE_CPU_ISA=scalar take none of
    them. Blocks of 4504, 6000 and 7008 weights start on a raw byte: with m + k = 7 the AVX-512 lanes write bf16
    themselves (escapes or-ed in after); blocks of 4500 and 6004 do not, and they store values for the join."""
    lib = decode_rans_c.library()
    params = dict(params)
    bits = WIDE.reshape(params.pop("shape", WIDE.shape))
    t = encode_rans(bits, block_size=block_size, **params)
    assert t.lanes == 32 and t.prob_bits == 12 and t.n_blocks == -(-WIDE.size // block_size) and t.n_escapes >= 4
    assert (t.context_period > 0) == (params.get("context", "block") != "block") or "context" not in params
    assert params.get("low_bits", 1) == 0 or t.low_bits > 0 and t.low_tables > 1
    got = {}
    for way in PATHS:
        with path(way) as runs, many_threads():
            lib.unw_rans_lanes_taken()
            got[way] = decode_rans_cpu(t, threads=threads, native=True)
            assert lib.unw_rans_lanes_taken() == lanes_of(runs, t.low_bits > 0)
            assert runs == way or way != "portable" and not cpu_isa.allows(way)  # (a cap or CPU below it)
    for way in PATHS:
        assert np.array_equal(got[way], bits), way
    assert np.array_equal(got["portable"], decode_rans(t))


SMALL = ("alphabet", "tables", "block_words", "states", "block_table", "block_escapes", "symbol_class", "low_freqs",
         "context_table")


@needs_c
@given(st.sampled_from(list(DAMAGE_BASES)), st.data(), st.integers(0, 2**40), st.integers(0, 7))
def test_index_checks_in_c_give_check_index_verdict(which: str, data: st.DataObject, where: int, bit: int) -> None:
    """The index checks run in C (unw_rans_check) refuse exactly what RansTensor.check_index refuses, with its
    message; a damaged small array (its CRC recomputed) that passes both decodes exactly or fails later."""
    base, original = DAMAGE_BASES[which]
    key = data.draw(st.sampled_from([k for k in SMALL if getattr(base, k).size]))
    t = with_arrays(base, flipped(base, key, where, bit), fix_crc=True)
    try:
        t.check_index()
        expected = None
    except CodecError as e:
        expected = str(e)
    if expected is None:
        decodes_exactly_or_raises(t, original)
        return
    with pytest.raises(CodecError) as got:
        decode_rans_cpu(t, native=True)
    assert str(got.value) == expected


@needs_c
def test_scalar_cap_takes_no_avx2_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    if "scalar" not in cpu_isa.supported():
        pytest.skip("no scalar level on this architecture")
    monkeypatch.setenv(cpu_isa.ENV, "scalar")
    lib = decode_rans_c.library()
    lib.unw_rans_lanes_taken()
    assert np.array_equal(decode_rans_cpu(WIDE_TWO, native=True), WIDE)
    assert lib.unw_rans_lanes_taken() == 0


@needs_c
@pytest.mark.parametrize("way", PATHS)
def test_decode_into_a_poisoned_buffer_and_many_into_one(way: str) -> None:
    """``out=``: every weight is written (the buffer starts as 0xFFFF, a NaN pattern in bf16), the returned array is
    that buffer; ``decode_rans_many``: each tensor a view of one buffer, the same bits as decoding it alone; a wrong
    ``out`` is refused naming the problem."""
    tensors = [WIDE_TWO, WIDE_ROWS, WIDE_COLUMNS, encode_rans(WIDE[:3, :77], mantissa_bits=4)]
    originals = [WIDE, WIDE, WIDE, WIDE[:3, :77]]
    with path(way):
        for t, original in zip(tensors, originals, strict=True):
            out = np.full(t.n, 0xFFFF, np.uint16)
            got = decode_rans_cpu(t, native=True, out=out)
            assert np.shares_memory(got, out) and got.shape == original.shape and np.array_equal(got, original)
        many = decode_rans_many(tensors)
    assert all(m.base is many[0].base and m.base is not None for m in many)  # views of one buffer
    for got, original in zip(many, originals, strict=True):
        assert np.array_equal(got, original)
    wrong = (np.zeros(WIDE.size, np.int16), np.zeros(WIDE.size + 1, np.uint16),
             np.zeros((WIDE.size, 2), np.uint16)[:, 0])  # dtype, size, not contiguous
    for bad in wrong:
        with pytest.raises(ValueError, match="out must be a writeable contiguous uint16 array"):
            decode_rans_cpu(WIDE_TWO, native=True, out=bad)
