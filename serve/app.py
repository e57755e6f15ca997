"""The HTTP API: OpenAI-compatible completions and chat completions, models, health and metrics.

``create_app(worker, ...)`` returns a Starlette app over an ``EngineThread``. A handler checks the
key (401), the body (400, naming the field), the prompt's length (400) and the number of requests in
flight (503 with ``Retry-After``), then submits the request to the engine thread and answers with
the whole completion or a stream of server-sent events. A client that goes away (mid-stream or while
waiting for a whole completion) has its request aborted, which frees its KV blocks. The request is
read and errors are answered by ``serve.door``, the code the fleet gateway reads requests with too
(body limits, JSON depth, slow and vanishing clients, OpenAI error bodies).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from reference.engine.params import SamplingParams
from serve.answer import Answer, EventStream
from serve.door import BODY_TIMEOUT_S, bearer_client, door_app, gone, read_request
from serve.engine_thread import Arrival, EngineThread, Rejected, Submission
from serve.keys import KeyTable
from serve.metrics import ServerMetrics
from serve.protocol import ApiError, parse_chat, parse_completion


class ServeState:
    """What the handlers share: the engine worker, the tokenizer, the keys and the metrics."""

    def __init__(self, worker: EngineThread, tokenizer: Any, model_name: str, keys: KeyTable | None,
                 max_pending: int, body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.worker, self.tokenizer, self.model_name, self.keys = worker, tokenizer, model_name, keys
        self.max_pending, self.body_timeout_s = max_pending, body_timeout_s
        self.metrics = ServerMetrics(model_name)
        self.created = int(time.time())


def create_app(worker: EngineThread, tokenizer: Any, *, model_name: str, keys: KeyTable | None = None,
               max_pending: int = 256, body_timeout_s: float = BODY_TIMEOUT_S) -> Starlette:
    state = ServeState(worker, tokenizer, model_name, keys, max_pending, body_timeout_s)

    async def models(request: Request) -> Response:
        bearer_client(state.keys, request)
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
    app = door_app(routes)
    app.state.serve = state
    return app


async def _generate(state: ServeState, request: Request, chat: bool) -> Response:
    """Answer one request; while it is read and until the engine's queue holds it, it counts as arriving
    (an idle engine gathering a burst waits for it: ``--burst-gather-ms``)."""
    arrival = Arrival(state.worker)
    try:
        return await _answer(state, request, chat, arrival)
    finally:
        arrival.close()


async def _answer(state: ServeState, request: Request, chat: bool, arrival: Arrival) -> Response:
    client = bearer_client(state.keys, request)
    parse = (parse_chat if chat else parse_completion)
    limit = state.worker.max_model_len
    incoming = await read_request(request, lambda body: parse(body, state.model_name),
                                  state.tokenizer, limit, state.body_timeout_s)
    if incoming is None:
        return gone()
    parsed, ids = incoming.parsed, incoming.ids
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
        ticket = await state.worker.submit(Submission(ids, params, client.tenant, cache_salt), arrival)
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
