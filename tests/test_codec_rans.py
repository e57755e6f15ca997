"""The rANS mode (FORMAT.md section 9): bit-exact round trips, the spec's scalar decoder, the pieces.

The same round-trip bar as the Unweight mode: every bf16 pattern, hypothesis-drawn tensors and
parameters, edge shapes. ``scalar_decode`` is section 9.4 written out as a plain loop, one lane
at a time, as a GPU thread would run it: the lockstep NumPy decoder must agree with it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.bf16 import float32_to_bf16
from reference.codec import RansTensor, decode_rans, decode_rans_many, encode, encode_rans, encode_rans_many
from reference.codec.errors import CodecError
from reference.codec.rans import tensor_block_size
from reference.codec.rans.coder import quantize, slot_tables
from reference.codec.rans.model import context_of, decode_charge, pack_fields, unpack_fields
from tests.codec_strategies import bf16_tensors

ALL_PATTERNS = np.arange(65536, dtype=np.uint16)


@st.composite
def rans_params(draw: st.DrawFn) -> dict:
    prob_bits = draw(st.sampled_from([1, 4, 9, 12, 12, 15]))
    coding = draw(st.sampled_from(["auto", "one", "two"]))  # chosen per tensor, one stage or two given
    mantissa_bits = draw(st.integers(0, 7))
    # (2^k low values fit 2^prob_bits slots)
    low_bits = draw(st.integers(0, min(7 - mantissa_bits, prob_bits))) if coding == "two" else 0
    return {
        "block_size": draw(st.sampled_from([1, 7, 64, 1000, 65536])),
        "lanes": draw(st.sampled_from([1, 3, 32, 32])),
        "prob_bits": prob_bits,
        **({} if coding == "auto" else {"mantissa_bits": mantissa_bits, "low_bits": low_bits}),
        "max_tables": draw(st.sampled_from([1, 4, 16])),
        "escapes": prob_bits < 15 or draw(st.booleans()),  # without escapes every value needs a slot
        # what chooses the first-stage tables: chosen per tensor, or given (FORMAT.md 9.2)
        "context": draw(st.sampled_from([None, None, "block", "column", "row"])),
    }


def encode_or_refuse(bits: np.ndarray, params: dict) -> RansTensor | None:
    """encode_rans(bits, **params), or None where a given context does not apply to the shape (it must refuse)."""
    if params.get("context") in ("column", "row") and context_of(bits.shape, params["context"]) is None:
        with pytest.raises(CodecError):
            encode_rans(bits, **params)
        return None
    return encode_rans(bits, **params)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.uint16 and a.shape == b.shape and np.array_equal(a, b)


def trained(shape: tuple[int, ...], seed: int = 0, scale: float = 0.02) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return float32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


@pytest.mark.parametrize("params", [
    {}, {"mantissa_bits": 0}, {"mantissa_bits": 7}, {"block_size": 1000, "lanes": 7}, {"prob_bits": 9},
    {"escapes": False, "prob_bits": 15, "mantissa_bits": 0}, {"lanes": 1, "block_size": 4096}, {"prob_bits": 1},
    {"mantissa_bits": 2, "low_bits": 5}, {"mantissa_bits": 0, "low_bits": 7, "lanes": 7, "block_size": 1000},
    {"mantissa_bits": 3, "low_bits": 2, "prob_bits": 9},
])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_every_bf16_pattern_survives(params: dict, order: str) -> None:
    bits = ALL_PATTERNS if order == "sorted" else np.random.default_rng(1).permutation(ALL_PATTERNS)
    for shape in [(65536,), (256, 256)]:
        t = encode_rans(bits.reshape(shape), **params)
        assert same_bits(decode_rans(t), bits.reshape(shape))


@given(bf16_tensors(), rans_params())
def test_random_tensors_round_trip(bits: np.ndarray, params: dict) -> None:
    t = encode_or_refuse(bits, params)
    if t is None:
        return
    if params["context"] in ("column", "row"):
        assert t.context_period > 0 and len(t.block_table) == 0
    rebuilt = RansTensor.from_parts(t.header(), t.arrays())  # what the container does
    assert same_bits(decode_rans(rebuilt), bits)


@given(st.lists(bf16_tensors(max_elements=2000), min_size=1, max_size=4), rans_params())
def test_many_tensors_in_one_pass(tensors: list[np.ndarray], params: dict) -> None:
    if params["context"] in ("column", "row"):
        params = {**params, "context": None}  # (chosen per tensor: a batch mixes contexts and blocks)
    batch = encode_rans_many(tensors, **params)
    alone = [encode_rans(b, **params) for b in tensors]
    for t, u in zip(batch, alone, strict=True):  # batching changes nothing in the bytes
        assert t.header() == u.header() and all(np.array_equal(t.arrays()[k], u.arrays()[k]) for k in t.arrays())
    mixed = batch + [encode_rans(tensors[0], lanes=5, prob_bits=11)]  # two lockstep passes (lanes, prob_bits)
    for got, want in zip(decode_rans_many(mixed), [*tensors, tensors[0]], strict=True):
        assert same_bits(got, want)


def test_edge_shapes_and_values() -> None:
    for bits in [np.zeros((0,), np.uint16), np.zeros((3, 0, 2), np.uint16), np.array(0xFFC1, np.uint16),
                 np.full((7, 65), 0x8000, np.uint16), np.full(1000, 0x7FC3, np.uint16)]:
        assert same_bits(decode_rans(encode_rans(bits)), bits)


def scalar_decode(t: RansTensor) -> np.ndarray:
    """FORMAT.md 9.4 as plain loops: block by block, step by step, lane by lane (the GPU's view)."""
    m, values, lows = 1 << t.prob_bits, [], []
    alphabet = [int(v) for v in t.alphabet]
    raw, _ = unpack_fields(t.raw, t.raw_bits, t.n)

    def symbol_of(freq: list[int], slot: int) -> tuple[int, int]:  # (s, c[s]) with c[s] <= slot < c[s] + f[s]
        c = 0
        for s, f in enumerate(freq):
            if c <= slot < c + f:
                return s, c
            c += f
        raise AssertionError("tables sum to M")

    def refill(x: int, pos: int) -> tuple[int, int]:
        return ((x << 16) | int(t.stream[pos]), pos + 1) if x < 1 << 16 else (x, pos)

    escapes, _ = unpack_fields(t.escapes, 8 + t.mantissa_bits, t.n_escapes)
    def table(i: int) -> list[int]:  # the first-stage table of weight i (FORMAT.md 9.2)
        k = t.context_table[(i // t.context_stride) % t.context_period] if t.context_period else t.block_table[
            i // t.block_size]
        return [int(f) for f in t.tables[k]]

    for b in range(t.n_blocks):
        x = [int(s) for s in t.states[b]]
        pos, esc = int(t.block_words[b]), int(t.block_escapes[b])
        length = min(t.block_size, t.n - b * t.block_size)
        for step in range(-(-length // t.lanes)):
            lanes = range(min(t.lanes, length - step * t.lanes))
            first = []
            for lane in lanes:  # lanes in order: reads in lane order
                freq = table(b * t.block_size + step * t.lanes + lane)
                s, c = symbol_of(freq, x[lane] % m)
                x[lane], pos = refill(freq[s] * (x[lane] >> t.prob_bits) + x[lane] % m - c, pos)
                first.append(s)
                if s == len(alphabet):  # the escape: the next value of the block's escapes
                    values.append(int(escapes[esc]))
                    esc += 1
                else:
                    values.append(alphabet[s])
            for lane in lanes if t.low_bits else ():  # the second stage: another pass over the lanes
                g = [int(f) for f in t.low_freqs[t.symbol_class[first[lane]]]]
                u, d = symbol_of(g, x[lane] % m)
                x[lane], pos = refill(g[u] * (x[lane] >> t.prob_bits) + x[lane] % m - d, pos)
                lows.append(u)
        assert pos == t.block_words[b + 1] and esc == t.block_escapes[b + 1] and all(s == 1 << 16 for s in x)
    low, q = 7 - t.mantissa_bits, 7 - t.mantissa_bits - t.low_bits
    v, r = np.array(values, np.int64), raw.astype(np.int64)
    u = np.array(lows, np.int64) if t.low_bits else 0
    return ((r >> q) << 15 | v << low | u << q | (r & ((1 << q) - 1))).astype(np.uint16).reshape(t.shape)


@pytest.mark.parametrize("params", [{"block_size": 300, "lanes": 4}, {"block_size": 1000, "lanes": 32, "prob_bits": 6},
                                    {"block_size": 64, "lanes": 5, "mantissa_bits": 4, "max_tables": 4},
                                    {"block_size": 300, "lanes": 4, "mantissa_bits": 2, "low_bits": 5},
                                    {"block_size": 64, "lanes": 5, "mantissa_bits": 1, "low_bits": 3},
                                    {"block_size": 300, "lanes": 4, "context": "column"},
                                    {"block_size": 1000, "lanes": 32, "prob_bits": 9, "context": "row"},
                                    {"block_size": 64, "lanes": 5, "mantissa_bits": 1, "low_bits": 3, "context": "row"},
                                    {"block_size": 1000, "lanes": 32, "mantissa_bits": 2, "low_bits": 5,
                                     "context": "column"}])
def test_lockstep_decoder_matches_the_spec_loop(params: dict) -> None:
    bits = trained((37, 61), seed=2)
    bits[3, :7] = [0x0001, 0x7F80, 0xFFC1, 0x8000, 0x0040, 0x4700, 0x3000]  # rare exponents: escapes
    bits[20:, :] = trained((17, 61), seed=3, scale=2.0)  # another scale: worth a second table
    t = encode_rans(bits, **params)
    assert t.n_escapes > 0
    assert same_bits(scalar_decode(t), bits) and same_bits(decode_rans(t), bits)


def test_smaller_than_the_unweight_mode_on_trained_weights() -> None:
    bits = trained((512, 1024))
    t, u = encode_rans(bits), encode(bits)
    assert t.nbytes < u.nbytes < bits.nbytes
    assert 8 * t.nbytes / bits.size < 8 + 2.6  # below 8 + H bits per weight here (H ~ 2.7 bits for N(0, 0.02))


def test_clustered_tables_follow_local_statistics() -> None:
    bits = np.concatenate([trained((64, 1024), seed=4, scale=1e-3), trained((64, 1024), seed=5, scale=1.0)])
    one, several = encode_rans(bits, max_tables=1), encode_rans(bits)
    assert several.n_tables == 2 and several.nbytes < 0.95 * one.nbytes


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=300), st.integers(1, 15))
def test_quantized_frequencies(counts: list[int], prob_bits: int) -> None:
    counts = np.array(counts)
    if np.count_nonzero(counts) > 1 << prob_bits:
        with pytest.raises(CodecError):
            quantize(counts, prob_bits)
        return
    f = quantize(counts, prob_bits)
    assert f.sum() == (1 << prob_bits if counts.any() else 0)
    assert np.all((f > 0) == (counts > 0))


@given(st.integers(1, 16), st.integers(0, 200), st.integers(0, 2**32 - 1))
def test_packed_fields(width: int, n: int, seed: int) -> None:
    fields = np.random.default_rng(seed).integers(0, 1 << width, n)
    packed = pack_fields(fields, width)
    back, padding_zero = unpack_fields(packed, width, n)
    assert padding_zero and np.array_equal(back, fields)
    bit_string = "".join(format(int(b), "08b")[::-1] for b in packed)  # LSB first, byte after byte
    assert bit_string.startswith("".join(format(int(f), f"0{width}b")[::-1] for f in fields))
    assert len(packed) == math.lcm(width, 8) // 8 * -(-n // (math.lcm(width, 8) // width))


def test_bad_parameters_raise_codec_error() -> None:
    for params in [{"block_size": 0}, {"lanes": 0}, {"prob_bits": 16}, {"mantissa_bits": 8}, {"max_tables": 0},
                   {"block_size": 65537, "lanes": 1}]:
        with pytest.raises(CodecError):
            encode_rans(np.zeros(10, np.uint16), **params)
    with pytest.raises(CodecError):
        encode_rans(np.zeros(10, np.float32))
    with pytest.raises(CodecError):
        encode_rans(ALL_PATTERNS, escapes=False, prob_bits=8)  # 256 exponents need more than 255 slots


def test_worked_examples_from_the_spec() -> None:
    assert pack_fields(np.array([1, 2, 3]), 6).tolist() == [0x81, 0x30, 0x00]  # FORMAT.md 9.1
    table = slot_tables(np.array([[3, 1]]), np.array([[5, 0xFFFF]]), 2)  # FORMAT.md 9.4: p = 2, f = (3, 1)
    x = 0x0001_0004
    entry = int(table[x % 4])  # one decode step, as the lockstep decoder does it
    x = (entry >> 32) * (x >> 2) + (entry & 0xFFFF)
    assert (entry >> 16) & 0xFFFF == 5 and x == 0xC003 and (x << 16 | 0xABCD) == 0xC003_ABCD


def coarse(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Weights born on a coarse grid (as dequantized 4-bit blocks are): a scale per block of 32 times a 4-bit
    integer plus an offset, in fp16, cast to bf16: the low mantissa bits of small values are far from noise."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, shape).astype(np.float32)
    scale = (rng.uniform(0.001, 0.004, (*shape[:-1], shape[-1] // 32, 1))).astype(np.float16).astype(np.float32)
    offset = (-8 * scale).astype(np.float16).astype(np.float32)
    w = (q.reshape(*shape[:-1], -1, 32) * scale + offset).reshape(shape)
    return float32_to_bf16(w.astype(np.float16).astype(np.float32))


def ideal_two_stage_bits(bits: np.ndarray, t: RansTensor) -> float:
    """The bound the second stage beats: H(value) + H(low bits | class) + raw bits, per weight, empirical
    (order 0, one table), with t's m, k and classes."""
    flat = bits.reshape(-1).astype(np.int64)
    m, k = t.mantissa_bits, t.low_bits
    v = (flat >> (7 - m)) & ((1 << (8 + m)) - 1)
    u = (flat >> (7 - m - k)) & ((1 << k) - 1)
    symbol = {int(a): i for i, a in enumerate(t.alphabet)}
    cls = np.array([t.symbol_class[symbol.get(int(x), t.alphabet_size)] for x in range(1 << (8 + m))])[v]

    def h(keys: np.ndarray) -> float:
        c = np.bincount(keys).astype(np.float64)
        c = c[c > 0]
        return float((c * np.log2(c.sum() / c)).sum())

    return (h(v) + h(cls << k | u) - h(cls)) / flat.size + 8 - m - k


def test_two_stages_are_chosen_where_low_bits_are_not_noise() -> None:
    gauss, grid = trained((256, 1024)), coarse((256, 1024))
    t = encode_rans(gauss)
    assert t.low_bits == 0  # trained-like weights: one stage (their low bits are noise)
    u = encode_rans(grid)
    one = encode_rans(grid, mantissa_bits=2)
    assert u.low_bits > 0 and u.mantissa_bits + u.low_bits == 7 and u.low_tables > 1
    assert u.nbytes < 0.97 * one.nbytes  # what the second stage saves here
    assert same_bits(decode_rans(u), grid) and same_bits(scalar_decode(encode_rans(grid[:8], block_size=512)),
                                                         grid[:8])
    # within 0.05 bit per weight of the order-0 conditional entropy it codes: the lanes' states cost 0.017 (9.7),
    # the tables about 0.011 here, quantized frequencies and the header the rest
    assert 8 * u.nbytes / grid.size < ideal_two_stage_bits(grid, u) + 0.05


@given(st.integers(0, 1 << 26), st.sampled_from([1, 8, 32, 64]), st.sampled_from([32, 1000, 65536]))
def test_blocks_come_in_fours(n: int, lanes: int, largest: int) -> None:
    """The encoder's block size (FORMAT.md 9.5): at most ``largest`` weights, whole lane steps, and the fewest
    blocks whose count is a multiple of four: exactly that count wherever rounding each block up to whole steps
    cannot empty the last one (n > F (F - 1) lanes for F blocks: every tensor of the packaged models)."""
    size = tensor_block_size(n, lanes, largest)
    blocks = -(-n // size)
    assert 1 <= size <= largest and (size % lanes == 0 or size == largest)
    fewest = 4 * -(-max(n, 1) // (4 * largest))  # the fewest blocks of <= largest weights, a multiple of four
    assert blocks <= fewest
    if largest % lanes == 0 and n > fewest * (fewest - 1) * lanes:
        assert blocks == fewest, (n, lanes, largest, size, blocks)


def test_the_encoder_weighs_decoding_time_against_size() -> None:
    """decode_cost (bits a nanosecond of decoding is worth, FORMAT.md 9.5): 0 keeps the smallest form; a high one
    keeps one stage with tables by block, the fastest to decode; bad values are refused by name."""
    grid = coarse((256, 1024))
    small, fast = encode_rans(grid, decode_cost=0), encode_rans(grid, decode_cost=100)
    assert small.low_bits > 0 and fast.low_bits == 0 and fast.context_period == 0
    assert small.nbytes < 0.99 * fast.nbytes
    assert same_bits(decode_rans(fast), grid) and same_bits(decode_rans(small), grid)
    for bad in (-0.1, float("nan"), float("inf"), "1"):
        with pytest.raises(CodecError, match="decode_cost"):
            encode_rans(grid, decode_cost=bad)
    # the model: every decoding table's bytes per weight, two stages per weight and per tensor, a context per
    # weight, rows more; by block at most four tables in use (four blocks side by side)
    assert decode_charge(1000, 0.0, context="row", tables=16, alphabet_size=600, low_bits=5, low_tables=9) == 0
    assert decode_charge(1000, 1.0, tables=4) == decode_charge(1000, 1.0, tables=16) > decode_charge(1000, 1.0,
                                                                                                    tables=1)
    assert decode_charge(1000, 1.0, tables=1) < decode_charge(1000, 1.0, tables=1, alphabet_size=256) \
        < decode_charge(1000, 1.0, tables=1, low_bits=5, low_tables=2)
    assert 0 < decode_charge(1000, 1.0, context="column", tables=2) < decode_charge(1000, 1.0, context="column",
                                                                                    tables=16) \
        < decode_charge(1000, 1.0, context="row", tables=16)
    assert decode_charge(10, 1.0, low_bits=5) < decode_charge(1000, 1.0, low_bits=5)


def test_a_given_mantissa_bits_means_one_stage() -> None:
    grid = coarse((64, 256))
    assert encode_rans(grid, mantissa_bits=3).low_bits == 0
    assert encode_rans(grid, mantissa_bits=1, low_bits=6).low_bits == 6
    with pytest.raises(CodecError):
        encode_rans(grid, mantissa_bits=3, low_bits=5)


def test_tables_by_column_where_columns_differ_in_scale() -> None:
    """An embedding whose columns have their own scales (as Whisper's): tables chosen by column, not by block,
    and smaller than the best by block (FORMAT.md 9.5); by row where the rows differ."""
    rng = np.random.default_rng(6)
    scale = np.where(rng.random(256) < 0.5, 1e-3, 1.0).astype(np.float32)
    cols = float32_to_bf16((rng.standard_normal((512, 256)) * scale).astype(np.float32))
    t, by_block = encode_rans(cols), encode_rans(cols, context="block")
    assert (t.context_stride, t.context_period) == (1, 256) and t.n_tables >= 2 and len(t.block_table) == 0
    assert t.nbytes < 0.95 * by_block.nbytes
    assert same_bits(decode_rans(t), cols)
    rows = np.ascontiguousarray(cols.T)
    u = encode_rans(rows)
    assert (u.context_stride, u.context_period) == (512, 256) and u.nbytes < 0.95 * encode_rans(
        rows, context="block").nbytes
    assert same_bits(decode_rans(u), rows) and same_bits(scalar_decode(encode_rans(rows[:40], block_size=1000)),
                                                         rows[:40])
    with pytest.raises(CodecError):
        encode_rans(cols.reshape(-1), context="column")  # one dimension: no columns
