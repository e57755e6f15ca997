"""fp8 e4m3: the codec against torch.float8_e4m3fn, exhaustively on codes, and the KV block rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference.kv import fp8
from reference.kv.cache import KVCache

ALL_CODES = np.arange(256, dtype=np.uint8)


def torch_decode(codes: np.ndarray) -> np.ndarray:
    return torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()


def torch_encode_saturating(x: np.ndarray) -> np.ndarray:
    """torch's cast is not saturating (>= 480 becomes NaN); clamping first gives our rule for finite x."""
    clamped = np.clip(x, -fp8.E4M3_MAX, fp8.E4M3_MAX)
    return torch.from_numpy(clamped).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def test_decode_all_256_codes_equal_torch():
    ours, theirs = fp8.decode(ALL_CODES), torch_decode(ALL_CODES)
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    assert np.array_equal(np.isnan(ours), np.isin(ALL_CODES, [0x7F, 0xFF]))
    finite = ~np.isnan(ours)
    assert np.array_equal(ours[finite].view(np.uint32), theirs[finite].view(np.uint32))  # -0.0 included
    assert ours[0x7E] == 448 and ours[0x01] == 2.0 ** -9 and ours[0x08] == 2.0 ** -6


def test_encode_inverts_decode_on_every_finite_code():
    values = fp8.decode(ALL_CODES)
    finite = ~np.isnan(values)
    assert np.array_equal(fp8.encode(values[finite]), ALL_CODES[finite])


def _boundary_values() -> np.ndarray:
    """Every midpoint between neighbouring codes, one float32 ulp either side, and the codes."""
    pos = np.sort(fp8.decode(np.arange(0x7F, dtype=np.uint8)).astype(np.float64))
    mids = np.concatenate([(pos[:-1] + pos[1:]) / 2, [464.0, 470.0, 479.0, 480.0, 1e4]]).astype(np.float32)
    near = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0)),
                           pos.astype(np.float32)])
    return np.concatenate([near, -near])


def test_encode_ties_and_boundaries_equal_torch():
    x = _boundary_values()
    assert np.array_equal(fp8.encode(x), torch_encode_saturating(x))


def test_encode_random_float32_bit_patterns_equal_torch():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, size=400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, (rng.standard_normal(200_000) * 100).astype(np.float32)])
    x = x[np.isfinite(x)]
    assert np.array_equal(fp8.encode(x), torch_encode_saturating(x))


def test_special_values():
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 500.0, -1e38], dtype=np.float32)
    assert list(fp8.encode(x)) == [0x7F, 0xFF, 0x7E, 0xFE, 0x00, 0x80, 0x00, 0x80, 0x7E, 0xFE]


@pytest.mark.parametrize("e", [-126, -40, -9, -1, 0, 3, 17, 120])
def test_encode_with_scale_equals_torch_on_exactly_scaled_input(e):
    """encode(x, e) == torch cast of x * 2^-e, where that product is exact in float32."""
    rng = np.random.default_rng(e + 200)
    y = (rng.standard_normal(50_000) * 50).astype(np.float32)  # what we expect after scaling
    y = np.concatenate([y, _boundary_values()])
    with np.errstate(over="ignore"):
        x = np.ldexp(y, e).astype(np.float32)
    exact = np.ldexp(x, -e).astype(np.float32) == y  # skip values that under/overflowed in float32
    assert exact.mean() > 0.9
    assert np.array_equal(fp8.encode(x[exact], e), torch_encode_saturating(y[exact]))


def test_float32_subnormals_scale_correctly():
    x = np.array([2.0 ** -130, 2.0 ** -135, 3 * 2.0 ** -134, 1.5 * 2.0 ** -127], dtype=np.float32)  # subnormal
    assert list(fp8.decode(fp8.encode(x, -126), -126)) == list(x)
    assert fp8.encode(np.array([2.0 ** -137], np.float32), -126)[0] == 0  # below half the smallest step


@given(st.floats(min_value=0, max_value=3.0000000054977558e+38, allow_nan=False, width=32))
def test_scale_exponent_is_the_smallest_that_fits(amax):
    e = int(fp8.scale_exponent(amax))
    assert fp8.MIN_SCALE_EXP <= e <= fp8.MAX_SCALE_EXP
    assert amax <= 448 * 2.0 ** e
    if e > fp8.MIN_SCALE_EXP:
        assert amax > 448 * 2.0 ** (e - 1)


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32), min_size=1, max_size=40))
def test_round_trip_error_at_most_half_a_step(values):
    x = np.array(values, dtype=np.float32)
    e = fp8.scale_exponent(fp8.finite_abs_max(x, axis=0))
    y = fp8.decode(fp8.encode(x, e), e).astype(np.float64)
    magnitude = np.floor(np.log2(np.maximum(np.abs(x).astype(np.float64), 1e-45))).astype(np.int64)
    step = np.ldexp(1.0, np.maximum(magnitude, -6 + int(e)) - 3)
    assert np.all(np.abs(y - x) <= step / 2 + 1e-300)


# ---- the KV block rules -------------------------------------------------------------------------

def _fp8_cache(block_size=4):
    return KVCache(num_layers=1, num_blocks=3, block_size=block_size, num_kv_heads=2, head_dim=8, dtype="fp8")


def test_partially_filled_block_is_rescaled_when_a_larger_value_arrives():
    cache = _fp8_cache()
    rng = np.random.default_rng(1)
    small = rng.standard_normal((2, 2, 8)).astype(np.float32)
    cache.write(0, np.array([4, 5]), small, small)  # block 1, offsets 0, 1
    e_small = cache.k_exp[0][1].copy()
    big = small[:1] * 1000
    cache.write(0, np.array([6]), big, big)  # offset 2: larger values
    e_big = cache.k_exp[0][1]
    assert np.all(e_big > e_small)
    # the earlier tokens were re-encoded exactly as the rule says: decode at the old scale, encode at the new
    old_codes = fp8.encode(small, e_small[None, :, None])
    expected = fp8.encode(fp8.decode(old_codes, e_small[None, :, None]), e_big[None, :, None])
    assert np.array_equal(cache.k[0][1, :2], expected)
    assert np.array_equal(cache.k[0][1, 2:3], fp8.encode(big, e_big[None, :, None]))
    k, _ = cache.read(0, [1], 3)
    assert np.allclose(k[2], big[0], rtol=2 ** -4)


def test_scale_never_shrinks_and_offset_zero_restarts_a_block():
    cache = _fp8_cache()
    big = np.full((1, 2, 8), 100.0, np.float32)
    tiny = np.full((1, 2, 8), 0.01, np.float32)
    cache.write(0, np.array([0]), big, big)
    e = cache.v_exp[0][0].copy()
    cache.write(0, np.array([1]), tiny, tiny)
    assert np.array_equal(cache.v_exp[0][0], e)  # did not shrink
    cache.write(0, np.array([0]), tiny, tiny)  # a new owner starts the block again
    assert np.all(cache.v_exp[0][0] < e)
    assert np.all(cache.v[0][0, 1:] == 0)


def test_copy_block_copies_scales():
    cache = _fp8_cache()
    x = np.random.default_rng(2).standard_normal((3, 2, 8)).astype(np.float32)
    cache.write(0, np.array([0, 1, 2]), x, x)
    cache.copy_block(0, 2)
    assert np.array_equal(cache.read(0, [2], 3)[0], cache.read(0, [0], 3)[0])
