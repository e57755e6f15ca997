"""The OpenAI request bodies we accept, checked field by field, and the error body we answer with.

Every check names the field it rejects (``param`` in the error body, as OpenAI does), so a client
sees ``temperature: must be a number in [0, 2]`` instead of a stack trace. Fields that change the
output and that we do not implement (``UNSUPPORTED``: ``suffix``, the deprecated ``functions``, ...)
are refused rather than silently ignored; fields that do not (``user``, ``metadata``) are accepted.
Supported beyond the basics: ``n``, ``best_of``, ``logprobs`` (completions: k; chat: true, with
``top_logprobs`` k), ``echo``, a list of prompts, ``presence_penalty``, ``frequency_penalty``,
``logit_bias``, ``response_format`` and (chat) ``tools`` / ``tool_choice`` (serve/structured.py), and
vLLM's extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``.
Text that reaches the tokenizer (the prompt, message contents, stop strings) must be valid Unicode:
JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer can encode, so it is
refused naming the field and the position.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reference.engine.params import SamplingParams, SamplingParamsError
from serve import structured
from serve.errors import ApiError, bad

MAX_STOPS = 4
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's chat limit, vLLM's default max_logprobs)
MAX_CHOICES = 16  # n, best_of
MAX_PROMPTS = 64  # prompts in one completions request


@dataclass(frozen=True)
class Parsed:
    """A checked request: the prompt (text or token ids), how to sample, and how to answer."""

    prompt: str | list[int]  # the first prompt (chat: the messages)
    prompt_field: str  # "prompt" or "messages", for errors about the prompt
    max_tokens: int | None  # None: up to the end of the context; 0: none (echo only)
    params: dict[str, Any]  # SamplingParams fields other than max_tokens
    stop: list[str]
    stream: bool
    include_usage: bool
    prompts: tuple[Any, ...] = ()  # every prompt of a completions request, in order (() : just prompt)
    n: int = 1  # choices answered per prompt
    best_of: int = 1  # choices generated per prompt, the n with the highest cumulative logprob answered
    echo: bool = False  # completions: the prompt comes back before the completion (and its logprobs)
    logprobs: int | None = None  # alternatives reported per token (None: no logprobs)
    grammar_field: str | None = None  # the field params["grammar"] came from (response_format, tools)
    tools: Any = None  # chat: structured.Tools (None: no tools)

    @property
    def all_prompts(self) -> tuple[Any, ...]:
        return self.prompts or (self.prompt,)


UNSUPPORTED = {  # field -> the value that means "off"
    "suffix": None, "functions": None, "function_call": None,  # the last two: deprecated, use tools
    "audio": None, "prediction": None, "web_search_options": None,
}
OFF_TOO = {"function_call": "none"}
# OpenAI fields that change nothing here in the values listed (others refused): field -> (allowed values, why)
ONLY = {
    "modalities": ((["text"],), "this server answers text only"),
    "reasoning_effort": ((), "the served models do not reason (no reasoning tokens to budget)"),
    "verbosity": ((), "not supported: the answer's length is max_tokens' and the prompt's"),
    "store": ((False,), "this server stores no completions"),
    "service_tier": (("auto", "default"), "one tier here; tenants and their weights come from the API key"),
    # vLLM's extensions, in the values that are what this server does anyway
    "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
    "include_stop_str_in_output": ((False,), "a stop string is never part of the text"),
    "add_generation_prompt": ((True,), "the chat template always ends with the assistant's turn"),
    "use_beam_search": ((False,), "no beam search (best_of ranks sampled choices)"),
    "min_tokens": ((0,), "not implemented (the end-of-sequence token is never masked)"),
}
# vLLM's extensions that change the output and that we do not implement (vLLM's users send them)
VLLM_UNSUPPORTED = ("guided_grammar", "guided_decoding_backend", "structured_outputs", "length_penalty",
                    "bad_words", "allowed_token_ids", "truncate_prompt_tokens", "prompt_logprobs",
                    "continue_final_message", "chat_template", "chat_template_kwargs")


def parse_completion(body: Any, model: str) -> Parsed:
    _check_object(body, model)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        prompts = prompt  # a batch: strings, or lists of token ids
    else:
        raise bad("prompt", "must be a non-empty string, a list of token ids, or a list of those")
    if len(prompts) > MAX_PROMPTS:
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts in one request")
    checked = [_one_prompt(p, "prompt" if len(prompts) == 1 else f"prompt[{i}]") for i, p in enumerate(prompts)]
    for field in ("tools", "tool_choice"):
        if body.get(field) is not None:
            raise bad(field, "is a chat field (POST /v1/chat/completions)")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise bad("echo", "must be true or false")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token) or null")
    parsed = _common(body, checked[0], "prompt", default_max_tokens=16, zero_tokens=echo)
    return dataclasses.replace(parsed, prompts=tuple(checked) if len(checked) > 1 else (), echo=echo,
                               logprobs=logprobs)


def _one_prompt(prompt: Any, field: str) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad(field, "must not be empty")
        check_text(field, prompt)
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    raise bad(field, "must be a non-empty string or a non-empty list of token ids")


def parse_chat(body: Any, model: str) -> Parsed:
    _check_object(body, model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}].role", "must be one of system, developer, user, assistant, tool")
        content = m.get("content")
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            content = ""  # a message that only calls tools
        if isinstance(content, list):  # content parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
        check_text(f"messages[{i}].content", content)
        role = "system" if m["role"] == "developer" else m["role"]
        clean.append({"role": role, "content": content})
    if "max_completion_tokens" in body and body.get("max_tokens") is None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad("logprobs", "must be true or false (the number of alternatives is top_logprobs)")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise bad("top_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if not logprobs:
            raise bad("top_logprobs", "needs logprobs: true")
    if body.get("echo") not in (None, False):
        raise bad("echo", "is a completions field (chat answers do not echo the messages)")
    tools = structured.parse_tools(body)
    if tools is not None or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        clean = structured.tool_messages(clean, messages, tools)
    if tools is not None and tools.forced:
        if body.get("response_format") not in (None, {"type": "text"}):
            raise bad("response_format", "cannot be combined with a forced tool call (tool_choice)")
        for field in structured.GUIDED:
            if body.get(field) is not None:
                raise bad(field, "cannot be combined with a forced tool call (tool_choice)")
        body = {**body, "response_format": None}
    parsed = _common(body, clean, "messages", default_max_tokens=None)  # type: ignore[arg-type]
    if tools is not None and tools.forced:
        params = {**parsed.params, "grammar": structured.tool_grammar(tools)}
        parsed = dataclasses.replace(parsed, params=params, grammar_field="tools")
    if tools is not None and tools.choice != "none" and parsed.stream and logprobs:
        raise bad("logprobs", "is not streamed together with tools (a tool call is sent whole); "
                  "ask with stream: false")
    return dataclasses.replace(parsed, logprobs=(top or 0) if logprobs else None,
                               tools=tools if tools is not None and tools.choice != "none" else None)


def _check_object(body: Any, model: str) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad("model", "required: the name of a served model (GET /v1/models)")
    if name != model:
        raise ApiError(404, f"model {name!r} does not exist; this server serves {model!r}", param="model",
                       code="model_not_found")
    for field, off in UNSUPPORTED.items():
        value = body.get(field)
        if value is not None and value != off and value is not False and value != OFF_TOO.get(field):
            raise bad(field, f"is not supported by this server (only {field}={off!r})")
    for field, (allowed, why) in ONLY.items():
        value = body.get(field)
        if value is not None and value not in allowed:
            raise bad(field, f"{value!r} is not supported: {why}")
    for field in VLLM_UNSUPPORTED:
        if body.get(field) is not None:
            raise bad(field, "is a vLLM extension this server does not implement (response_format covers "
                      "structured output; echo with logprobs gives prompt logprobs)")
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise bad("parallel_tool_calls", "must be true or false")


def _common(body: dict, prompt: Any, prompt_field: str, default_max_tokens: int | None,
            zero_tokens: bool = False) -> Parsed:
    max_tokens = body.get("max_tokens")
    least = 0 if zero_tokens else 1
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif not _is_int(max_tokens) or max_tokens < least:
        raise bad("max_tokens", "must be an integer >= 1 (0 with echo: the prompt alone)" if not zero_tokens
                  else "must be an integer >= 0")
    n, best_of = _choices(body)
    params: dict[str, Any] = {}
    _number(body, params, "temperature", lambda x: 0 <= x <= 2, "in [0, 2] (0 means greedy)")
    _number(body, params, "top_p", lambda x: 0 < x <= 1, "in (0, 1]")
    top_k = body.get("top_k")
    if top_k is not None and top_k != -1:  # vLLM's "off" is -1, ours is 0
        if not _is_int(top_k) or top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 or -1: no cut)")
        params["top_k"] = int(top_k)
    params.update(_penalties(body))
    grammar_field = None
    for field in ("response_format", *structured.GUIDED):  # OpenAI's, or vLLM's guided_* extensions
        if body.get(field) is not None:
            text = structured.grammar_of(field, body[field])
            if text is not None:
                if grammar_field is not None:
                    raise bad(field, f"cannot be combined with {grammar_field} (one grammar per request)")
                params["grammar"], grammar_field = text, field
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not 0 <= seed < 2**63:
            raise bad("seed", "must be an integer in [0, 2**63)")
        params["seed"] = int(seed)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", "must be true or false")
    params["ignore_eos"] = ignore_eos
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", f"must be a non-empty string or a list of at most {MAX_STOPS} non-empty strings")
    for s in stop:
        check_text("stop", s)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "must be true or false")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage",
                                                                                              False), bool)):
        raise bad("stream_options", "must be an object like {\"include_usage\": true}")
    include_usage = bool(options and options.get("include_usage"))
    if stream and best_of > n:
        raise bad("best_of", "must equal n when streaming (the best choices are known only at the end)")
    try:  # the engine's own checks, in case they are stricter
        SamplingParams(max_tokens=max_tokens or 1, **params)
    except SamplingParamsError as e:
        field = str(e).split("=", 1)[0]
        raise bad(field, str(e)) from None
    return Parsed(prompt, prompt_field, max_tokens, params, stop, stream, include_usage, n=n, best_of=best_of,
                  grammar_field=grammar_field)


def _number(body: dict, out: dict[str, Any], field: str, ok: Callable[[float], bool], where: str) -> None:
    """Check the number ``body[field]`` (absent or None: left out) and put it in ``out`` as a float."""
    value = body.get(field)
    if value is not None:
        if not _is_number(value) or not ok(value):
            raise bad(field, f"must be a number {where}")
        out[field] = float(value)


def _choices(body: dict) -> tuple[int, int]:
    """``n`` and ``best_of`` (default n), each in [1, MAX_CHOICES], best_of >= n."""
    n = body.get("n")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise bad("n", f"must be an integer in [1, {MAX_CHOICES}]")
    best_of = body.get("best_of")
    best_of = n if best_of is None else best_of
    if not _is_int(best_of) or not n <= best_of <= MAX_CHOICES:
        raise bad("best_of", f"must be an integer in [n, {MAX_CHOICES}] (n = {n})")
    return n, best_of


def _penalties(body: dict) -> dict[str, Any]:
    """The penalties, min_p and logit_bias, checked (each None or absent: off)."""
    out: dict[str, Any] = {}
    for field in ("presence_penalty", "frequency_penalty"):
        _number(body, out, field, lambda x: -2 <= x <= 2, "in [-2, 2]")
    _number(body, out, "min_p", lambda x: 0 <= x <= 1, "in [0, 1]")
    _number(body, out, "repetition_penalty", lambda x: 0 < x <= 100, "in (0, 100] (1: none)")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad("logit_bias", "must be an object mapping token ids (as strings) to biases in [-100, 100]")
        pairs = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                raise bad("logit_bias", f"key {key!r}: must be a token id (a string of digits)")
            if not _is_number(value) or not -100 <= value <= 100:
                raise bad("logit_bias", f"bias of token {key}: must be a number in [-100, 100]")
            pairs[int(key)] = float(value)
        if pairs:
            out["logit_bias"] = pairs
    return out


def check_text(param: str, s: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate, which UTF-8 cannot encode)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(param, f"is not valid Unicode text: a lone surrogate {s[e.start]!r} at character {e.start} "
                  "(send UTF-8, or a surrogate pair)") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
