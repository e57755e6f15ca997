"""Hypothesis strategies shared by the codec tests: bf16 tensors of many shapes and distributions."""

from __future__ import annotations

import copy
import math

import numpy as np
from hypothesis import strategies as st

from reference.bf16 import float32_to_bf16

SPECIALS = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0xFFFF, 0x0001, 0x807F, 0x0040],
                    np.uint16)  # +-0, +-inf, NaNs with payloads, subnormals


@st.composite
def shapes(draw: st.DrawFn, max_elements: int = 6000) -> tuple[int, ...]:
    ndim = draw(st.integers(0, 3))
    dims = draw(st.lists(st.integers(0, 200), min_size=ndim, max_size=ndim))
    while math.prod(dims) > max_elements:
        dims[dims.index(max(dims))] //= 2
    return tuple(dims)


@st.composite
def bf16_tensors(draw: st.DrawFn, max_elements: int = 6000) -> np.ndarray:
    """A bf16 tensor (uint16 bits): trained-like, uniform bits, few values, evenly spread exponents, or
    a single value; with NaN payloads, infinities, -0.0 and subnormals sprinkled in."""
    shape = draw(shapes(max_elements))
    n = math.prod(shape)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "uniform_bits", "few_values", "spread_exponents", "single"]))
    if kind == "normal":
        scale = draw(st.sampled_from([1e-3, 0.02, 1.0, 1e30]))
        bits = float32_to_bf16((rng.standard_normal(n) * scale).astype(np.float32))
    elif kind == "uniform_bits":
        bits = rng.integers(0, 65536, n).astype(np.uint16)
    elif kind == "few_values":
        bits = rng.choice(rng.integers(0, 65536, draw(st.integers(1, 40))).astype(np.uint16), n)
    elif kind == "spread_exponents":  # every exponent equally often: the worst case for a palette
        bits = ((np.arange(n) % 256) << 7 | rng.integers(0, 2, n) << 15 | rng.integers(0, 128, n)).astype(np.uint16)
    else:
        bits = np.full(n, draw(st.integers(0, 65535)), np.uint16)
    if n and draw(st.booleans()):
        where = rng.random(n) < 0.05
        bits[where] = rng.choice(SPECIALS, int(where.sum()))
    return bits.reshape(shape)


@st.composite
def codec_params(draw: st.DrawFn) -> dict[str, int]:
    palette_size = draw(st.sampled_from([1, 2, 8, 16, 16, 32, 256]))
    least = max(1, math.ceil(math.log2(palette_size)))
    return {
        "palette_size": palette_size,
        "chunk_size": draw(st.sampled_from([1, 3, 32, 64, 64, 128])),
        "chunks_per_group": draw(st.sampled_from([1, 2, 5, 32])),
        "max_code_length": draw(st.integers(least, 16)),
    }


# any JSON-like value a corrupted header field might hold
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**33), st.text(max_size=3),
                 st.lists(st.integers(-2, 300), max_size=20), st.dictionaries(st.text(max_size=3), st.integers()))


def tampered_header(header: dict, key: str, value: object) -> dict:
    """A deep copy of a tensor header with one field set to ``value`` ("crc32.X" names the X entry of its CRCs)."""
    header = copy.deepcopy(header)
    if key.startswith("crc32."):
        header["crc32"][key[6:]] = value
    else:
        header[key] = value
    return header
