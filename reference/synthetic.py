"""Synthetic bf16 weights with a real exponent distribution, for tests, conformance cases and
benchmarks.

Real weights are not always at hand (the GPU machine has no MiniLM package), so the exponent
histogram of MiniLM's 12 MLP matrices is stored in ``reference/data`` and synthetic tensors draw
their exponents from it; sign and mantissa are uniform (they are ~incompressible in real weights,
claim U1). ``tests/test_fast_codec.py`` checks the stored histogram against the package's weights.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from reference.bf16 import join_fields

EXPONENTS_FILE = Path(__file__).resolve().parent / "data" / "minilm_mlp_exponents.json"


@functools.lru_cache(maxsize=1)
def minilm_exponent_counts() -> np.ndarray:
    """Exponent histogram (256 counts) pooled over MiniLM's 12 MLP matrices: a real exponent
    distribution."""
    return np.asarray(json.loads(EXPONENTS_FILE.read_text())["counts"], dtype=np.int64)


def synthetic_weights(shape: tuple[int, ...], rng: np.random.Generator,
                      counts: np.ndarray | None = None) -> np.ndarray:
    """Random bf16 weights (uint16 bit patterns) whose exponents follow ``counts`` (default:
    MiniLM's MLP histogram); sign and mantissa uniform."""
    counts = minilm_exponent_counts() if counts is None else counts
    p = counts / counts.sum()
    n = int(np.prod(shape))
    exponent = rng.choice(256, size=n, p=p).astype(np.uint8)
    sign = rng.integers(0, 2, n, dtype=np.uint8)
    mantissa = rng.integers(0, 128, n, dtype=np.uint8)
    return join_fields(sign, exponent, mantissa).reshape(shape)
