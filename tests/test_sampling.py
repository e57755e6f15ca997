"""Sampling: greedy, temperature, top-k, top-p, per-request generators."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from reference.engine import SamplingParams, probabilities, sample

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))


def test_greedy_is_argmax_and_draws_nothing():
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    assert sample(np.array([0.1, 3.0, 3.0, -1.0]), SamplingParams(), rng) == 1  # first of the ties
    assert rng.bit_generator.state == state


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
    rng = np.random.default_rng(7)
    params = SamplingParams(temperature=1.0)
    counts = np.bincount([sample(LOGITS, params, rng) for _ in range(20000)], minlength=5) / 20000
    assert np.abs(counts - np.exp(LOGITS)).max() < 0.015


@given(st.lists(st.floats(-30, 30), min_size=2, max_size=50), st.integers(0, 10), st.floats(0.05, 1.0),
       st.floats(0.1, 3.0), st.integers(0, 2**32))
def test_sample_is_a_kept_token_and_reproducible(logits, top_k, top_p, temperature, seed):
    logits = np.array(logits)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    p = probabilities(logits, params)
    assert np.isclose(p.sum(), 1)
    token = sample(logits, params, np.random.default_rng(seed))
    assert p[token] > 0
    assert token == sample(logits, params, np.random.default_rng(seed))
