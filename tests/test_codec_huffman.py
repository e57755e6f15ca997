"""Canonical, length-limited Huffman codes: optimality, the length limit, prefix property, the LUT."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.codec.errors import CodecError
from reference.codec.huffman import canonical_codes, check_lengths, code_lengths, decode_table

counts_lists = st.lists(st.integers(0, 10**6), min_size=1, max_size=40)


def huffman_cost(counts: list[int]) -> int:
    """Total bits of plain (unlimited) Huffman coding, by the textbook heap construction."""
    heap = [c for c in counts if c > 0]
    if len(heap) <= 1:
        return sum(heap)
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        cost += a + b
        heapq.heappush(heap, a + b)
    return cost


@given(counts_lists)
def test_unlimited_package_merge_is_optimal(counts: list[int]) -> None:
    lengths = code_lengths(counts, 16)
    if sum(c > 0 for c in counts) >= 2 and max(lengths) < 16:  # the limit did not bind: plain optimum
        assert sum(c * n for c, n in zip(counts, lengths, strict=True)) == huffman_cost(counts)


@given(counts_lists, st.integers(1, 16))
def test_lengths_respect_limit_and_form_a_valid_code(counts: list[int], max_length: int) -> None:
    used = sum(c > 0 for c in counts)
    if used > 2**max_length:
        with pytest.raises(CodecError):
            code_lengths(counts, max_length)
        return
    lengths = code_lengths(counts, max_length)
    assert all((n > 0) == (c > 0) for c, n in zip(counts, lengths, strict=True))
    assert max(lengths) <= max_length
    check_lengths(lengths, max_length)  # complete code (or a single 1-bit code)
    # never worse than a fixed-length code of the same limit
    fixed = max(1, (used - 1).bit_length())
    assert sum(c * n for c, n in zip(counts, lengths, strict=True)) <= fixed * sum(counts)


@given(counts_lists, st.integers(4, 16))
def test_limited_cost_is_monotone_in_the_limit(counts: list[int], max_length: int) -> None:
    if sum(c > 0 for c in counts) > 2 ** (max_length - 1):
        return
    def cost(lengths: list[int]) -> int:
        return sum(c * n for c, n in zip(counts, lengths, strict=True))

    assert cost(code_lengths(counts, max_length)) <= cost(code_lengths(counts, max_length - 1))


def test_canonical_codes_match_deflate_example() -> None:
    # RFC 1951 section 3.2.2: lengths (3, 3, 3, 3, 3, 2, 4, 4) for symbols A..H
    codes = canonical_codes([3, 3, 3, 3, 3, 2, 4, 4])
    assert codes == [0b010, 0b011, 0b100, 0b101, 0b110, 0b00, 0b1110, 0b1111]


@given(counts_lists, st.integers(1, 12))
def test_decode_table_finds_every_code(counts: list[int], max_length: int) -> None:
    if sum(c > 0 for c in counts) > 2**max_length:
        return
    lengths = code_lengths(counts, max_length)
    symbols, table_lengths = decode_table(lengths, max_length)
    for s, (code, n) in enumerate(zip(canonical_codes(lengths), lengths, strict=True)):
        if n:
            window = code << (max_length - n)
            assert symbols[window] == s and table_lengths[window] == n
    # a complete code leaves no invalid entry; a single 1-bit code leaves half the table invalid
    assert (table_lengths == 0).mean() == (0.5 if sum(n > 0 for n in lengths) == 1 else 0.0) or not any(lengths)


def test_ties_are_deterministic() -> None:
    assert code_lengths([5, 5, 5, 5, 5], 12) == code_lengths(np.array([5, 5, 5, 5, 5]), 12)
    assert code_lengths([1, 1, 1], 12) == [2, 2, 1]  # the two first-ranked (lowest index) go deepest


@pytest.mark.parametrize("lengths", [[1, 1, 1], [2, 2, 2], [2], [0, 13], [3, 3, 2, 2, 2, 2]])
def test_invalid_lengths_are_rejected(lengths: list[int]) -> None:
    with pytest.raises(CodecError):
        check_lengths(lengths, 12)


def test_lengths_are_checked_alike_as_uint8_and_every_time() -> None:
    """The check is remembered for valid codes only: an invalid one raises at every call, and uint8 lengths
    (as a header read into numpy gives) are checked as integers (2 ** (12 - 1) does not wrap)."""
    check_lengths(np.array([1, 2, 2], np.uint8), np.uint8(12))
    check_lengths((1, 2, 2), 12)
    for _ in range(2):
        with pytest.raises(CodecError, match="over-subscribed"):
            check_lengths(np.array([1, 1, 1], np.uint8), 12)
