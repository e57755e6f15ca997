"""Logprobs, echo, n, best_of and the penalties through the real server (``python -m serve``, real processes),
driven by the official ``openai`` client.

- A greedy completion's logprobs (and, with ``echo``, its prompt's) are the log-softmax of the reference
  model's logits (float32, ``reference/model/llama.py``): within 2e-3 nats on the reference engine (paged
  vs contiguous attention round alike but not bit for bit) and within ``BF16_NATS`` on the fast engine (bf16
  weights and activations).
- ``echo`` with ``max_tokens`` 0 answers a list of prompts (text and token ids) with their prompt logprobs,
  the first of each null, as lm-eval's loglikelihood requests need.
- ``n`` 3 with a seed gives 3 reproducible choices, choice i the one a single request seeded seed + i gets;
  ``best_of`` answers the choice with the highest cumulative logprob.
- Chat ``logprobs`` + ``top_logprobs`` streamed and whole agree.
- ``logit_bias`` and ``frequency_penalty`` act on what is generated.
- On the fast engine (CPU: batch-invariant products) logprobs (of generated tokens, sampled with every
  adjustment, and of prompts: lm-eval's echo request) and a grammar's answer are bit-identical between plain
  and ``--compressed`` weights and between colocated, P/D workers (REQUEST revision 3) and a pipeline of 2
  stages; P/D answers ``n`` > 1.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from reference.engine.sampling import log_softmax  # noqa: E402
from tests.smollm import smollm2_model, smollm2_tokenizer  # noqa: E402
from tests.test_serve_disagg import Server  # noqa: E402

BF16_NATS = 0.25  # the largest |bf16 engine - float32 reference| logprob allowed on these prompts
PROMPTS = ["The capital of France is", "One, two, three, four,"]


def reference_logprobs(ids: list[int]) -> np.ndarray:
    """[len(ids), vocab]: row i the reference model's log-probabilities of the token after ids[i]."""
    return np.array([log_softmax(row) for row in smollm2_model().forward_contiguous(ids)])


@pytest.fixture(scope="module", params=["reference", "fast"])
def server(request):
    if request.param == "fast":
        pytest.importorskip("torch")
    s = Server("--engine", request.param, "--max-num-seqs", "8")
    s.kind = request.param
    yield s
    assert s.close() == 0


def tolerance(server: Server) -> float:
    return 2e-3 if server.kind == "reference" else BF16_NATS


def test_greedy_logprobs_are_the_models(server):
    tok = smollm2_tokenizer()
    out = server.client().completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                             logprobs=3, echo=True)
    choice = out.choices[0]
    prompt = tok.encode(PROMPTS[0])
    ids = prompt + tok.encode(choice.text[len(PROMPTS[0]):])
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and choice.text.startswith(PROMPTS[0])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = reference_logprobs(ids)
    got = np.array(lp.token_logprobs[1:])
    expected = np.array([want[i - 1, ids[i]] for i in range(1, len(ids))])
    assert np.abs(got - expected).max() < tolerance(server), np.abs(got - expected).max()
    for i in range(len(prompt), len(ids)):  # greedy: each generated token is the most likely one
        assert lp.token_logprobs[i] == max(lp.top_logprobs[i].values())
        assert len(lp.top_logprobs[i]) == 3
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))


def test_echo_with_no_tokens_answers_a_list_of_prompts(server):
    tok = smollm2_tokenizer()
    batch = [PROMPTS[0], tok.encode(PROMPTS[1])]
    out = server.client().completions.create(model="smollm2", prompt=batch, max_tokens=0, echo=True, logprobs=1)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 0
    for choice, text in zip(out.choices, PROMPTS, strict=True):
        ids = tok.encode(text)
        assert choice.text == text and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(ids)
        want = reference_logprobs(ids)
        got = np.array(choice.logprobs.token_logprobs[1:])
        assert np.abs(got - [want[i - 1, ids[i]] for i in range(1, len(ids))]).max() < tolerance(server)
    assert out.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)


def test_n_seeded_choices_are_reproducible_and_best_of_picks_the_likeliest(server):
    client = server.client()
    args = dict(model="smollm2", prompt="My favourite food is", max_tokens=5, temperature=1.0, seed=7)
    first = client.completions.create(n=3, logprobs=0, **args)
    again = client.completions.create(n=3, logprobs=0, **args)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and texts == [c.text for c in again.choices]
    alone = [client.completions.create(**{**args, "seed": 7 + i}).choices[0].text for i in range(3)]
    assert alone == texts
    best = client.completions.create(n=1, best_of=3, **args)
    sums = [sum(c.logprobs.token_logprobs) for c in first.choices]
    assert len(best.choices) == 1 and best.choices[0].text == texts[int(np.argmax(sums))]
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)


def test_chat_logprobs_streamed_and_whole_agree(server):
    client = server.client()
    args = dict(model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=6,
                temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**args).choices[0]
    streamed = [c.choices[0] for c in client.chat.completions.create(stream=True, **args) if c.choices]
    content = [e for c in streamed if c.logprobs is not None for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in content] == [(e.token, e.logprob) for e in whole.logprobs.content] \
        or server.kind == "reference"  # the reference engine's BLAS rounds by batch shape
    assert "".join(e.token for e in whole.logprobs.content) == whole.message.content
    for e in whole.logprobs.content:
        assert bytes(e.bytes).decode() == e.token and len(e.top_logprobs) == 3
        assert e.logprob == e.top_logprobs[0].logprob  # greedy


def test_logit_bias_and_frequency_penalty_shape_the_output(server):
    client = server.client()
    tok = smollm2_tokenizer()
    paris = tok.encode(" Paris")[0]
    out = client.completions.create(model="smollm2", prompt="Hello", max_tokens=4, logit_bias={str(paris): 100})
    assert out.choices[0].text == " Paris" * 4
    prompt = "1 1 1 1 1 1 1 1"
    plain = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8).choices[0].text
    penalized = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8,
                                          frequency_penalty=2.0).choices[0].text
    assert plain.count("1") > penalized.count("1")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="x", logit_bias={"999999": 1})
    assert "logit_bias" in str(e.value)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict:
    """A tiny checkpoint folder and its Unweight container (``test_serve_disagg_fast.py``'s)."""
    pytest.importorskip("torch")
    from tests.test_serve_disagg_fast import ENV
    from tests.tiny_checkpoint import tiny_checkpoint_and_container

    return tiny_checkpoint_and_container(tmp_path_factory.mktemp("logprobs"), ENV)


def logprob_answers(server: Server) -> list:
    client = server.client()
    out = [client.completions.create(model="smollm2", prompt=["Hello, tiny model!", "What is 2 + 2?"], max_tokens=8,
                                     temperature=0, logprobs=5, echo=True).model_dump()["choices"]]
    out.append(client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, logprobs=True, top_logprobs=5).model_dump()["choices"])
    out.append(client.completions.create(  # sampled, every adjustment on, logprobs of what was drawn
        model="smollm2", prompt="Hello", max_tokens=8, temperature=0.9, seed=11, logprobs=2, frequency_penalty=1.0,
        presence_penalty=0.5, logit_bias={"3": 5}, extra_body={"repetition_penalty": 1.3, "min_p": 0.02}
    ).model_dump()["choices"])
    out.append(client.completions.create(model="smollm2", prompt=["Hello", "What is"], max_tokens=0, echo=True,
                                         logprobs=1).model_dump()["choices"])  # lm-eval's loglikelihood request
    if importlib.util.find_spec("llguidance") is not None:  # a grammar over the tiny model's random logits
        out.append(client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=24, logprobs=True,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
                "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
        ).model_dump()["choices"])
    return out


def test_logprobs_are_bit_identical_plain_compressed_colocated_pd_and_pipeline(tiny_models):
    """Plain vs compressed weights, colocated vs P/D (REQUEST revision 3 carries logprobs, prompt logprobs,
    penalties, logit_bias, min_p and a grammar; the workers send the logprobs back) vs a pipeline of 2 stages:
    the same bits."""
    answers = []
    for weights, extra in (("plain", ()), ("compressed", ("--compressed",)),
                           ("plain", ("--prefill-workers", "1", "--decode-workers", "1")),
                           ("plain", ("--pipeline", "2"))):
        server = Server("--model", str(tiny_models[weights]), "--served-model-name", "smollm2", "--engine", "fast",
                        *extra)
        try:
            answers.append(logprob_answers(server))
            if "--prefill-workers" in extra:
                out = server.client().completions.create(model="smollm2", prompt="Hello, tiny model!",
                                                         max_tokens=8, n=2)
                colocated = answers[0][0][0]["text"][len("Hello, tiny model!"):]
                assert [c.text for c in out.choices] == [colocated, colocated]
        finally:
            assert server.close() == 0
    assert answers[0][0][0]["logprobs"]["token_logprobs"][0] is None  # echo: the prompt's, the first null
    assert answers[0][3][0]["text"] == "Hello" and len(answers[0][3][0]["logprobs"]["tokens"]) >= 1
    assert answers[0] == answers[1]  # plain = compressed
    assert answers[0] == answers[2]  # colocated = P/D
    assert answers[0] == answers[3]  # colocated = a pipeline of 2 stages (every prompt row from the last stage)
