"""The encoder's fast path (fast/codec/encode_words.py) against the reference encoder: shapes it takes
(whole-chunk rows), palettes that are and are not 16 consecutive exponents, wrong palette guesses,
verbatim chunks, many blocks; and its package-merge against the reference's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fast.codec.encode as enc
import fast.codec.encode_words as ew
import reference.codec as rc
from fast.bf16 import from_numpy_bits
from fast.codec.convert import huffman_arrays
from fast.codec.forms import Geometry
from reference.codec.huffman import code_lengths
from tests.codec_strategies import SPECIALS


def _same(bits: np.ndarray, block: int = 1 << 20, **params: int) -> bool:
    saved, enc.BLOCK_WEIGHTS = enc.BLOCK_WEIGHTS, block
    try:
        mine = huffman_arrays(enc.encode(from_numpy_bits(bits), **params))
    finally:
        enc.BLOCK_WEIGHTS = saved
    ref = huffman_arrays(rc.encode(bits, **params))
    return mine.keys() == ref.keys() and all(np.array_equal(mine[k], ref[k]) for k in ref)


@st.composite
def aligned_tensors(draw: st.DrawFn) -> tuple[np.ndarray, dict[str, int]]:
    """bf16 bits with whole-chunk rows: trained-like (a consecutive palette), with outliers, narrow or
    spread exponents, or a gap in the palette; and parameters the fast path takes."""
    chunk_size = draw(st.sampled_from([4, 8, 64, 64, 128]))
    chunks_per_group = draw(st.sampled_from([1, 3, 32]))
    rows = draw(st.integers(1, 40))
    cols = chunk_size * draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "heavy_tail", "narrow", "gap", "uniform_bits"]))
    n = rows * cols
    if kind == "uniform_bits":
        bits = rng.integers(0, 65536, n).astype(np.uint16)
    else:
        x = rng.standard_normal(n).astype(np.float32) * np.float32(draw(st.sampled_from([1e-3, 0.05, 3.0])))
        if kind == "heavy_tail":
            x *= np.exp(rng.standard_normal(n) * 2).astype(np.float32)
        elif kind == "narrow":
            x = np.float32(1.0) + np.abs(x) * np.float32(1e-2)
        elif kind == "gap":  # no weight with exponent 124: the palette skips it
            x[(np.abs(x) >= 0.125) & (np.abs(x) < 0.25)] *= np.float32(2)
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)
        if draw(st.booleans()):
            where = rng.random(n) < 0.01
            bits[where] = rng.choice(SPECIALS, int(where.sum()))
    params = {"chunk_size": chunk_size, "chunks_per_group": chunks_per_group,
              "palette_size": draw(st.sampled_from([16, 16, 8, 3])), "max_code_length": draw(st.integers(4, 14))}
    return bits.reshape(rows, cols), params


@settings(max_examples=60, deadline=None)
@given(case=aligned_tensors(), block=st.sampled_from([1, 4096, 1 << 20]))
def test_fast_path_equals_reference(case: tuple[np.ndarray, dict[str, int]], block: int) -> None:
    bits, params = case
    assert ew.applies(Geometry(bits.shape, params["chunk_size"], params["chunks_per_group"]),
                      params["palette_size"], params["max_code_length"])
    assert _same(bits, block, **params)


@pytest.mark.parametrize("shift", [-2, -1, 0, 1, 2])
def test_wrong_palette_guess_is_corrected(monkeypatch: pytest.MonkeyPatch, shift: int) -> None:
    """The sampled guess of the palette's first exponent is only a starting point."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(128 * 256) * 0.02).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16).reshape(128, 256)
    counts = np.bincount(((bits >> 7) & 0xFF).ravel(), minlength=256)
    palette = ew.choose_palette(counts, 16)
    assert len(palette) == 16 and max(palette) - min(palette) == 15  # consecutive: the guess path
    runs = []
    consecutive = ew._pass_consecutive
    monkeypatch.setattr(ew, "_guess_base", lambda b, p: min(palette) + shift)
    monkeypatch.setattr(ew, "_pass_consecutive", lambda *a, **k: runs.append(a[1]) or consecutive(*a, **k))
    assert _same(bits, 4096)
    assert runs == ([min(palette)] if shift == 0 else [min(palette) + shift, min(palette)])


def test_all_chunks_verbatim_and_one_exponent() -> None:
    spread = ((np.arange(64 * 64) % 256) << 7).astype(np.uint16).reshape(64, 64)  # every chunk sees 64 exponents
    assert _same(spread)
    assert _same(np.full((8, 64), 0x3F80, np.uint16))  # one exponent: one symbol of length 1


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 10**9), min_size=0, max_size=40), max_length=st.integers(1, 16))
def test_fast_code_lengths_equal_reference(counts: list[int], max_length: int) -> None:
    try:
        want = code_lengths(counts, max_length)
    except Exception as e:  # the same error, then
        with pytest.raises(type(e)):
            ew.fast_code_lengths(np.array(counts, np.int64), max_length)
        return
    assert ew.fast_code_lengths(np.array(counts, np.int64), max_length) == want


def test_fast_code_lengths_ties() -> None:
    for counts in ([5] * 16, [1, 1, 2, 2, 4, 4, 8, 8], [3, 3, 3, 0, 3, 3, 6, 6, 12]):
        for max_length in (4, 5, 12):
            assert ew.fast_code_lengths(np.array(counts), max_length) == code_lengths(counts, max_length)
