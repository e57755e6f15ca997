"""The sampler's logit adjustments and reported log-probabilities (``reference/engine/sampling.py``).

``logit_bias`` adds to a token's logit; ``repetition_penalty`` (vLLM's) divides the positive logits and
multiplies the negative ones of every token of the prompt and the output; ``frequency_penalty`` and
``presence_penalty`` (OpenAI's) subtract ``f * count + p * (count > 0)`` over the output only; ``min_p`` keeps
the tokens at least ``min_p`` times as likely as the most likely one. The logprobs reported are the raw
log-softmax, whatever the request samples with. The engine, end to end: prompt logprobs from every prompt row
(chunked prefill too, the prefix cache skipped) equal the model's.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.engine import Engine, SamplingParams, SamplingParamsError, probabilities, sample
from reference.engine.sampling import adjust, log_softmax, logprob_of
from reference.model.llama import LlamaModel
from tests.tiny_llama import CONFIG, tiny_weights

LOGITS = np.array([2.0, -1.0, 0.5, 3.0, -2.0])


def test_logit_bias_adds_and_can_force_a_token():
    z = adjust(LOGITS, SamplingParams(logit_bias={1: 5.0, 3: -100}))
    assert np.allclose(z, [2.0, 4.0, 0.5, -97.0, -2.0])
    assert sample(LOGITS, SamplingParams(logit_bias={4: 100}), 0, 0) == 4  # greedy sees the bias too


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output():
    z = adjust(LOGITS, SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1], output_ids=[1, 4])
    assert np.allclose(z, [1.0, -2.0, 0.5, 3.0, -4.0])  # tokens 0, 1, 4 seen; 2 and 3 untouched


def test_frequency_and_presence_penalties_count_the_output_only():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    z = adjust(LOGITS, params, prompt_ids=[2, 2, 2], output_ids=[3, 3, 0])
    assert np.allclose(z, [2.0 - 1.5, -1.0, 0.5, 3.0 - 2.0, -2.0])
    assert np.array_equal(adjust(LOGITS, params, prompt_ids=[0, 3]), LOGITS)  # the prompt alone: nothing
    assert sample(LOGITS, SamplingParams(frequency_penalty=2.0), 0, 0, output_ids=[3]) == 0  # 3 - 2 < 2


def test_min_p_drops_the_unlikely():
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))
    rel = np.exp(LOGITS - LOGITS.max())
    assert np.array_equal(p > 0, rel >= 0.3) and np.isclose(p.sum(), 1)


def test_penalties_change_the_sampled_distribution_as_specified():
    """A frequency penalty f on a token seen c times scales its odds by exp(-f c) (temperature 1)."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5)
    draws = np.bincount([sample(logits, params, 5, i, output_ids=[0, 0]) for i in range(20000)], minlength=4)
    want = np.array([0.4 * np.exp(-1.0), 0.3, 0.2, 0.1])
    assert np.abs(draws / 20000 - want / want.sum()).max() < 0.015


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=3, max_size=40), st.floats(-2, 2), st.floats(-2, 2),
       st.floats(0.1, 5), st.lists(st.integers(0, 2), max_size=6), st.integers(0, 2**32))
def test_adjusted_sampling_is_reproducible_and_keeps_unseen_tokens(logits, freq, pres, rep, output, seed):
    logits = np.array(logits)
    params = SamplingParams(temperature=0.8, frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep)
    z = adjust(logits, params, prompt_ids=[0], output_ids=output)
    assert np.array_equal(z[3:], logits[3:])  # tokens never seen are untouched
    token = sample(logits, params, seed, 9, [0], output)
    assert token == sample(logits, params, seed, 9, [0], output)


@given(st.lists(st.floats(-30, 30), min_size=2, max_size=60), st.integers(0, 10))
def test_logprobs_are_the_raw_log_softmax_and_top_k_is_sorted(logits, k):
    logits = np.array(logits)
    lp = log_softmax(logits)
    assert np.isclose(np.exp(lp).sum(), 1)
    rec = logprob_of(lp, 1, k)
    assert rec.logprob == lp[1] and len(rec.top) == min(k, len(logits))
    values = [v for _, v in rec.top]
    assert values == sorted(values, reverse=True)
    if rec.top:
        assert rec.top[0][1] == lp.max()


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("min_p", 1.1),
                                          ("repetition_penalty", 0), ("logprobs", -1), ("logit_bias", {1: 101}),
                                          ("logit_bias", {-1: 1})])
def test_out_of_range_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})


def test_engine_logprobs_equal_the_models_with_chunked_prefill_and_a_cached_prefix():
    model = LlamaModel(CONFIG, tiny_weights())
    engine = Engine(model, max_num_batched_tokens=8, max_num_seqs=4, block_size=4)
    prompt = list(range(1, 20))
    out = engine.generate([prompt], SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=3))[0]
    want = np.array([log_softmax(row) for row in model.forward_contiguous(prompt + out.output_token_ids)])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    got = [r.logprob for r in out.prompt_logprobs[1:]]
    assert np.allclose(got, [want[i - 1, prompt[i]] for i in range(1, len(prompt))], atol=1e-4)
    gen = [r.logprob for r in out.logprobs]
    n = len(prompt)
    assert np.allclose(gen, [want[n - 1 + j, t] for j, t in enumerate(out.output_token_ids)], atol=1e-4)
    assert all(r.top[0][0] == t for r, t in zip(out.logprobs, out.output_token_ids, strict=True))  # greedy
    again = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]  # cached: recomputed
    assert [r.logprob for r in again.prompt_logprobs[1:]] == got and again.num_cached_tokens == 0
