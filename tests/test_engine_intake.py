"""Request intake of the engine (issue 13, items 6-8), from the user's side of the API: a whole
``generate`` call is checked before anything is queued, generated ids never collide with ids a caller
chose, and a wrong type is an ``EngineError`` naming the field, with nothing queued.

A tiny random Llama model keeps it fast: intake does not depend on what the model says.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.engine import Engine, EngineError, SamplingParams, SamplingParamsError
from reference.model.config import LlamaConfig
from reference.model.llama import LlamaModel
from reference.model.loader import LayerWeights, LlamaWeights

VOCAB = 50


def tiny_model() -> LlamaModel:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=64,
                      tie_embeddings=True, eos_token_ids=(0,))
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    layer = LayerWeights(attn_norm=np.ones(16, np.float32), wq=w(16, 16), wk=w(8, 16), wv=w(8, 16), wo=w(16, 16),
                         mlp_norm=np.ones(16, np.float32), w_gate=w(32, 16), w_up=w(32, 16), w_down=w(16, 32))
    emb = w(VOCAB, 16)
    return LlamaModel(cfg, LlamaWeights(embedding=emb, layers=[layer], final_norm=np.ones(16, np.float32),
                                        lm_head=emb))


MODEL = tiny_model()


def engine(**kw: object) -> Engine:
    return Engine(MODEL, None, **({"num_blocks": 16, "block_size": 4} | kw))


def assert_nothing_queued(eng: Engine) -> None:
    assert not eng.requests and not eng.has_unfinished() and not eng.scheduler.waiting


OK = [1, 2, 3]
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize(("prompts", "kwargs", "words"), [
    ([OK, OK, [VOCAB]], {}, "prompt 2: prompt token ids must be in"),
    ([OK, OK, None], {}, "prompt 2: prompt must be a str or a list of token ids, not NoneType"),
    ([OK, "text without a tokenizer"], {}, "prompt 1: a text prompt needs an engine with a tokenizer"),
    ([OK, OK], {"request_id": "same"}, "prompt 1: request id 'same' is already in use"),
    ([OK, OK], {"tenant": "nobody"}, "unknown tenant"),
    ([OK, [1] * 64], {}, "prompt 1: prompt of 64 tokens is too long"),
    ([OK], {"priority": 3}, "unknown arguments ['priority']"),
    ("a string", {}, "prompts must be a list of prompts, not str"),
])
def test_generate_checks_the_whole_call_before_queuing_any(prompts: object, kwargs: dict, words: str) -> None:
    """Item 6: the good prompts of a failed call are not left queued (to run unseen and never return)."""
    from reference.sched import Tenants

    eng = engine(tenants=Tenants({"alice": "paid"}), policy="wfq") if "tenant" in kwargs else engine()
    with pytest.raises(EngineError) as e:
        eng.generate(prompts, PARAMS, **kwargs)
    assert words in str(e.value)
    assert_nothing_queued(eng)
    outs = eng.generate([OK, (4, 5)], PARAMS, **({"tenant": "alice"} if "tenant" in kwargs else {}))
    assert [o.request_id for o in outs] == ["0", "1"] and all(len(o.output_token_ids) == 3 for o in outs)
    assert not eng.has_unfinished() and set(eng.requests) == {"0", "1"}


def test_generate_with_bad_params_queues_nothing() -> None:
    eng = engine()
    for params in ({"max_tokens": 0}, {"nonsense": 1}, "greedy"):
        with pytest.raises(SamplingParamsError):
            eng.generate([OK, OK], params)
        assert_nothing_queued(eng)


def test_generated_ids_skip_ids_the_caller_chose() -> None:
    """Item 7: `add_request(p, request_id="1")` then `add_request(p)` twice used to fail."""
    eng = engine()
    assert eng.add_request(OK, PARAMS, request_id="1") == "1"
    assert eng.add_request(OK, PARAMS) == "2"  # request number 1, but "1" is taken
    assert eng.add_request(OK, PARAMS) == "3"
    assert eng.add_request(OK, PARAMS, request_id=7) == "7"  # an int id is stored as its string
    assert [o.request_id for o in eng.generate([OK, OK], PARAMS)] == ["5", "6"]
    assert eng.add_request(OK, PARAMS) == "8"  # not "7"
    with pytest.raises(EngineError, match="'2' is already in use"):
        eng.add_request(OK, PARAMS, request_id="2")
    assert sorted(eng.requests) == ["1", "2", "3", "5", "6", "7", "8"]


@given(st.lists(st.one_of(st.none(), st.integers(0, 8).map(str)), max_size=25))
def test_ids_stay_distinct_and_only_a_taken_caller_id_is_refused(ops: list[str | None]) -> None:
    eng = engine(num_blocks=64)
    for op in ops:
        if op is not None and op in eng.requests:
            with pytest.raises(EngineError, match="already in use"):
                eng.add_request(OK, PARAMS, request_id=op)
        else:  # a generated id, or a free caller id: never refused
            rid = eng.add_request(OK, PARAMS, request_id=op)
            assert op is None or rid == op
    assert len(eng.scheduler.waiting) == len(eng.requests)  # each accepted request queued once


BAD_REQUESTS = [
    ({"prompt": None}, "prompt must be a str or a list of token ids, not NoneType"),
    ({"prompt": b"hello"}, "not bytes"),
    ({"prompt": bytearray(b"hi")}, "not bytes"),
    ({"prompt": 7}, "not int"),
    ({"prompt": {1: 2}}, "not dict"),
    ({"prompt": (t for t in OK)}, "not generator"),
    ({"prompt": np.array([[1, 2]])}, "not ndarray"),
    ({"prompt": [1.0, 2.0]}, "must be integers"),
    ({"params": {"stop_token_ids": 5}}, "stop_token_ids=5"),
    ({"params": {"stop_token_ids": "5"}}, "stop_token_ids='5'"),
    ({"params": {"stop_token_ids": [True]}}, "stop_token_ids"),
    ({"params": {"temperature": True}}, "temperature=True"),
    ({"params": {"top_p": True}}, "top_p=True"),
    ({"params": {"top_p": math.nan}}, "top_p=nan"),
    ({"params": {"max_tokens": 2.0}}, "max_tokens=2.0"),
    ({"params": {"ignore_eos": "no"}}, "ignore_eos='no'"),
    ({"params": 0.5}, "params must be SamplingParams"),
    ({"request_id": ["a"]}, "request_id=['a']"),
    ({"tenant": None}, "tenant=None"),
    ({"arrival_time": math.inf}, "arrival_time=inf"),
    ({"cache_salt": 5}, "cache_salt=5"),
    ({"predicted_output_len": 2.5}, "predicted_output_len=2.5"),
]


@pytest.mark.parametrize(("kwargs", "words"), BAD_REQUESTS)
def test_wrong_types_are_engine_errors_naming_the_field(kwargs: dict, words: str) -> None:
    """Item 8: a TypeError from deep inside, or silent acceptance, before."""
    eng = engine()
    prompt, params = kwargs.pop("prompt", OK), kwargs.pop("params", PARAMS)
    with pytest.raises(EngineError) as e:
        eng.add_request(prompt, params, **kwargs)
    assert words in str(e.value)
    assert_nothing_queued(eng)


def test_accepted_prompt_and_param_types() -> None:
    eng = engine()
    for prompt in (OK, tuple(OK), np.array(OK, np.int32), range(1, 4), [np.int64(1), 2]):
        eng.add_request(prompt, {"stop_token_ids": np.array([4, 5]), "temperature": np.float32(0.5), "max_tokens": 2})
    assert len(eng.requests) == 5
    assert eng.requests["0"].params.stop_token_ids == (4, 5)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"max_model_len": 0}, "max_model_len=0"),
    ({"max_model_len": 2.5}, "max_model_len=2.5"),
    ({"num_blocks": 0}, "num_blocks=0"),
    ({"block_size": True}, "block_size=True"),
    ({"max_num_seqs": -1}, "max_num_seqs=-1"),
    ({"max_num_batched_tokens": None}, "max_num_batched_tokens=None"),
    ({"seed": -1}, "seed=-1"),
])
def test_engine_arguments_are_checked(kwargs: dict, words: str) -> None:
    with pytest.raises(EngineError, match=words.replace("[", r"\[")):
        engine(**kwargs)
    assert engine(max_model_len=8).max_model_len == 8


def test_output_of_an_unknown_request() -> None:
    eng = engine()
    for rid in ("unknown", 0, None):
        with pytest.raises(EngineError, match="no request has the id") as e:
            eng.output(rid)
        assert isinstance(e.value, KeyError)  # code that caught the KeyError still does


def test_release_forgets_only_finished_requests() -> None:
    """A long-running server releases each request once answered, so the engine does not grow forever."""
    eng = engine()
    done = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    running = eng.add_request([4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    with pytest.raises(EngineError, match="has not finished"):
        eng.release(running)
    assert eng.release(done.request_id).output_token_ids == done.output_token_ids
    assert done.request_id not in eng.requests
    with pytest.raises(EngineError, match="no request has the id"):
        eng.release(done.request_id)
    assert eng.abort(running) and eng.release(running).finish_reason == "abort"
    assert eng.requests == {} and not eng.has_unfinished()
