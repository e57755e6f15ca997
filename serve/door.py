"""The one door: how every OpenAI-compatible endpoint of the project reads requests, answers errors.

The single server (``serve.app``, its disaggregated and pipelined forms included) and the fleet
gateway (``serve.fleet.gateway``) both build their app with ``door_app`` and read generation
requests with ``read_request``, so they hold the same guarantees:

- the body is read with a cap (``MAX_BODY_BYTES``: 413), whatever ``Content-Length`` claims, and
  within ``body_timeout_s`` (408): a slow client, or one whose body is shorter than its
  ``Content-Length``, gets an answer instead of holding a handler forever;
- a client that leaves while sending its body is one INFO line in the log, never a traceback;
- the body is parsed with bounded nesting (``reference.jsonsafe``, ``MAX_JSON_DEPTH``): deep JSON is
  a 400, never a ``RecursionError``; a long body's parsing and its prompt's tokenization run on a
  worker thread, so they never stall the event loop;
- a prompt longer than the context is refused (400, ``context_length_exceeded``), a very long one
  before it is tokenized;
- every error status, 404 and 405 included, answers an OpenAI error body; a request cancelled by
  the server's shutdown is one INFO line.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute

from reference import jsonsafe
from serve.keys import Client, KeyTable
from serve.protocol import ApiError, Parsed

ANONYMOUS = Client("default", "default")
MAX_BODY_BYTES = 4 << 20  # a prompt this long would not fit any context we serve
OFF_LOOP_BYTES = 64 << 10  # bodies and prompts longer than this are parsed, tokenized on a thread
BODY_TIMEOUT_S = 60.0  # a client slower to send its body gets 408 (no handler waits forever)
MAX_JSON_DEPTH = 16  # a chat body needs 5 levels (body, messages, message, content parts, part)
CLIENT_GONE = 499  # the status of a request whose client left before it was read (nginx's)
log = logging.getLogger("serve")


def door_app(routes: Sequence[BaseRoute], lifespan: Any = None) -> Starlette:
    """A Starlette app over ``routes`` that answers every error as an OpenAI error body and turns a
    request cancelled by the server's shutdown into one INFO line."""
    return Starlette(routes=list(routes), lifespan=lifespan, middleware=[Middleware(QuietCancel)],
                     exception_handlers={ApiError: error_response, HTTPException: http_error})


class QuietCancel:
    """ASGI middleware: a request cancelled by the server (its shutdown grace ran out while the
    client stalled) ends with one INFO line instead of a ``CancelledError`` traceback."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if scope.get("type") != "http":
                raise
            client = scope.get("client") or ("(unknown)", 0)
            log.info("request %s %s from %s:%s cancelled by the server's shutdown",
                     scope.get("method"), scope.get("path"), *client)


async def error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such path: 404, wrong method: 405) as OpenAI error bodies."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if exc.status_code == 404:
        message = (f"no such endpoint: {path} (see /v1/models, /v1/completions, "
                   "/v1/chat/completions)")
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {path}"
    else:
        message = str(exc.detail)
    code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
    err = ApiError(exc.status_code, message, code=code)
    return JSONResponse(err.body(), exc.status_code, headers=dict(exc.headers or {}))


def bearer_token(request: Request) -> str:
    """The key of an ``Authorization: Bearer KEY`` header ("" without one)."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def bearer_client(keys: KeyTable | None, request: Request) -> Client:
    """The client of the request's key (401 without a valid one); ANONYMOUS without a key table."""
    if keys is None:
        return ANONYMOUS
    client = keys.lookup(bearer_token(request))
    if client is None:
        raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                       code="invalid_api_key")
    return client


def peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "(unknown)"


async def read_body(request: Request, timeout_s: float = BODY_TIMEOUT_S) -> bytearray | None:
    """The request's body, read with the size cap and the time limit; None if the client went away
    while sending it (logged as one INFO line)."""
    raw = bytearray()
    try:
        with anyio.fail_after(timeout_s):
            async for part in request.stream():  # read with a cap, whatever Content-Length claims
                raw += part
                if len(raw) > MAX_BODY_BYTES:
                    raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                                   code="body_too_large")
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s (after "
                       f"{len(raw)} bytes)", code="request_timeout",
                       headers={"Connection": "close"}) from None
    except ClientDisconnect:
        log.info("client %s went away after sending %d bytes of its body", peer(request), len(raw))
        return None
    return raw


def decode_body(raw: bytes | bytearray) -> Any:
    """The body as JSON, nested at most ``MAX_JSON_DEPTH`` deep (400 naming the problem if not)."""
    try:
        return jsonsafe.loads(raw, max_depth=MAX_JSON_DEPTH, what="the request body")
    except jsonsafe.JsonError as e:
        raise ApiError(400, str(e), code="invalid_json") from None


@dataclass(frozen=True)
class Incoming:
    """A generation request as read and checked by the door."""

    body: Any  # the JSON body
    parsed: Parsed
    ids: list[int]  # the (first) prompt's token ids
    batch: tuple[list[int], ...] = ()  # every prompt's token ids (a completions request may have several)


async def read_request(request: Request, parse: Callable[[Any], Parsed], tokenizer: Any,
                       limit: int | None, timeout_s: float = BODY_TIMEOUT_S) -> Incoming | None:
    """Read, parse (``parse``: the JSON body to a checked request) and tokenize a generation
    request, and refuse a prompt that leaves no room in a context of ``limit`` tokens. None: the
    client went away while sending it."""
    raw = await read_body(request, timeout_s)
    if raw is None:
        return None

    def checked() -> Incoming:
        body = decode_body(raw)
        parsed = parse(body)
        batch = tuple(prompt_ids(tokenizer, parsed, limit, p) for p in parsed.all_prompts)
        return Incoming(body, parsed, batch[0], batch)

    big = len(raw) > OFF_LOOP_BYTES
    incoming = await anyio.to_thread.run_sync(checked) if big else checked()
    for ids in incoming.batch:
        n = len(ids)
        if limit is not None and n >= limit:
            field = incoming.parsed.prompt_field
            raise ApiError(400, f"{field}: the prompt has {n} tokens, more than the context of {limit} "
                           "tokens allows (it must leave room for one generated token)", param=field,
                           code="context_length_exceeded")
    return incoming


def gone() -> Response:
    """What a handler returns for a client that left before its request was read (nobody reads
    it)."""
    return Response(status_code=CLIENT_GONE)


@functools.lru_cache(maxsize=8)
def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes one token of the vocabulary stands for (computed once per tokenizer)."""
    return max(len(tokenizer.decode([i]).encode("utf-8", "replace"))
               for i in range(tokenizer.vocab_size))


def surely_too_long(tokenizer: Any, parsed: Parsed, text_bytes: int, limit: int | None) -> None:
    """Refuse a prompt whose text is so long that it cannot fit the context whatever its tokens,
    before tokenizing it (a 4 MB prompt takes seconds): no token stands for more than
    ``max_token_bytes`` bytes, so the prompt has at least ``text_bytes / max_token_bytes`` tokens
    (halved, to be safe)."""
    if limit is None or text_bytes <= OFF_LOOP_BYTES:
        return
    at_least = text_bytes // (2 * max_token_bytes(tokenizer))
    if at_least >= limit:
        field = parsed.prompt_field
        raise ApiError(400, f"{field}: the prompt of {text_bytes} bytes has at least {at_least} "
                       f"tokens, more than the context of {limit} tokens allows", param=field,
                       code="context_length_exceeded")


def prompt_ids(tokenizer: Any, parsed: Parsed, limit: int | None, prompt: Any = None) -> list[int]:
    """The prompt's token ids (``prompt``, else the request's first): chat messages through the chat
    template, text encoded, ids checked."""
    prompt = parsed.prompt if prompt is None else prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        size = sum(len(m["content"].encode("utf-8")) for m in prompt)  # type: ignore[index]
        surely_too_long(tokenizer, parsed, size, limit)
        try:
            return tokenizer.encode_chat(prompt)
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
    if isinstance(prompt, str):
        surely_too_long(tokenizer, parsed, len(prompt.encode("utf-8")), limit)
        return tokenizer.encode(prompt)
    vocab = tokenizer.vocab_size
    if max(prompt) >= vocab or min(prompt) < 0:
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
    return list(prompt)
