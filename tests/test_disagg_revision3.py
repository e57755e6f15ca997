"""REQUEST revision 3 (reference/disagg/PROTOCOL.md section 3.1) through the coordinator and real workers:
the penalties, min_p, logit_bias, logprobs and prompt logprobs of a request served by a prefill and a decode
worker are the colocated engine's, also when its decode worker is killed mid-request (the new attempt is told
how many of its prompt's tokens it generated, so the penalties count them as output) and when its prefill
worker is gone before its DONE (the decode worker computes the prompt and sends the prompt's logprobs with
its first TOKEN). Older workers are never sent the new fields; a malformed field is refused."""

from __future__ import annotations

import numpy as np
import pytest

from reference.disagg import messages
from reference.disagg.batch import ProcessFaults, run_requests
from reference.disagg.coordinator import CoordinatorError, Worker
from reference.disagg.frames import Kind
from reference.disagg.models import load_model
from reference.disagg.pool import FAST_FAULTS, InProcessPool, WorkerOptions
from reference.engine.engine import Engine
from reference.engine.params import SamplingParams

OPTS = WorkerOptions(num_blocks=128, block_size=8, **FAST_FAULTS)
EXTRA = {"presence_penalty": 0.5, "frequency_penalty": 1.5, "repetition_penalty": 1.3, "min_p": 0.01,
         "logit_bias": [[5, 4.0], [7, -3.0]], "logprobs": 3, "prompt_logprobs": 2}
SAMPLING = {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "seed": 1234}


def workload(n: int, seed: int, max_tokens: int = 12) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"r{i}", "prompt_token_ids": rng.integers(1, 128, size=int(rng.integers(3, 40))).tolist(),
             "max_tokens": max_tokens} for i in range(n)]


def params(max_tokens: int) -> SamplingParams:
    bias = {t: b for t, b in EXTRA["logit_bias"]}
    return SamplingParams(max_tokens=max_tokens, **SAMPLING, logit_bias=bias,
                          **{k: v for k, v in EXTRA.items() if k != "logit_bias"})


def run(pool, requests: list[dict]) -> list[dict]:  # noqa: ANN001
    """Submit with the revision-3 fields and run to the end (``run_requests`` with ``extra``)."""
    coord = pool.coordinator
    for r in requests:
        coord.submit(r["id"], r["prompt_token_ids"], r["max_tokens"], sampling=SAMPLING, extra=EXTRA)
    while coord.unfinished():
        pool.pump()
    return [coord.requests[r["id"]] for r in requests]


def check_colocated(requests: list[dict], served: list) -> None:
    engine = Engine(load_model("tiny"), num_blocks=128, block_size=8)
    for r, req in zip(requests, served, strict=True):
        want = engine.generate([r["prompt_token_ids"]], params(r["max_tokens"]))[0]
        assert req.result["error"] is None
        assert req.result["output_token_ids"] == want.output_token_ids
        same(req.logprobs, want.logprobs)
        same(list(req.prompt_logprobs), want.prompt_logprobs)


def same(got: list, want: list) -> None:
    """The same tokens and alternatives, logprobs within 1e-4 nats: the NumPy runner's float32 sums
    depend on how the rows were chunked (the fast engine's CPU products do not: bit-identical there,
    tests/test_api_logprobs.py)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert g.token_id == w.token_id and [t for t, _ in g.top] == [t for t, _ in w.top]
        assert abs(g.logprob - w.logprob) < 1e-4
        assert np.allclose([v for _, v in g.top], [v for _, v in w.top], atol=1e-4, rtol=0)


def test_penalties_logprobs_and_prompt_logprobs_are_the_colocated_engines():
    requests = workload(4, seed=3)
    with InProcessPool("tiny", 1, 1, opts=OPTS) as pool:
        check_colocated(requests, run(pool, requests))


def test_a_migrated_request_keeps_counting_its_tokens_as_output():
    requests = workload(5, seed=7)
    with InProcessPool("tiny", 1, 2, opts=OPTS) as pool:
        ProcessFaults(pool, ["kill-decode"], 0, len(requests))
        served = run(pool, requests)
        assert any(q.attempts == 2 and q.offset >= 2 for q in served)
        check_colocated(requests, served)


def test_with_no_prefill_worker_the_decode_worker_sends_the_prompts_logprobs():
    requests = workload(4, seed=11)
    with InProcessPool("tiny", 0, 1, opts=OPTS) as pool:  # as after its prefill worker died before DONE
        served = run(pool, requests)
        assert all(q.recomputed for q in served)
        check_colocated(requests, served)


def test_old_workers_are_not_sent_the_new_fields_and_bad_ones_are_refused():
    with InProcessPool("tiny", 1, 1, opts=OPTS) as pool:
        coord = pool.coordinator
        for bad, needle in (({"logit_bias": [[1, 500.0]]}, "logit_bias"), ({"frequency_penalty": 3}, "frequency"),
                            ({"grammar": ""}, "grammar"), ({"colour": 1}, "extra")):
            with pytest.raises(CoordinatorError, match=needle):
                coord.submit("x", [1, 2, 3], 4, extra=bad)
        old = Worker(99, "decode", None, 8, 8, revision=2)
        coord.workers[99] = old
        with pytest.raises(CoordinatorError, match="before 3"):
            coord.submit("y", [1, 2, 3], 4, extra={"logprobs": 1})
        del coord.workers[99]
        assert run_requests(pool, [{"id": "z", "prompt_token_ids": [1, 2, 3], "max_tokens": 3}])[0]["error"] is None
    for body in ({"index": 0, "token": 1, "cpu_us": 0, "logprob": 0.5},  # a logprob > 0
                 {"index": 0, "token": 1, "cpu_us": 0, "logprob": -1.0, "top": [1]},  # odd pairs
                 {"index": 0, "token": 1, "cpu_us": 0, "prompt_logprobs": [float("nan")]}):
        with pytest.raises(messages.MessageError):
            messages.check(Kind.TOKEN, body)


def test_a_workers_grammar_counts_a_migrated_prompts_generated_tokens_as_output():
    """``generated`` = k: the prompt's last k tokens were the request's own output, so the worker's matcher has
    consumed them (and the penalties count them) before it picks: the token is the colocated engine's."""
    pytest.importorskip("llguidance")
    from types import SimpleNamespace

    from reference.disagg.worker_base import WorkerBase
    from reference.engine import grammar
    from reference.engine.sampling import sample
    from tests.smollm import smollm2_tokenizer

    tok, vocab = smollm2_tokenizer(), 49152
    text = grammar.json_schema_grammar({"type": "object", "properties": {"name": {"type": "string"}},
                                        "required": ["name"]})
    prompt, done = tok.encode("Say a name as JSON:"), tok.encode('{"name": "Bo')
    worker = WorkerBase()
    worker.model, worker.model_spec = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab)), "smollm2"
    rng = np.random.default_rng(5)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=9, frequency_penalty=1.0, grammar=text, logprobs=1)
        st = SimpleNamespace(params=params, generated=len(done), constraint=None)
        seq = SimpleNamespace(num_prompt_tokens=len(prompt + done), prompt_token_ids=prompt + done,
                              output_token_ids=[], num_tokens=len(prompt + done))
        logits = rng.normal(0, 3, vocab).astype(np.float32)
        token, lp = worker.pick(st, seq, logits)
        allowed = grammar.Constraint(text, grammar.grammar_tokenizer(tok, vocab), vocab, tokens=done).allowed()
        assert token == sample(logits, params, 9, len(prompt + done), prompt, done, allowed)
        fresh = grammar.Constraint(text, grammar.grammar_tokenizer(tok, vocab), vocab).allowed()
        assert allowed[token] and not fresh[token]  # a token inside the string: not what an empty answer allows
        assert lp is not None and lp.token_id == token
