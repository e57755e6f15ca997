"""The OpenAI request bodies we accept, checked field by field, and the error body we answer with.

Every check names the field it rejects (``param`` in the error body, as OpenAI does), so a client
sees ``temperature: must be a number in [0, 2]`` instead of a stack trace. Fields that change the
output and that we do not implement (``n`` > 1, logprobs, penalties, ...) are refused rather than
silently ignored; fields that do not (``user``, ``metadata``) are accepted. Two vLLM extensions used
by benchmark tools are supported: ``top_k`` and ``ignore_eos``. Text that reaches the tokenizer (the
prompt, message contents, stop strings) must be valid Unicode: JSON can spell a lone UTF-16 surrogate
(``"\\ud800"``), which no tokenizer can encode, so it is refused naming the field and the position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from reference.engine.params import SamplingParams, SamplingParamsError

MAX_STOPS = 4


class ApiError(Exception):
    """An error answered as an OpenAI error body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="invalid_value")


@dataclass(frozen=True)
class Parsed:
    """A checked request: the prompt (text or token ids), how to sample, and how to answer."""

    prompt: str | list[int]
    prompt_field: str  # "prompt" or "messages", for errors about the prompt
    max_tokens: int | None  # None: up to the end of the context
    params: dict[str, Any]  # SamplingParams fields other than max_tokens
    stop: list[str]
    stream: bool
    include_usage: bool


UNSUPPORTED = {  # field -> the value that means "off"
    "n": 1, "best_of": 1, "logprobs": None, "top_logprobs": None, "echo": False, "suffix": None,
    "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None, "functions": None,
    "response_format": None,
}


def parse_completion(body: Any, model: str) -> Parsed:
    _check_object(body, model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "must not be empty")
        check_text("prompt", prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt = [int(t) for t in prompt]
    else:
        raise bad("prompt", "must be a non-empty string or a list of token ids (one prompt per request)")
    return _common(body, prompt, "prompt", default_max_tokens=16)


def parse_chat(body: Any, model: str) -> Parsed:
    _check_object(body, model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise bad(f"messages[{i}].role", "must be one of system, developer, user, assistant")
        content = m.get("content")
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
    return _common(body, clean, "messages", default_max_tokens=None)  # type: ignore[arg-type]


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
        if value is not None and value != off and value is not False:
            raise bad(field, f"is not supported by this server (only {field}={off!r})")


def _common(body: dict, prompt: Any, prompt_field: str, default_max_tokens: int | None) -> Parsed:
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise bad("max_tokens", "must be an integer >= 1")
    params: dict[str, Any] = {}
    temperature = body.get("temperature")
    if temperature is not None:
        if not _is_number(temperature) or not 0 <= temperature <= 2:
            raise bad("temperature", "must be a number in [0, 2] (0 means greedy)")
        params["temperature"] = float(temperature)
    top_p = body.get("top_p")
    if top_p is not None:
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise bad("top_p", "must be a number in (0, 1]")
        params["top_p"] = float(top_p)
    top_k = body.get("top_k")
    if top_k is not None and top_k != -1:  # vLLM's "off" is -1, ours is 0
        if not _is_int(top_k) or top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 or -1: no cut)")
        params["top_k"] = int(top_k)
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
    try:  # the engine's own checks, in case they are stricter
        SamplingParams(max_tokens=max_tokens or 1, **params)
    except SamplingParamsError as e:
        field = str(e).split("=", 1)[0]
        raise bad(field, str(e)) from None
    return Parsed(prompt, prompt_field, max_tokens, params, stop, stream, include_usage)


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
