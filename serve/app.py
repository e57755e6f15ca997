"""The HTTP API: OpenAI-compatible completions and chat completions, models, health and metrics.

``create_app(worker, ...)`` returns a Starlette app over an ``EngineWorker``. A handler checks the
key (401), the body (400, naming the field), the prompt's length (400) and the number of requests in
flight (503 with ``Retry-After``), then submits the request to the engine thread and answers with
the whole completion or a stream of server-sent events. A client that goes away (mid-stream or while
waiting for a whole completion) has its request aborted, which frees its KV blocks.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from reference.engine.params import SamplingParams
from reference.engine.request import TokenEvent
from serve.keys import Client, KeyTable
from serve.metrics import ServerMetrics
from serve.protocol import ApiError, Parsed, parse_chat, parse_completion
from serve.textstream import TextStream
from serve.worker import EngineWorker, Failed, Finished, Rejected, Submission, Ticket

ANONYMOUS = Client("default", "default")
MAX_BODY_BYTES = 4 << 20  # a prompt this long would not fit any context we serve


class ServeState:
    """What the handlers share: the engine worker, the tokenizer, the keys and the metrics."""

    def __init__(self, worker: EngineWorker, tokenizer: Any, model_name: str, keys: KeyTable | None,
                 max_pending: int) -> None:
        self.worker, self.tokenizer, self.model_name, self.keys = worker, tokenizer, model_name, keys
        self.max_pending = max_pending
        self.metrics = ServerMetrics()
        self.created = int(time.time())


def create_app(worker: EngineWorker, tokenizer: Any, *, model_name: str, keys: KeyTable | None = None,
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
    app = Starlette(routes=routes, exception_handlers={ApiError: _error_response})
    app.state.serve = state
    return app


async def _error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


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
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    parsed = (parse_chat if chat else parse_completion)(body, state.model_name)
    ids = _prompt_ids(state, parsed)
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
    answer = _Answer(state, ticket, parsed, chat, len(ids))
    if parsed.stream:
        return _EventStream(answer.events(), on_close=answer.settle, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await answer.whole(request)


def _prompt_ids(state: ServeState, parsed: Parsed) -> list[int]:
    if isinstance(parsed.prompt, list) and parsed.prompt and isinstance(parsed.prompt[0], dict):
        try:
            return state.tokenizer.encode_chat(parsed.prompt)
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
    if isinstance(parsed.prompt, str):
        return state.tokenizer.encode(parsed.prompt)
    vocab = state.tokenizer.vocab_size
    if max(parsed.prompt) >= vocab or min(parsed.prompt) < 0:
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
    return list(parsed.prompt)


class _Answer:
    """One accepted request's answer: OpenAI chunks while streaming, or one body at the end."""

    def __init__(self, state: ServeState, ticket: Ticket, parsed: Parsed, chat: bool, num_prompt: int) -> None:
        self.state, self.ticket, self.parsed, self.chat, self.num_prompt = state, ticket, parsed, chat, num_prompt
        self.text = TextStream(state.tokenizer, parsed.stop)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.settled = False
        self.failed = False

    async def pieces(self) -> AsyncIterator[str]:
        """The text as it comes; sets ``finish_reason`` at the end. Raises ApiError on a failure."""
        try:
            async for item in self.ticket:
                if isinstance(item, TokenEvent):
                    self.num_tokens += 1
                    piece = self.text.push(item.token_id)
                    if piece:
                        yield piece
                    if self.text.stopped:  # a stop string: end here, free the engine's work
                        self.state.worker.abort(self.ticket.request_id)
                        self.finish_reason = "stop"
                        self.state.metrics.count("stopped")
                        return
                elif isinstance(item, Finished):
                    self.state.metrics.finished(item.output)
                    piece = self.text.finish()
                    if piece:
                        yield piece
                    self.finish_reason = "stop" if self.text.stopped else item.output.finish_reason
                elif isinstance(item, Failed):
                    self.failed = True
                    self.state.metrics.count("failed")
                    raise ApiError(item.status, item.message)
        finally:
            self.settle()

    def settle(self) -> None:
        if self.settled:
            return
        self.settled = True
        self.state.metrics.in_flight -= 1
        if self.finish_reason is None and not self.failed:  # the client left: abort, freeing its blocks
            self.state.worker.abort(self.ticket.request_id)
            self.state.metrics.count("aborted")

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.num_prompt, "completion_tokens": self.num_tokens,
                "total_tokens": self.num_prompt + self.num_tokens}

    async def whole(self, request: Request) -> Response:
        """Collect the whole completion, aborting it if the client disconnects meanwhile."""
        text: list[str] = []

        failure: list[ApiError] = []

        async def collect(scope: anyio.CancelScope) -> None:
            try:
                async with contextlib.aclosing(self.pieces()) as pieces:
                    async for piece in pieces:
                        text.append(piece)
            except ApiError as e:
                failure.append(e)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, tg.cancel_scope)
            await _wait_disconnect(request.receive)
            tg.cancel_scope.cancel()
        if failure:
            raise failure[0]
        if self.finish_reason is None:  # the client left: nobody reads this
            return Response(status_code=499)
        content = "".join(text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.state.model_name, "choices": [choice],
                             "usage": self.usage()})

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: one chunk per text piece, a last chunk with finish_reason, [DONE]."""
        try:
            if self.chat:
                yield self._chunk({"role": "assistant", "content": ""}, None)
            async with contextlib.aclosing(self.pieces()) as pieces:
                async for piece in pieces:
                    yield self._chunk({"content": piece} if self.chat else piece, None)
            yield self._chunk({} if self.chat else "", self.finish_reason)
            if self.parsed.include_usage:
                yield _sse({**self._envelope(), "choices": [], "usage": self.usage()})
        except ApiError as e:  # headers are sent: report the failure in the stream, as OpenAI does
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    def _envelope(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.state.model_name}

    def _chunk(self, delta: Any, finish_reason: str | None) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        choice.update({"delta": delta} if self.chat else {"text": delta})
        chunk = {**self._envelope(), "choices": [choice]}
        if self.parsed.include_usage:
            chunk["usage"] = None
        return _sse(chunk)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """A streaming response that always watches for the client leaving and then stops the stream
    (whatever ASGI version the server speaks), so the generator's cleanup aborts the request."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def stream(scope_: anyio.CancelScope) -> None:
            with contextlib.suppress(OSError):
                await self.stream_response(send)
            scope_.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream, tg.cancel_scope)
                await _wait_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # runs the cleanup if the stream was cut short
            self.on_close()  # and if it never started
