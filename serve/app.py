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

import asyncio
import dataclasses
import secrets
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from reference.engine.params import SamplingParams
from serve.answer import Answer, EventStream, Prompt
from serve.door import BODY_TIMEOUT_S, bearer_client, door_app, gone, read_request
from serve.engine_thread import Arrival, EngineThread, Rejected, Submission, Ticket
from serve.keys import KeyTable
from serve.logprobs import TokenText
from serve.metrics import ServerMetrics
from serve.protocol import ApiError, Parsed, parse_chat, parse_completion
from serve.structured import check_against


class ServeState:
    """What the handlers share: the engine worker, the tokenizer, the keys and the metrics."""

    def __init__(self, worker: EngineThread, tokenizer: Any, model_name: str, keys: KeyTable | None,
                 max_pending: int, body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.worker, self.tokenizer, self.model_name, self.keys = worker, tokenizer, model_name, keys
        self.max_pending, self.body_timeout_s = max_pending, body_timeout_s
        self.metrics = ServerMetrics(model_name)
        self.token_text = TokenText(tokenizer)  # tokens' text and bytes, as logprobs report them
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
    parsed = incoming.parsed
    if parsed.params.get("grammar") is not None:  # refused here, naming the field, before anything is queued
        await asyncio.to_thread(check_against, parsed.params["grammar"], state.tokenizer, parsed.grammar_field)
    prompts = [Prompt(ids, _prompt_text(state.tokenizer, p, ids), drop=parsed.max_tokens == 0)
               for p, ids in zip(parsed.all_prompts, incoming.batch or (incoming.ids,), strict=True)]
    subs = [Submission(p.ids, params, client.tenant, None if state.keys is None else client.tenant)
            for p in prompts for params in _choice_params(parsed, limit, len(p.ids))]
    if state.metrics.in_flight + len(subs) > state.max_pending:
        state.metrics.count("overloaded")
        raise ApiError(503, f"the server is at its limit of {state.max_pending} requests in flight; retry later",
                       code="overloaded", headers={"Retry-After": "1"})
    tickets = await _submit(state, subs, arrival)
    answer = Answer(state, tickets, parsed, chat, prompts)
    if parsed.stream:
        return EventStream(answer.events(), on_close=answer.settle, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await answer.whole(request)


def _choice_params(parsed: Parsed, limit: int | None, num_prompt: int) -> list[SamplingParams]:
    """The engine parameters of a prompt's ``best_of`` choices: choice i seeded ``seed + i`` (a fresh
    random seed each without a seed); logprobs when reported or when best_of ranks by them; prompt
    logprobs with echo."""
    max_tokens = parsed.max_tokens if parsed.max_tokens is not None else max(1, (limit or 2**31) - num_prompt)
    logprobs = parsed.logprobs if parsed.logprobs is not None else (0 if parsed.best_of > parsed.n else None)
    prompt_logprobs = parsed.logprobs if parsed.echo and parsed.logprobs is not None else None
    base = SamplingParams(max_tokens=max(1, max_tokens), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                          **parsed.params)
    out = []
    for i in range(parsed.best_of):
        seed = base.seed
        if seed is not None:
            seed = (seed + i) % (1 << 63)
        elif not base.greedy:  # unseeded: a fresh stream, kept wherever the request goes
            seed = secrets.randbelow(1 << 63)
        out.append(dataclasses.replace(base, seed=seed))
    return out


def _prompt_text(tokenizer: Any, prompt: Any, ids: list[int]) -> str:
    """What echo returns: the prompt as sent, or the text of its token ids."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids) if not isinstance(prompt[0], dict) else ""


async def _submit(state: ServeState, subs: list[Submission], arrival: Arrival) -> list[Ticket]:
    """Submit every choice's request at once; if any is refused, abort the others and answer its error."""
    state.metrics.in_flight += len(subs)  # counted before the await, so concurrent requests see each other
    try:
        results = await asyncio.gather(*(state.worker.submit(s, arrival) for s in subs), return_exceptions=True)
    except BaseException:  # cancelled while waiting: each submit aborts its request; nobody will read them
        state.metrics.in_flight -= len(subs)
        raise
    tickets = [r for r in results if isinstance(r, Ticket)]
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is None:
        return tickets
    state.metrics.in_flight -= len(subs)
    for t in tickets:
        state.worker.abort(t.request_id)
    if isinstance(failure, Rejected):
        state.metrics.count("rejected")
        raise ApiError(failure.failure.status, failure.failure.message, headers={"Retry-After": "1"}
                       if failure.failure.status == 503 else None) from None
    raise failure
