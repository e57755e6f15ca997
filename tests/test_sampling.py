"""Sampling: greedy, temperature, top-k, top-p, and the counter-based stream (seed, position) -> uniform."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from reference.engine import SamplingParams, probabilities, sample
from reference.engine.sampling import derive_seed, uniform

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))


def test_greedy_is_argmax():
    assert sample(np.array([0.1, 3.0, 3.0, -1.0]), SamplingParams(), seed=0, position=0) == 1  # first of ties


def test_top_k_and_top_p_cut_the_distribution():
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert np.allclose(p, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0])
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5+0.2 < 0.8 <= 0.85
    assert np.allclose(p, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))  # always keeps the top token
    assert np.allclose(p, [1, 0, 0, 0, 0])
    cold = probabilities(LOGITS, SamplingParams(temperature=0.1))
    assert cold[0] > 0.99


def test_draws_follow_the_distribution():
    params = SamplingParams(temperature=1.0)
    counts = np.bincount([sample(LOGITS, params, 7, i) for i in range(20000)], minlength=5) / 20000
    assert np.abs(counts - np.exp(LOGITS)).max() < 0.015


@given(st.lists(st.floats(-30, 30), min_size=2, max_size=50), st.integers(0, 10), st.floats(0.05, 1.0),
       st.floats(0.1, 3.0), st.integers(0, 2**32))
def test_sample_is_a_kept_token_and_reproducible(logits, top_k, top_p, temperature, seed):
    logits = np.array(logits)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    p = probabilities(logits, params)
    assert np.isclose(p.sum(), 1)
    token = sample(logits, params, seed, 5)
    assert p[token] > 0
    assert token == sample(logits, params, seed, 5)


def test_uniform_is_a_pure_function_of_seed_and_position():
    u = [uniform(3, i) for i in range(20000)]
    assert u == [uniform(3, i) for i in range(20000)]  # no state: the same numbers again, in any order
    assert uniform(3, 9) == u[9]
    assert all(0.0 <= x < 1.0 for x in u)
    hist = np.bincount((np.array(u) * 10).astype(int), minlength=10) / len(u)
    assert np.abs(hist - 0.1).max() < 0.01  # flat
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.03  # neighbours unrelated
    other = [uniform(4, i) for i in range(20000)]
    assert abs(np.corrcoef(u, other)[0, 1]) < 0.03  # streams of other seeds unrelated
    assert sum(a == b for a, b in zip(u, other, strict=True)) < 3


def test_derived_seeds_are_distinct_and_in_a_clients_range():
    seeds = {derive_seed(0, n) for n in range(5000)} | {derive_seed(1, n) for n in range(5000)}
    assert len(seeds) == 10000
    assert all(0 <= s < 2**63 for s in seeds)
