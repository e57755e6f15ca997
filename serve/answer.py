"""One accepted request's answer: the whole completion, or its stream of server-sent events.

The text comes from the engine worker's ticket through ``TextStream`` (whole characters, stop
strings). Whatever ends the answer (the last token, a stop string, a failure, the client leaving),
``settle`` runs once: it counts the request out and, if the client left, aborts it in the engine,
which frees its KV blocks.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from reference.engine.request import TokenEvent
from serve.engine_thread import Failed, Finished, Ticket
from serve.protocol import ApiError, Parsed
from serve.textstream import TextStream


class Answer:
    """One accepted request's answer: OpenAI chunks while streaming, or one body at the end."""

    def __init__(self, state: Any, ticket: Ticket, parsed: Parsed, chat: bool, num_prompt: int) -> None:
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
            await wait_disconnect(request.receive)
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


async def wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
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
                await wait_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # runs the cleanup if the stream was cut short
            self.on_close()  # and if it never started
