"""Structured output in the sampler (reference/engine/grammar.py): a grammar's mask over SmolLM2's
vocabulary, for any logits.

- Property (hypothesis): whatever the logits (random, any seed, greedy or sampled, with penalties), a
  request constrained by a JSON schema or a regular expression only ever draws tokens the grammar
  allows, and what it draws, once the grammar says complete, parses and matches.
- A matcher rebuilt from the tokens so far (a decode worker, a migrated request) allows exactly what
  the one that sampled them allows.
- The engines: the reference engine's greedy JSON answer to a real prompt is the fast engine's, and
  valid; a refused schema, a grammar with ``ignore_eos``, and no llguidance are clear errors.
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("llguidance")

from reference.engine import grammar  # noqa: E402
from reference.engine.params import SamplingParams, SamplingParamsError  # noqa: E402
from reference.engine.sampling import sample  # noqa: E402
from tests.smollm import smollm2_tokenizer  # noqa: E402

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"(yes|no|maybe) [0-9]{1,3}"


def ll() -> object:
    return grammar.grammar_tokenizer(smollm2_tokenizer(), VOCAB)


def run(text: str, params: SamplingParams, seed: int, steps: int = 60) -> tuple[list[int], bool]:
    """Sample up to ``steps`` tokens from random logits (stream ``seed``) under the grammar; returns
    the tokens before the end-of-sequence token and whether it came."""
    c = grammar.Constraint(text, ll(), VOCAB)
    rng = np.random.default_rng(seed)
    eos = smollm2_tokenizer().eos_token_ids
    out: list[int] = []
    for position in range(steps):
        logits = rng.normal(0, 4, VOCAB).astype(np.float32)
        allowed = c.allowed()
        token = sample(logits, params, seed, position, (), out, allowed)
        assert allowed[token], (position, token)
        if token in eos:
            return out, True
        c.advance(token)
        out.append(token)
    return out, False


params_strategy = st.builds(
    lambda t, k, p, f: SamplingParams(max_tokens=64, temperature=t, top_k=k, top_p=p, frequency_penalty=f),
    st.sampled_from([0.0, 0.7, 1.5]), st.sampled_from([0, 5, 50]), st.sampled_from([1.0, 0.9]),
    st.sampled_from([0.0, 1.0]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), params=params_strategy)
def test_any_logits_under_a_json_schema_give_a_document_of_the_schema(seed: int, params: SamplingParams) -> None:
    tokens, ended = run(grammar.json_schema_grammar(SCHEMA), params, seed, steps=80)
    text = smollm2_tokenizer().decode(tokens)
    if ended:  # the end-of-sequence token is allowed only once the document is whole
        doc = json.loads(text)
        assert set(doc) == {"name", "age", "tags"} and isinstance(doc["age"], int) and 0 <= doc["age"] <= 130
        assert len(doc["name"]) <= 12 and set(doc["tags"]) <= {"a", "b"} and len(doc["tags"]) <= 3
        assert text == json.dumps(doc, ensure_ascii=False)  # compact: ", " and ": " separators, no other whitespace
    else:  # cut short: still a prefix of such a document
        assert text.startswith('{"name": "')


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), params=params_strategy)
def test_any_logits_under_a_regex_give_a_match(seed: int, params: SamplingParams) -> None:
    tokens, ended = run(grammar.regex_grammar(REGEX), params, seed)
    assert ended  # the regex is short: it always completes
    assert re.fullmatch(REGEX, smollm2_tokenizer().decode(tokens))


def test_a_matcher_rebuilt_from_the_tokens_allows_what_the_sampler_allowed() -> None:
    text = grammar.json_schema_grammar(SCHEMA)
    tok = smollm2_tokenizer()
    ids = tok.encode('{"name": "Ann", "age": 4')
    walked = grammar.Constraint(text, ll(), VOCAB)
    for i, t in enumerate(ids):
        rebuilt = grammar.Constraint(text, ll(), VOCAB, tokens=ids[:i])
        assert np.array_equal(rebuilt.allowed(), walked.allowed())
        walked.advance(t)
    assert not walked.complete


def test_refusals_name_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = grammar.json_schema_grammar({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(grammar.GrammarError, match="nowhere"):
        grammar.check(bad, ll())
    with pytest.raises(grammar.GrammarError, match="must be an object"):
        grammar.json_schema_grammar(["not", "a", "schema"])
    with pytest.raises(SamplingParamsError, match="ignore_eos"):
        SamplingParams(grammar=grammar.json_object_grammar(), ignore_eos=True)
    with pytest.raises(SamplingParamsError, match="grammar"):
        SamplingParams(grammar="")
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(grammar.GrammarError, match=r"pip install -e '\.\[structured\]'"):
        grammar.json_object_grammar()


def test_both_engines_answer_the_same_valid_json() -> None:
    pytest.importorskip("torch")
    from fast.engine import Engine as FastEngine
    from reference.engine.engine import Engine
    from reference.engine.params import RequestRejected
    from tests.smollm import smollm2_model

    tok = smollm2_tokenizer()
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(max_tokens=24, grammar=grammar.json_schema_grammar(schema))
    prompt = tok.encode_chat([{"role": "user", "content": "Alice is 30. Give her name and age as JSON."}])
    ref = Engine(smollm2_model(), tokenizer=tok, num_blocks=16, max_num_seqs=2)
    fast = FastEngine.load("smollm2", dtype="float32", num_blocks=16, max_num_seqs=2)
    a, b = ref.generate([prompt], params)[0], fast.generate([prompt], params)[0]
    assert a.finish_reason == "stop" and json.loads(a.text) == {"name": "Alice", "age": 30}
    assert a.output_token_ids == b.output_token_ids
    bad = SamplingParams(max_tokens=4, grammar=grammar.json_schema_grammar({"$ref": "#/x"}))
    with pytest.raises(RequestRejected, match="grammar"):
        ref.add_request(prompt, bad)
    assert not ref.has_unfinished()


def test_tool_calls_are_read_from_the_answer_and_written_back_into_the_prompt() -> None:
    from serve.structured import parse_tools, tool_calls_of, tool_messages

    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    tools = parse_tools({"tools": [fn]})
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><tool_call>{"name": "f", ' \
           '"arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call><tool_call>{oops'
    content, calls = tool_calls_of(text, tools)
    assert content == "Sure." and [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": 1}, {}]
    assert len(tool_calls_of(text, parse_tools({"tools": [fn], "parallel_tool_calls": False}))[1]) == 1
    assert tool_calls_of("no call here", tools) == ("no call here", [])
    raw = [{"role": "user", "content": "hi"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    clean = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
             {"role": "tool", "content": "42"}]
    out = tool_messages(clean, raw, tools)
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"] and '"name": "f"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    assert tool_messages(clean, raw, parse_tools({"tools": [fn], "tool_choice": "none"}))[0]["role"] == "user"
