"""One accepted request's answer: the whole completion, or its stream of server-sent events.

An answer has one choice per prompt and per ``best_of`` (``n`` when not given), each an engine
request. A choice's text comes from the engine worker's ticket through ``TextStream`` (whole
characters, stop strings), with the logprobs of the tokens each piece came from (``serve/logprobs.py``
gives them their OpenAI shapes). Whatever ends a choice (the last token, a stop string, a failure, the
client leaving), its ``settle`` runs once: it counts the request out and, if the client left, aborts
it in the engine, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from reference.engine.request import TokenEvent
from serve.engine_thread import Failed, Finished, Ticket
from serve.logprobs import Entry, chat_logprobs, completion_logprobs
from serve.protocol import ApiError, Parsed
from serve.structured import tool_calls_of
from serve.textstream import TextStream

Delta = tuple[str, list[Entry]]  # a piece of text and the tokens (with logprobs) it came with


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its token ids, its text (what echo returns), and whether the token the
    engine generates is dropped (``max_tokens`` 0: the engine generates at least one)."""

    ids: list[int]
    text: str
    drop: bool = False


class Choice:
    """One choice of an answer: one engine request, its text and its logprobs as they come."""

    def __init__(self, state: Any, ticket: Ticket, parsed: Parsed, index: int, prompt: Prompt) -> None:
        self.state, self.ticket, self.parsed, self.index, self.prompt = state, ticket, parsed, index, prompt
        self.text = TextStream(state.tokenizer, parsed.stop)
        self.num_tokens = 0
        self.cumulative = 0.0  # the sum of the generated tokens' logprobs (best_of ranks by it)
        self.finish_reason: str | None = None
        self.settled = False
        self.failed = False
        self.pending: list[Entry] = []  # tokens (and logprobs) not yet handed out with a piece

    async def deltas(self) -> AsyncIterator[Delta]:
        """The answer as it comes: (text, token logprob entries) pieces, the prompt first with echo; sets
        ``finish_reason`` at the end. Raises ApiError on a failure."""
        try:
            async for item in self.ticket:
                if isinstance(item, TokenEvent):
                    if item.index == 0 and self.parsed.echo:
                        yield self.prompt.text, self._prompt_entries(item)
                    if self.prompt.drop:  # max_tokens 0: the one token generated is not the answer's
                        continue
                    self.num_tokens += 1
                    if item.logprob is not None:
                        self.cumulative += item.logprob.logprob
                        self.pending.append((item.token_id, item.logprob))
                    piece = self.text.push(item.token_id)
                    if piece:
                        yield piece, self._take()
                    if self.text.stopped:  # a stop string: end here, free the engine's work
                        self.state.worker.abort(self.ticket.request_id)
                        self.finish_reason = "stop"
                        self.state.metrics.count("stopped")
                        if self.pending:
                            yield "", self._take()
                        return
                elif isinstance(item, Finished):
                    self.state.metrics.finished(item.output)
                    piece = "" if self.prompt.drop else self.text.finish()
                    if piece or self.pending:
                        yield piece, self._take()
                    self.finish_reason = "length" if self.prompt.drop else \
                        "stop" if self.text.stopped else item.output.finish_reason
                elif isinstance(item, Failed):
                    self.failed = True
                    self.state.metrics.count("failed")
                    raise ApiError(item.status, item.message)
        finally:
            self.settle()

    def _take(self) -> list[Entry]:
        out, self.pending = self.pending, []
        return out if self.parsed.logprobs is not None else []

    def _prompt_entries(self, event: TokenEvent) -> list[Entry]:
        if self.parsed.logprobs is None or event.prompt_logprobs is None:
            return []
        return list(zip(self.prompt.ids, event.prompt_logprobs, strict=True))

    def settle(self) -> None:
        if self.settled:
            return
        self.settled = True
        self.state.metrics.in_flight -= 1
        if self.finish_reason is None and not self.failed:  # the client left: abort, freeing its blocks
            self.state.worker.abort(self.ticket.request_id)
            self.state.metrics.count("aborted")


class Answer:
    """One accepted request's answer: OpenAI chunks while streaming, or one body at the end. It has a
    choice per prompt and per ``best_of`` (the ``n`` best of each prompt's answered, by cumulative
    logprob), numbered prompt by prompt as vLLM numbers them."""

    def __init__(self, state: Any, tickets: list[Ticket], parsed: Parsed, chat: bool,
                 prompts: list[Prompt]) -> None:
        self.state, self.parsed, self.chat, self.prompts = state, parsed, chat, prompts
        per = parsed.best_of
        self.choices = [Choice(state, t, parsed, i, prompts[i // per]) for i, t in enumerate(tickets)]
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def settle(self) -> None:
        for c in self.choices:
            c.settle()

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p.ids) for p in self.prompts)
        done = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _logprobs(self, choice: Choice, entries: list[Entry], offset: int) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.state.token_text)
        return completion_logprobs(entries, self.state.token_text, offset)

    async def whole(self, request: Request) -> Response:
        """Collect the whole completion, aborting it if the client disconnects meanwhile."""
        texts: dict[int, list[str]] = {c.index: [] for c in self.choices}
        entries: dict[int, list[Entry]] = {c.index: [] for c in self.choices}
        failure: list[ApiError] = []

        async def collect(choice: Choice, scope: anyio.CancelScope) -> None:
            try:
                async with contextlib.aclosing(choice.deltas()) as deltas:
                    async for piece, got in deltas:
                        texts[choice.index].append(piece)
                        entries[choice.index] += got
            except ApiError as e:
                failure.append(e)
                scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
            async with anyio.create_task_group() as inner:
                for choice in self.choices:
                    inner.start_soon(collect, choice, tg.cancel_scope)
            tg.cancel_scope.cancel()
        if failure:
            raise failure[0]
        if any(c.finish_reason is None for c in self.choices):  # the client left: nobody reads this
            self.settle()
            return Response(status_code=499)
        body = []
        for index, choice in enumerate(self._best()):
            content = "".join(texts[choice.index])
            out: dict[str, Any] = {"index": index, "finish_reason": choice.finish_reason,
                                   "logprobs": self._logprobs(choice, entries[choice.index], 0)}
            if self.chat:
                out["message"] = {"role": "assistant", "content": content}
                calls = self._tool_calls(content)
                if calls:
                    out["message"] = {"role": "assistant", "content": calls[0], "tool_calls": calls[1]}
                    out["finish_reason"] = "tool_calls"
            else:
                out["text"] = content
            body.append(out)
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.state.model_name, "choices": body,
                             "usage": self.usage()})

    def _tool_calls(self, content: str) -> tuple[str | None, list[dict]] | None:
        """With tools: the answer's content before its calls, and the calls, if it made any (its
        finish_reason is then "tool_calls")."""
        if self.parsed.tools is None:
            return None
        text, calls = tool_calls_of(content, self.parsed.tools)
        return (text, calls) if calls else None

    def _best(self) -> list[Choice]:
        """The answered choices: per prompt, the n of its best_of with the highest cumulative logprob
        (all of them when best_of == n), in order."""
        per, n = self.parsed.best_of, self.parsed.n
        if per == n:
            return self.choices
        out = []
        for p in range(len(self.prompts)):
            mine = self.choices[p * per:(p + 1) * per]
            out += sorted(mine, key=lambda c: -c.cumulative)[:n]
        return out

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: chunks of each choice's pieces as they come (choices interleaved), a last
        chunk per choice with its finish_reason, the usage if asked, [DONE]."""
        queue: asyncio.Queue = asyncio.Queue()

        async def run(choice: Choice) -> None:
            try:
                async with contextlib.aclosing(choice.deltas()) as deltas:
                    async for delta in deltas:
                        await queue.put((choice, delta))
                await queue.put((choice, None))
            except ApiError as e:
                await queue.put((choice, e))

        tasks = [asyncio.create_task(run(c)) for c in self.choices]
        offsets = dict.fromkeys(range(len(self.choices)), 0)
        held: dict[int, list[str]] = {c.index: [] for c in self.choices}  # with tools: sent whole at the end
        try:
            if self.chat:
                for c in self.choices:
                    yield self._chunk(c, {"role": "assistant", "content": ""}, None, None)
            left = len(self.choices)
            while left:
                choice, item = await queue.get()
                if isinstance(item, ApiError):  # headers are sent: report it in the stream, as OpenAI does
                    yield _sse(item.body())
                    break
                if item is None:
                    left -= 1
                    finish = choice.finish_reason
                    if self.parsed.tools is not None:  # the whole answer: content, or its calls
                        content = "".join(held[choice.index])
                        calls = self._tool_calls(content)
                        delta: dict[str, Any] = {"content": content}
                        if calls:
                            delta = {"content": calls[0], "tool_calls": [dict(c, index=i) for i, c in
                                                                         enumerate(calls[1])]}
                            finish = "tool_calls"
                        yield self._chunk(choice, delta, None, None)
                    yield self._chunk(choice, {} if self.chat else "", finish, None)
                    continue
                piece, entries = item
                if self.parsed.tools is not None:
                    held[choice.index].append(piece)
                    continue
                logprobs = self._logprobs(choice, entries, offsets[choice.index])
                offsets[choice.index] += sum(len(self.state.token_text(t)[0]) for t, _ in entries)
                yield self._chunk(choice, {"content": piece} if self.chat else piece, None, logprobs)
            else:
                if self.parsed.include_usage:
                    yield _sse({**self._envelope(), "choices": [], "usage": self.usage()})
        finally:
            for t in tasks:
                t.cancel()
            self.settle()
        yield "data: [DONE]\n\n"

    def _envelope(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.state.model_name}

    def _chunk(self, choice: Choice, delta: Any, finish_reason: str | None, logprobs: dict | None) -> str:
        out: dict[str, Any] = {"index": choice.index, "finish_reason": finish_reason, "logprobs": logprobs}
        out.update({"delta": delta} if self.chat else {"text": delta})
        chunk = {**self._envelope(), "choices": [out]}
        if self.parsed.include_usage:
            chunk["usage"] = None
        return _sse(chunk)


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    await wait_disconnect(request.receive)
    scope.cancel()


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
