"""Structured output and tool calls through the real server (``python -m serve``, real processes), driven by the
official ``openai`` client, on SmolLM2-135M-Instruct (fast engine), colocated and with a prefill and a decode
worker (the grammar travels in REQUEST revision 3; each worker masks with its own matcher).

- ``chat.completions.parse`` with a pydantic model returns a valid object for 20 of 20 prompts (flat models: with
  a ``list[str]`` field this 135M model, greedy, repeats list items until max_tokens on most book prompts).
- ``response_format`` ``json_object`` answers JSON (or a prefix of it, cut by max_tokens).
- A tool call round trip: ``tool_choice`` "required" answers ``tool_calls`` (finish_reason "tool_calls") whose
  arguments match the function's schema; the call and the tool's result sent back are accepted and answered;
  a named choice streamed comes as one ``tool_calls`` delta.
- Refusals name the field: a schema the grammar engine refuses, tools on /v1/completions, a forced call
  together with a JSON response_format, the deprecated ``functions``.
"""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
pytest.importorskip("torch")

from tests.test_serve_disagg import Server  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}


class Person(pydantic.BaseModel):
    name: str
    age: int
    city: str


class Book(pydantic.BaseModel):
    title: str
    year: int
    genre: str


FACTS = [("Alice is 30 and lives in Paris.", Person), ("Bob, 41, moved to Berlin last year.", Person),
         ("Chen is a 25 year old engineer from Shanghai.", Person), ("Dana (age 67) lives in Lima.", Person),
         ("Eve is twelve and lives in Oslo.", Person), ("Frank lives in Rome; he is 52.", Person),
         ("Gita, 19, studies in Mumbai.", Person), ("Hugo is 88 and lives in Lyon.", Person),
         ("Ines, a 33 year old doctor, lives in Madrid.", Person), ("Jon is 7 and lives in Reykjavik.", Person),
         ("Dune was published in 1965; it is science fiction.", Book),
         ("Emma, a romance novel, came out in 1815.", Book),
         ("The Hobbit (1937) is a fantasy book.", Book), ("Dracula, 1897, is a gothic horror novel.", Book),
         ("Neuromancer is a 1984 cyberpunk novel.", Book), ("Ulysses was published in 1922, a modernist novel.", Book),
         ("Beloved (1987) is historical fiction.", Book), ("It is a horror novel from 1986.", Book),
         ("Matilda, a children's book, came out in 1988.", Book), ("Hamlet is a tragedy from 1603.", Book)]


@pytest.fixture(scope="module", params=["colocated", "pd"])
def server(request):
    pd = ("--prefill-workers", "1", "--decode-workers", "1") if request.param == "pd" else ()
    s = Server("--engine", "fast", "--max-num-seqs", "8", *pd, timeout=300)
    yield s
    assert s.close() == 0


def test_parse_with_a_pydantic_model_gives_a_valid_object_for_every_prompt(server):
    client = server.client()
    valid = 0
    for fact, model in FACTS:
        r = client.chat.completions.parse(model="smollm2", response_format=model, max_tokens=80,
                                          messages=[{"role": "user", "content": f"{fact} Extract the details."}])
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, model)
        valid += 1
    assert valid == len(FACTS) == 20


def test_json_object_is_json(server):
    r = server.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "A cat named Tom, as JSON."}],
        response_format={"type": "json_object"}, max_tokens=200, seed=1, temperature=0.7)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_a_tool_call_round_trip(server):
    client = server.client()
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, CLOCK],
                                       tool_choice="required", max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str)
    if call.function.name == "get_weather":
        assert args["unit"] in ("C", "F") and set(args) == {"city", "unit"}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, CLOCK], max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    stream = client.chat.completions.create(model="smollm2", messages=messages[:1], tools=[WEATHER, CLOCK],
                                            tool_choice={"type": "function", "function": {"name": "get_time"}},
                                            max_tokens=60, stream=True)
    chunks = list(stream)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_time"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)  # (its schema allows more keys)


def test_refusals_name_the_field(server):
    client = server.client()
    msgs = [{"role": "user", "content": "Hi"}]
    cases = [
        (dict(messages=msgs, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}),
         "response_format", "nowhere"),
        (dict(messages=msgs, response_format={"type": "xml"}), "response_format", "json_schema"),
        (dict(messages=msgs, tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
         "response_format", "forced tool call"),
        (dict(messages=msgs, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice", "one of the tools"),
        (dict(messages=msgs, functions=[WEATHER["function"]]), "functions", "not supported"),
    ]
    for kwargs, field, needle in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2", max_tokens=4, **kwargs)
        assert field in str(e.value) and needle in str(e.value), str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=4, extra_body={"tools": [WEATHER]})
    assert "chat field" in str(e.value)
    r = client.completions.create(model="smollm2", prompt="A JSON object about Paris:", max_tokens=40,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.startswith("{")


def test_vllm_guided_fields_and_openai_fields_that_would_be_ignored(server):
    client = server.client()
    msgs = [{"role": "user", "content": "Is the sky blue?"}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8,
                                       extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert r.choices[0].message.content in ("yes", "no", "it depends")
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12,
                                       extra_body={"guided_regex": r"(Yes|No)\. [0-9]{2}"})
    assert re.fullmatch(r"(Yes|No)\. [0-9]{2}", r.choices[0].message.content)
    r = client.completions.create(model="smollm2", prompt="Alice is 30. As JSON:", max_tokens=30,
                                  extra_body={"guided_json": {"type": "object", "properties": {"age": {
                                      "type": "integer"}}, "required": ["age"], "additionalProperties": False}})
    assert r.choices[0].finish_reason == "length" or set(json.loads(r.choices[0].text)) == {"age"}
    for extra, field in (({"reasoning_effort": "high"}, "reasoning_effort"), ({"store": True}, "store"),
                         ({"modalities": ["text", "audio"]}, "modalities"), ({"min_tokens": 3}, "min_tokens"),
                         ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
                         ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, extra_body=extra)
        assert field in str(e.value)
    ok = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, store=False,
                                        service_tier="auto", extra_body={"skip_special_tokens": True})
    assert ok.choices[0].message.content is not None
