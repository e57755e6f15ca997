"""bfloat16 rounding, bit fields and entropy (reference/bf16.py), checked against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import bf16


def torch_bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def is_nan_bits(b: np.ndarray) -> np.ndarray:
    return ((b & 0x7F80) == 0x7F80) & ((b & 0x7F) != 0)


def check_against_torch(bits32: np.ndarray) -> None:
    x = bits32.view(np.float32)
    ours, theirs = bf16.float32_to_bf16(x), torch_bf16(x)
    nan = np.isnan(x)
    # torch returns 0x7FC0 (scalar path) or 0xFFFF (vector path) for NaN; we keep sign and payload
    assert is_nan_bits(ours[nan]).all(), "a NaN input must stay a NaN"
    diff = np.nonzero((ours != theirs) & ~nan)[0]
    if diff.size:
        i = diff[0]
        pytest.fail(f"{diff.size} mismatches; first at {i}: input {bits32[i]:#010x} ours {ours[i]:#06x} "
                    f"torch {theirs[i]:#06x}")


def test_rounding_matches_torch_on_a_million_random_float32() -> None:
    rng = np.random.default_rng(0)
    check_against_torch(rng.integers(0, 2**32, size=1_200_000, dtype=np.uint64).astype(np.uint32))


def test_rounding_matches_torch_on_every_special_class() -> None:
    specials = []
    for sign in (0, 0x80000000):
        for exponent in range(256):  # every exponent, incl. 0 (zero/subnormal) and 255 (inf/NaN)
            base = sign | (exponent << 23)
            # mantissas at and around the rounding boundary (ties to even both ways), 0 and all-ones
            for low in (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x18000, 0x17FFF, 0x7FFFFF, 0x7F8000, 0x7F7FFF):
                specials.append(base | low)
    specials += [0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x00000001, 0x80000001, 0x007FFFFF]
    bits = np.array(specials, dtype=np.uint32)
    check_against_torch(bits)
    out = bf16.float32_to_bf16(bits.view(np.float32))
    lookup = dict(zip(bits.tolist(), out.tolist(), strict=True))
    assert lookup[0x7F7FFFFF] == 0x7F80  # rounds past the largest finite bf16 -> +inf
    assert lookup[0x80000000] == 0x8000  # -0.0 stays -0.0
    assert lookup[0x7F800000] == 0x7F80 and lookup[0xFF800000] == 0xFF80  # +-inf
    assert lookup[0x00000001] == 0x0000  # the smallest subnormal rounds to +0
    assert lookup[0x00018000] == 0x0002  # a tie rounds to even (up)
    assert lookup[0x00008000] == 0x0000  # a tie rounds to even (down)


def test_nan_keeps_sign_and_payload_top_bits() -> None:
    bits = np.array([0x7F812345, 0xFFC00000, 0x7FA00001], dtype=np.uint32)
    out = bf16.float32_to_bf16(bits.view(np.float32))
    assert out.tolist() == [0x7FC1, 0xFFC0, 0x7FE0]


def test_rejects_non_float32() -> None:
    with pytest.raises(TypeError, match="float32"):
        bf16.float32_to_bf16(np.zeros(3, np.float64))
    with pytest.raises(TypeError, match="uint16"):
        bf16.split_fields(np.zeros(3, np.int32))


def test_widening_is_exact_for_all_65536_patterns() -> None:
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    wide = bf16.bf16_to_float32(bits)
    assert np.array_equal(wide.view(np.uint32) >> 16, bits.astype(np.uint32))
    assert np.array_equal(wide.view(np.uint32) & 0xFFFF, np.zeros(65536, np.uint32))
    theirs = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert np.array_equal(wide.view(np.uint32), theirs.view(np.uint32))
    # and narrowing a widened value gives it back, NaNs included (they are already quiet or get quieted)
    back = bf16.float32_to_bf16(wide)
    finite = ~is_nan_bits(bits)
    assert np.array_equal(back[finite], bits[finite])


def test_split_join_round_trip_all_patterns() -> None:
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    s, e, m = bf16.split_fields(bits)
    assert s.max() == 1 and e.max() == 255 and m.max() == 127
    assert np.array_equal(bf16.join_fields(s, e, m), bits)
    sm = bf16.sign_mantissa_byte(bits)
    assert np.array_equal(sm >> 7, s) and np.array_equal(sm & 0x7F, m)


def test_join_rejects_out_of_range_fields() -> None:
    with pytest.raises(ValueError, match="sign"):
        bf16.join_fields(np.array([2]), np.array([0]), np.array([0]))
    with pytest.raises(ValueError, match="mantissa"):
        bf16.join_fields(np.array([0]), np.array([0]), np.array([128]))


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=300))
def test_entropy_bounds(counts: list[int]) -> None:
    h = bf16.shannon_entropy(np.array(counts))
    nonzero = sum(c > 0 for c in counts)
    assert h >= 0
    assert h <= np.log2(max(nonzero, 1)) + 1e-9


def test_entropy_of_known_distributions() -> None:
    assert bf16.shannon_entropy(np.array([5, 5])) == pytest.approx(1.0)
    assert bf16.shannon_entropy(np.array([1, 1, 1, 1, 0, 0])) == pytest.approx(2.0)
    assert bf16.shannon_entropy(np.array([7])) == 0.0
    assert bf16.shannon_entropy(np.array([])) == 0.0


def test_field_stats_of_gaussian_weights() -> None:
    """Gaussian weights look like trained ones: a few bits of exponent, near-random mantissa."""
    x = np.random.default_rng(1).normal(0, 0.02, size=200_000).astype(np.float32)
    s = bf16.field_stats(bf16.float32_to_bf16(x))
    assert s.n == 200_000
    assert 2.0 < s.exponent_entropy < 3.5
    assert s.sign_entropy > 0.999
    assert s.mantissa_entropy > 6.9
    assert s.top_k_coverage(16) > 0.999
    assert (s + s).n == 400_000 and (s + s).exponent_entropy == pytest.approx(s.exponent_entropy)


def test_top_k_coverage_edges() -> None:
    assert bf16.top_k_coverage(np.zeros(256, np.int64), 16) == 1.0
    counts = np.zeros(256, np.int64)
    counts[:32] = 1
    assert bf16.top_k_coverage(counts, 16) == 0.5
