"""Pick the next token from logits: greedy, temperature, top-k, top-p, with a per-request generator.

The arithmetic is float64 and consumes exactly one uniform number per sampled token, so a request
with a fixed seed gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import numpy as np

from reference.engine.params import SamplingParams


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from (float64, sums to 1), after temperature, top-k,
    top-p."""
    z = np.asarray(logits, dtype=np.float64) / params.temperature
    z = z - z.max()
    if params.top_k and params.top_k < len(z):
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)  # ties with the k-th value are kept
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # mass of the strictly more likely tokens
        keep = order[before < params.top_p]  # the first token is always kept
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id. Greedy takes the first index of the largest logit and draws nothing."""
    if params.greedy:
        return int(np.argmax(logits))
    p = probabilities(logits, params)
    u = rng.random()
    cumulative = np.cumsum(p)
    index = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    return min(index, int(np.flatnonzero(p)[-1]))  # guard against rounding at the very top
