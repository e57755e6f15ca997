"""Structured output and tool calls in the OpenAI API, as grammars for the engine's sampler.

``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
{"schema": …}}`` becomes the grammar of (schema-valid) compact JSON; the engine masks the logits by
it at every step (reference/engine/grammar.py, llguidance), so the answer parses whatever the model.

``tools``: the function definitions are written into the system message in the Hermes convention
most open chat models are trained on (SmolLM2's template has no tool syntax of its own): the
signatures inside ``<tools></tools>``, a call answered as ``<tool_call>{"name": …, "arguments":
{…}}</tool_call>``, a tool's result sent back inside ``<tool_response></tool_response>``. With
``tool_choice`` ``"required"`` or a named function the call is forced by a grammar (the name one
of the tools', the arguments valid for its ``parameters`` schema); with ``"auto"`` the model
chooses and the answer is searched for calls; ``"none"`` leaves the tools out of the prompt. Calls
come back as ``message.tool_calls`` with ``finish_reason`` ``"tool_calls"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from reference.engine import grammar
from serve.errors import ApiError, bad

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


@dataclass(frozen=True)
class Tools:
    """A chat request's tools: the function definitions and how the model may use them."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description", "parameters"}
    choice: str  # "auto", "required", "none", or the name of the function it must call
    forced: bool  # a call is forced by a grammar ("required" or a named function)
    parallel: bool = True  # parallel_tool_calls: false answers the first call only

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}


GUIDED = ("guided_json", "guided_regex", "guided_choice")  # vLLM's structured-output extensions


def grammar_of(field: str, value: Any) -> str | None:
    """The grammar of ``response_format`` or of one of vLLM's ``guided_*`` fields (None: free text)."""
    if field == "response_format":
        return response_format_grammar(value)
    try:
        if field == "guided_json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise bad(field, "must be a JSON schema (an object, or its JSON text)") from None
            return grammar.json_schema_grammar(value)
        if field == "guided_regex":
            if not isinstance(value, str) or not value:
                raise bad(field, "must be a non-empty regular expression")
            return grammar.regex_grammar(value)
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad(field, "must be a non-empty list of non-empty strings")
        return grammar.lark_grammar("start: " + " | ".join(json.dumps(c) for c in value))
    except grammar.GrammarError as e:
        raise bad(field, str(e)) from None


def response_format_grammar(value: Any) -> str | None:
    """The grammar of ``response_format`` (None: free text)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("response_format", 'must be {"type": "text"}, {"type": "json_object"} or '
                  '{"type": "json_schema", "json_schema": {"name": …, "schema": {…}}}')
    kind = value["type"]
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return grammar.json_object_grammar()
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad("response_format", 'json_schema: must be an object {"name": …, "schema": {…}}')
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad("response_format", "json_schema.schema: must be a JSON Schema object")
        return grammar.json_schema_grammar(schema)
    except grammar.GrammarError as e:
        raise bad("response_format", str(e)) from None


def parse_tools(body: dict) -> Tools | None:
    """``tools`` and ``tool_choice`` checked (None: no tools, or ``tool_choice: "none"`` without
    tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise bad("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad("tools", "must be a non-empty list of {\"type\": \"function\", \"function\": {…}}")
    functions = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise bad("tools", f'tools[{i}]: must be {{"type": "function", "function": '
                      '{"name": …, "parameters": {…}}}')
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad("tools", f"tools[{i}].function.parameters: must be a JSON Schema object")
        description = f.get("description", "")
        if not isinstance(description, str):
            raise bad("tools", f"tools[{i}].function.description: must be a string")
        functions.append({"name": f["name"], "description": description, "parameters": params})
    if len({f["name"] for f in functions}) != len(functions):
        raise bad("tools", "two functions have the same name")
    if choice is None:
        choice = "auto"
    parallel = body.get("parallel_tool_calls") is not False
    if isinstance(choice, dict):
        named = choice.get("function", {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(named, str) or named not in {f["name"] for f in functions}:
            raise bad("tool_choice", "a named choice must be {\"type\": \"function\", \"function\": {\"name\": …}} "
                      "with the name of one of the tools")
        return Tools(tuple(functions), named, True, parallel)
    if choice not in ("auto", "required", "none"):
        raise bad("tool_choice", 'must be "auto", "required", "none" or {"type": "function", "function": {"name": …}}')
    return Tools(tuple(functions), choice, choice == "required", parallel)


def tool_grammar(tools: Tools) -> str:
    """The grammar of one forced call: ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``,
    the name one of the allowed functions', the arguments valid for its parameters."""
    allowed = [f for f in tools.functions if tools.choice == "required" or f["name"] == tools.choice]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in allowed]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": grammar.JSON_OPTIONS}
    lark = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'
    try:
        return grammar.lark_grammar(lark)
    except grammar.GrammarError as e:
        raise bad("tools", str(e)) from None


def tool_messages(messages: list[dict], raw: list[Any], tools: Tools | None) -> list[dict[str, str]]:
    """Plain {role, content} messages for the chat template: the tools' signatures in the system
    message, earlier calls and tool results written in the convention above. ``raw``: the request's
    messages (for ``tool_calls`` and ``tool`` roles), ``messages``: their checked contents."""
    out = []
    for clean, m in zip(messages, raw, strict=True):
        if m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{clean['content']}\n</tool_response>"})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in _calls_sent(m["tool_calls"]))
            out.append({"role": "assistant", "content": (clean["content"] + "\n" if clean["content"] else "") + calls})
        else:
            out.append(clean)
    if tools is not None and tools.choice != "none":
        block = TOOLS_PROMPT.format(tools="\n".join(json.dumps({"type": "function", "function": f})
                                                    for f in tools.functions))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _calls_sent(calls: Any) -> list[dict[str, Any]]:
    """An assistant message's earlier ``tool_calls`` as {name, arguments} (arguments parsed)."""
    if not isinstance(calls, list):
        raise bad("messages", "tool_calls: must be a list")
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise bad("messages", 'tool_calls: each must be {"id", "type": "function", "function": {"name", '
                      '"arguments": "<JSON text>"}}')
        try:
            args = json.loads(f["arguments"])
        except ValueError:
            raise bad("messages", f"tool_calls: the arguments of {f['name']!r} are not JSON text") from None
        out.append({"name": f["name"], "arguments": args})
    return out


def tool_calls_of(text: str, tools: Tools) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer's content (before the first call; None if empty) and its well-formed calls of
    known functions, as OpenAI's ``tool_calls``. Text with no such call comes back whole."""
    calls = []
    for m in TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except ValueError:
            continue
        if (isinstance(call, dict) and call.get("name") in tools.names
                and isinstance(call.get("arguments", {}), dict)):
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    if not calls:
        return text, []
    if not tools.parallel:
        calls = calls[:1]
    content = text[:text.index("<tool_call>")].strip()
    return content or None, calls


def check_against(grammar_text: str, tokenizer: Any, field: str) -> None:
    """Refuse (400, naming ``field``) a grammar the engine cannot follow with this tokenizer."""
    try:
        grammar.check(grammar_text, grammar.grammar_tokenizer(tokenizer, tokenizer.vocab_size))
    except grammar.GrammarError as e:
        raise ApiError(400, f"{field}: {e}", param=field, code="invalid_value") from None
