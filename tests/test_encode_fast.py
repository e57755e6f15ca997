"""The encoder's fast paths against the reference encoder: the torch one (fast/codec/encode_words.py)
and the C one (fast/codec/native/encode.c) on shapes the torch one takes (whole-chunk rows),
palettes that are and are not 16 consecutive exponents, wrong palette guesses, verbatim chunks,
many blocks; and both package-merge implementations against the reference's."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fast.codec.encode as enc
import fast.codec.encode_words as ew
import reference.codec as rc
from fast.bf16 import from_numpy_bits
from fast.codec import encode_c
from fast.codec.convert import huffman_arrays
from fast.errors import KernelInputError
from reference.codec.huffman import code_lengths
from reference.codec.layout import Layout
from reference.codec.palette import choose_palette
from tests.codec_strategies import SPECIALS, bf16_tensors, codec_params


def _same(bits: np.ndarray, block: int = 1 << 20, native: bool = False, **params: int) -> bool:
    saved, enc.BLOCK_WEIGHTS = enc.BLOCK_WEIGHTS, block
    try:
        mine = huffman_arrays(enc.encode(from_numpy_bits(bits), **params, native=native))
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


NATIVE = [False] + ([True] if encode_c.library() is not None else [])


@pytest.mark.parametrize("native", NATIVE)
@settings(max_examples=60, deadline=None)
@given(case=aligned_tensors(), block=st.sampled_from([1, 4096, 1 << 20]))
def test_fast_paths_equal_reference(native: bool, case: tuple[np.ndarray, dict[str, int]], block: int) -> None:
    bits, params = case
    assert ew.applies(Layout(bits.shape, params["chunk_size"], params["chunks_per_group"]),
                      params["palette_size"], params["max_code_length"])
    assert _same(bits, block, native, **params)


@pytest.mark.parametrize("shift", [-2, -1, 0, 1, 2])
def test_wrong_palette_guess_is_corrected(monkeypatch: pytest.MonkeyPatch, shift: int) -> None:
    """The sampled guess of the palette's first exponent is only a starting point."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(128 * 256) * 0.02).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16).reshape(128, 256)
    counts = np.bincount(((bits >> 7) & 0xFF).ravel(), minlength=256)
    palette = choose_palette(counts, 16)
    assert len(palette) == 16 and max(palette) - min(palette) == 15  # consecutive: the guess path
    runs = []
    consecutive = ew._pass_consecutive
    monkeypatch.setattr(ew, "_guess_base", lambda b, p: min(palette) + shift)
    monkeypatch.setattr(ew, "_pass_consecutive", lambda *a, **k: runs.append(a[1]) or consecutive(*a, **k))
    assert _same(bits, 4096)
    assert runs == ([min(palette)] if shift == 0 else [min(palette) + shift, min(palette)])


@pytest.mark.parametrize("native", NATIVE)
def test_all_chunks_verbatim_and_one_exponent(native: bool) -> None:
    spread = ((np.arange(64 * 64) % 256) << 7).astype(np.uint16).reshape(64, 64)  # every chunk sees 64 exponents
    assert _same(spread, native=native)
    assert _same(np.full((8, 64), 0x3F80, np.uint16), native=native)  # one exponent: one symbol of length 1


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


@pytest.mark.skipif(encode_c.library() is None, reason="no C compiler: the C encoder is not built")
@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(0, 10**12), min_size=0, max_size=25), max_length=st.integers(1, 16),
       ties=st.booleans())
def test_c_code_lengths_equal_reference(counts: list[int], max_length: int, ties: bool) -> None:
    """unw_code_lengths is the reference's package-merge, ties included (or declines: -1)."""
    if ties:  # few distinct counts: many ties
        counts = [c % 4 for c in counts]
    p = len(counts)
    all_counts = torch.zeros((2, 1, 256), dtype=torch.int64)  # exponent i = palette entry i; nothing verbatim
    all_counts[0, 0, :p] = torch.tensor(counts, dtype=torch.int64)
    palette = torch.arange(256, dtype=torch.uint8)
    out = torch.zeros(max(p, 1), dtype=torch.uint8)
    bits = encode_c.library().unw_code_lengths(all_counts[0].data_ptr(), all_counts[1].data_ptr(), 1,
                                                    palette.data_ptr(), p, max_length, out.data_ptr())
    used = sum(1 for x in counts if x > 0)
    if used <= 2 or used > 2**max_length:
        assert bits == -1
    else:
        want = code_lengths(counts, max_length)
        assert out[:p].tolist() == want and bits == sum(c * n for c, n in zip(counts, want, strict=True))


@pytest.mark.skipif(encode_c.library() is None, reason="no C compiler: the C encoder is not built")
@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=256, max_size=256), palette_size=st.integers(1, 256),
       threads=st.integers(1, 3))
def test_c_palette_equals_reference(counts: list[int], palette_size: int, threads: int) -> None:
    """unw_palette: count down, ties by exponent up (few distinct counts: many ties), over ranges."""
    split = torch.tensor(counts, dtype=torch.int64).repeat(threads, 1)  # each range holds all of them
    palette = torch.zeros(256, dtype=torch.uint8)
    p = encode_c.library().unw_palette(split.data_ptr(), threads, palette_size, palette.data_ptr())
    assert palette[:p].tolist() == choose_palette(np.array(counts) * threads, palette_size)


def _trained(rows: int = 32, cols: int = 256) -> np.ndarray:
    x = (np.random.default_rng(3).standard_normal(rows * cols) * 0.02).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).reshape(rows, cols)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_c_encoder_builds_into_an_empty_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(encode_c, "_state", {})
    monkeypatch.setenv("UNFIRE_CACHE", str(tmp_path))
    assert encode_c.library() is not None
    assert len(list(tmp_path.glob("encode-*.so"))) == 1
    assert _same(_trained(), native=True)


@pytest.mark.parametrize("compiler", ["no-such-compiler", "false"])
def test_without_a_c_compiler_encode_uses_torch(monkeypatch: pytest.MonkeyPatch, tmp_path, compiler: str) -> None:
    monkeypatch.setattr(encode_c, "_state", {})
    monkeypatch.setenv("UNFIRE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", compiler)  # missing, or one that fails
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert encode_c.library() is None
    assert _same(_trained(), native=None)  # encode() falls back to the torch encoder
    with pytest.raises(KernelInputError, match="not available"):
        enc.encode(from_numpy_bits(_trained()), native=True)


def test_unfire_native_0_turns_the_c_encoder_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encode_c, "_state", {})
    monkeypatch.setenv("UNFIRE_NATIVE", "0")
    assert encode_c.library() is None
    assert _same(_trained(), native=None)


@pytest.mark.skipif(encode_c.library() is None, reason="no C compiler: the C encoder is not built")
@settings(max_examples=80, deadline=None)
@given(bits=bf16_tensors(), params=codec_params(), threads=st.sampled_from([2, 3, 7]))
def test_c_encoder_in_threads_equals_reference(bits: np.ndarray, params: dict[str, int], threads: int) -> None:
    """Ranges of groups packed apart and joined (here even for small tensors)."""
    if bits.size == 0:
        return
    saved = torch.get_num_threads(), encode_c.MIN_WEIGHTS_PER_THREAD
    torch.set_num_threads(threads)
    encode_c.MIN_WEIGHTS_PER_THREAD = 1
    try:
        mine = huffman_arrays(enc.encode(from_numpy_bits(bits), **params, native=True))
    finally:
        torch.set_num_threads(saved[0])
        encode_c.MIN_WEIGHTS_PER_THREAD = saved[1]
    ref = huffman_arrays(rc.encode(bits, **params))
    assert mine.keys() == ref.keys() and all(np.array_equal(mine[k], ref[k]) for k in ref)
