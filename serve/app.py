"""The HTTP API: OpenAI-compatible completions and chat completions, models, health and metrics.

``create_app(worker, ...)`` returns a Starlette app over an ``EngineThread``. A handler checks the
key (401), the body (400, naming the field), the prompt's length (400) and the number of requests in
flight (503 with ``Retry-After``), then submits the request to the engine thread and answers with
the whole completion or a stream of server-sent events. A client that goes away (mid-stream or while
waiting for a whole completion) has its request aborted, which frees its KV blocks; one that goes away
while sending its body is logged as one INFO line. Every error status, 404 and 405 included, answers
an OpenAI error body. The body is parsed with bounded nesting (``reference.jsonsafe``); a long body's
parsing and a long prompt's tokenization run on a worker thread, so they never stall the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from reference import jsonsafe
from reference.engine.params import SamplingParams
from serve.answer import Answer, EventStream
from serve.engine_thread import EngineThread, Rejected, Submission
from serve.keys import Client, KeyTable
from serve.metrics import ServerMetrics
from serve.protocol import ApiError, Parsed, parse_chat, parse_completion

ANONYMOUS = Client("default", "default")
MAX_BODY_BYTES = 4 << 20  # a prompt this long would not fit any context we serve
OFF_LOOP_BYTES = 64 << 10  # bodies and prompts longer than this are parsed and tokenized on a thread
BODY_TIMEOUT_S = 60.0  # a client that takes longer to send its body gets 408 (no handler waits forever)
MAX_JSON_DEPTH = 16  # a chat body needs 5 levels (body, messages, message, content parts, part)
log = logging.getLogger("serve")


class ServeState:
    """What the handlers share: the engine worker, the tokenizer, the keys and the metrics."""

    def __init__(self, worker: EngineThread, tokenizer: Any, model_name: str, keys: KeyTable | None,
                 max_pending: int) -> None:
        self.worker, self.tokenizer, self.model_name, self.keys = worker, tokenizer, model_name, keys
        self.max_pending = max_pending
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self._max_token_bytes: int | None = None

    def context_limit(self) -> int | None:
        """The longest prompt + output the engine takes, in tokens (None: no limit known here)."""
        return self.worker.max_model_len

    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token of the vocabulary stands for (computed once, when first needed)."""
        if self._max_token_bytes is None:
            tok = self.tokenizer
            self._max_token_bytes = max(len(tok.decode([i]).encode("utf-8", "replace")) for i in range(tok.vocab_size))
        return self._max_token_bytes


def create_app(worker: EngineThread, tokenizer: Any, *, model_name: str, keys: KeyTable | None = None,
               max_pending: int = 256) -> Starlette:
    state = ServeState(worker, tokenizer, model_name, keys, max_pending)

    async def models(request: Request) -> Response:
        _client(state, request)
        card = {"id": model_name, "object": "model", "created": state.created, "owned_by": "unfire",
                "max_model_len": worker.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        if not worker.alive:
            return JSONResponse({"status": "error", "error": worker.error or "engine thread stopped"}, 503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(state.metrics.render(worker.stats), media_type="text/plain; version=0.0.4")

    async def completions(request: Request) -> Response:
        return await _generate(state, request, chat=False)

    async def chat(request: Request) -> Response:
        return await _generate(state, request, chat=True)

    routes = [Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={ApiError: _error_response, HTTPException: _http_error},
                    middleware=[Middleware(QuietCancel)])
    app.state.serve = state
    return app


class QuietCancel:
    """ASGI middleware: a request cancelled by the server (its shutdown grace ran out while the client
    stalled) ends with one INFO line instead of a ``CancelledError`` traceback."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if scope.get("type") != "http":
                raise
            client = scope.get("client") or ("(unknown)", 0)
            log.info("request %s %s from %s:%s cancelled by the server's shutdown", scope.get("method"),
                     scope.get("path"), *client)


async def _error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such path: 404, wrong method: 405) as OpenAI error bodies."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no such endpoint: {request.url.path} (see /v1/models, /v1/completions, /v1/chat/completions)"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    err = ApiError(exc.status_code, message, code={404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code))
    return JSONResponse(err.body(), exc.status_code, headers=dict(exc.headers or {}))


def _client(state: ServeState, request: Request) -> Client:
    if state.keys is None:
        return ANONYMOUS
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    client = state.keys.lookup(key.strip()) if scheme.lower() == "bearer" else None
    if client is None:
        raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")
    return client


async def _generate(state: ServeState, request: Request, chat: bool) -> Response:
    client = _client(state, request)
    raw = bytearray()
    try:
        with anyio.fail_after(BODY_TIMEOUT_S):
            async for part in request.stream():  # read with a cap, whatever Content-Length claims
                raw += part
                if len(raw) > MAX_BODY_BYTES:
                    raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                                   code="body_too_large")
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s",
                       code="request_timeout") from None
    except ClientDisconnect:
        log.info("client %s went away after sending %d bytes of its body", _peer(request), len(raw))
        return Response(status_code=499)
    parse = (parse_chat if chat else parse_completion)

    def checked() -> tuple[Parsed, list[int]]:
        try:
            body = jsonsafe.loads(raw, max_depth=MAX_JSON_DEPTH, what="the request body")
        except jsonsafe.JsonError as e:
            raise ApiError(400, str(e), code="invalid_json") from None
        parsed = parse(body, state.model_name)
        return parsed, _prompt_ids(state, parsed)

    if len(raw) > OFF_LOOP_BYTES:
        parsed, ids = await anyio.to_thread.run_sync(checked)
    else:
        parsed, ids = checked()
    limit = state.worker.max_model_len
    if limit is not None and len(ids) >= limit:
        raise ApiError(400, f"{parsed.prompt_field}: the prompt has {len(ids)} tokens, more than the context of "
                       f"{limit} tokens allows (it must leave room for one generated token)",
                       param=parsed.prompt_field, code="context_length_exceeded")
    if state.metrics.in_flight >= state.max_pending:
        state.metrics.count("overloaded")
        raise ApiError(503, f"the server is at its limit of {state.max_pending} requests in flight; retry later",
                       code="overloaded", headers={"Retry-After": "1"})
    max_tokens = parsed.max_tokens if parsed.max_tokens is not None else max(1, (limit or 2**31) - len(ids))
    params = SamplingParams(max_tokens=max_tokens, **parsed.params)
    if not params.greedy and params.seed is None:  # unseeded: a fresh stream, kept wherever the request goes
        params = dataclasses.replace(params, seed=secrets.randbelow(1 << 63))
    cache_salt = None if state.keys is None else client.tenant
    state.metrics.in_flight += 1  # counted before the await, so concurrent requests see each other
    try:
        ticket = await state.worker.submit(Submission(ids, params, client.tenant, cache_salt))
    except Rejected as e:
        state.metrics.in_flight -= 1
        state.metrics.count("rejected")
        raise ApiError(e.failure.status, e.failure.message, headers={"Retry-After": "1"}
                       if e.failure.status == 503 else None) from None
    except BaseException:  # cancelled while waiting: the worker may still accept it; nobody will read it
        state.metrics.in_flight -= 1
        raise
    answer = Answer(state, ticket, parsed, chat, len(ids))
    if parsed.stream:
        return EventStream(answer.events(), on_close=answer.settle, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await answer.whole(request)


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "(unknown)"


def _surely_too_long(state: ServeState, parsed: Parsed, text_bytes: int) -> None:
    """Refuse a prompt whose text is so long that it cannot fit the context whatever its tokens, before
    tokenizing it (a 4 MB prompt takes seconds): no token stands for more than ``max_token_bytes``
    bytes, so the prompt has at least ``text_bytes / max_token_bytes`` tokens (halved, to be safe)."""
    limit = state.context_limit()
    if limit is None or text_bytes <= OFF_LOOP_BYTES:
        return
    at_least = text_bytes // (2 * state.max_token_bytes())
    if at_least >= limit:
        raise ApiError(400, f"{parsed.prompt_field}: the prompt of {text_bytes} bytes has at least {at_least} "
                       f"tokens, more than the context of {limit} tokens allows", param=parsed.prompt_field,
                       code="context_length_exceeded")


def _prompt_ids(state: ServeState, parsed: Parsed) -> list[int]:
    if isinstance(parsed.prompt, list) and parsed.prompt and isinstance(parsed.prompt[0], dict):
        _surely_too_long(state, parsed, sum(len(m["content"].encode("utf-8")) for m in parsed.prompt))
        try:
            return state.tokenizer.encode_chat(parsed.prompt)
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
    if isinstance(parsed.prompt, str):
        _surely_too_long(state, parsed, len(parsed.prompt.encode("utf-8")))
        return state.tokenizer.encode(parsed.prompt)
    vocab = state.tokenizer.vocab_size
    if max(parsed.prompt) >= vocab or min(parsed.prompt) < 0:
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
    return list(parsed.prompt)
