"""The engine's own thread: it alone touches the engine, so HTTP handling never waits for a step.

The engine is single-threaded. ``EngineThread`` runs it on a thread that owns it: HTTP handlers put
commands on a queue (add a request, abort one, run a function on the engine, drain, stop), and the
thread steps the engine whenever requests are unfinished, handing each token to the request's
``asyncio.Queue`` with ``loop.call_soon_threadsafe``. Between steps it takes every queued command,
so a new request joins the very next step (continuous batching) and an abort frees its KV blocks
before the next step runs.

What a request's queue receives: ``Accepted`` once (or ``Failed`` if the engine refused it), then a
``TokenEvent`` per token, then ``Finished`` with the engine's ``RequestOutput`` (tokens, metrics);
or ``Failed`` at any point (shutdown, an engine fault).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from reference.engine.params import EngineError, SamplingParams
from reference.engine.request import RequestOutput, TokenEvent

GATHER_GAP_S = 0.015  # --burst-gather-ms: a burst's requests reach the engine ~3-9 ms apart on one busy core


@dataclass(frozen=True)
class Accepted:
    request_id: str


@dataclass(frozen=True)
class Finished:
    output: RequestOutput


@dataclass(frozen=True)
class Failed:
    status: int  # the HTTP status to answer with (400: the request; 503: the server)
    message: str


@dataclass(frozen=True)
class Submission:
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str = "default"
    cache_salt: str | None = None


@dataclass
class Ticket:
    """A submitted request, as its HTTP handler sees it: iterate it for tokens, then ``Finished``."""

    request_id: str
    queue: asyncio.Queue
    done: bool = False

    async def __aiter__(self) -> AsyncIterator[TokenEvent | Finished | Failed]:
        while not self.done:
            item = await self.queue.get()
            self.done = isinstance(item, Finished | Failed)
            yield item


@dataclass
class _Live:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class Stats:
    """A snapshot of the engine's state, taken on its thread after each step (read by /metrics)."""

    waiting: int = 0
    running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_hit_tokens: int = 0
    prefix_lookup_tokens: int = 0
    gathered: int = 0  # requests that joined an idle engine's first step during --burst-gather-ms
    extra_lines: list[str] = field(default_factory=list)  # the engine's own /metrics lines, if it has any


class Arrival:
    """A request an HTTP handler is reading, counted in its worker's ``arriving`` until ``close()``
    (``submit`` closes it once the request is queued; the handler closes it on any other way out)."""

    def __init__(self, worker: EngineThread) -> None:
        self.worker, self.open = worker, True
        worker.arriving += 1

    def close(self) -> None:
        if self.open:
            self.open = False
            self.worker.arriving -= 1


class EngineThread:
    """Owns an engine on a thread of its own. Start with ``start()``; stop with ``stop()``."""

    def __init__(self, engine: Any, *, idle_poll_s: float = 0.05, keep_steps: int = 4096,
                 step_floor_s: float = 0.0, gather_s: float = 0.0, gather_gap_s: float = GATHER_GAP_S) -> None:
        """``step_floor_s``: every step lasts at least this long (the rest slept: ``--emulate-step-ms``).

        ``gather_s`` (``--burst-gather-ms``): when a request reaches an idle engine, the first step waits
        while more requests are on their way (``arriving``: HTTP handlers that have started reading a
        request and not yet submitted it) or keep coming (each within ``gather_gap_s`` of the last), for
        at most ``gather_s``, so that a burst is prefilled together and no early arrival decodes beside
        the rest's prefill chunks (the decode stall a burst otherwise causes). A lone request waits
        ``gather_gap_s`` once; a running engine never waits."""
        self.engine = engine
        self.step_floor_s = step_floor_s
        self.gather_s, self.gather_gap_s = gather_s, min(gather_gap_s, gather_s)
        self.gathered = 0
        self.arriving = 0  # requests being read by HTTP handlers (changed on the event loop's thread only)
        self.idle_poll_s = idle_poll_s
        self.keep_steps = keep_steps  # the engine's step log is trimmed to its latest records (a server runs for days)
        self.max_model_len: int | None = getattr(engine, "max_model_len", None)
        self.stats = Stats()
        self.error: str | None = None  # set when the engine failed; /health then answers 503
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._drain_deadline: float | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # -- called from the HTTP side ---------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def submit(self, sub: Submission, arrival: Arrival | None = None) -> Ticket:
        """Queue a request; returns once the engine has accepted it. Raises ``Rejected`` if not.
        ``arrival``: the request's place in ``arriving``, given up once the engine's queue holds it (not
        before: an engine gathering a burst would otherwise see nothing arriving and nothing queued)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rid = f"req-{next(self._ids)}"
        self._commands.put(("add", rid, sub, _Live(loop, q)))
        if arrival is not None:
            arrival.close()
        try:
            first = await q.get()
        except asyncio.CancelledError:  # the client left before the engine answered
            self.abort(rid)  # queued after the add, so it finds the request if it was accepted
            raise
        if isinstance(first, Failed):
            raise Rejected(first)
        return Ticket(rid, q)

    def abort(self, request_id: str) -> None:
        """Abort a request (its client left); its KV blocks are freed before the next step."""
        self._commands.put(("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps (for checks and tests)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, fut))
        return fut

    def drain(self, grace_s: float) -> None:
        """Refuse new requests; let running ones finish for ``grace_s`` seconds, then abort the rest."""
        self._commands.put(("drain", grace_s))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left, stop the thread and wait for it."""
        self._commands.put(("stop",))
        self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            busy = bool(self._live) and engine.has_unfinished()
            if not self._take_commands(block=not busy):
                break
            if not busy and self.gather_s and self._live and not self._gather():
                break
            if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                self._fail_all(503, "the server is shutting down; the request was aborted")
            if not (self._live and engine.has_unfinished()):
                continue
            started = time.monotonic()
            try:
                events = engine.step()
                if self.step_floor_s:  # an emulated device: a step takes its time whatever the CPU did
                    time.sleep(max(0.0, started + self.step_floor_s - time.monotonic()))
            except Exception as e:  # an engine fault: tell every client, then refuse new work
                self.error = f"engine step failed: {type(e).__name__}: {e}"
                self._fail_all(503, self.error, abort=False)
                self._take_commands_until_stop()
                return
            for event in events:
                self._deliver_token(event)
            log = getattr(engine, "step_log", None)
            if isinstance(log, list) and len(log) > 2 * self.keep_steps:
                del log[:-self.keep_steps]
            self._snapshot()
        self._fail_all(503, "the server is shutting down; the request was aborted")

    def _take_commands(self, block: bool) -> bool:
        """Handle queued commands (waiting a little for one when idle). False: stop was asked."""
        timeout = self.idle_poll_s if self._drain_deadline is not None else None
        try:
            cmd = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _gather(self) -> bool:
        """Take the commands of a burst (see ``gather_s``). False: stop was asked."""
        deadline = time.monotonic() + self.gather_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                cmd = self._commands.get(timeout=max(0.001, min(self.gather_gap_s, left)))  # no spin at gap 0
            except queue.Empty:
                if self.arriving > 0:  # a handler is still reading or tokenizing one: it will come
                    continue
                try:  # none arriving now, but one may have stopped arriving since the wait ran out: submit
                    cmd = self._commands.get_nowait()  # queues a request before it closes its arrival
                except queue.Empty:
                    return True
            if cmd[0] == "stop":
                return False
            self.gathered += cmd[0] == "add"
            self._handle(cmd)
        return True

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, sub, live = cmd
            if self._drain_deadline is not None:
                _post(live, Failed(503, "the server is shutting down"))
                return
            try:
                self.engine.add_request(sub.prompt_ids, sub.params, tenant=sub.tenant, request_id=rid,
                                        cache_salt=sub.cache_salt)
            except EngineError as e:
                _post(live, Failed(400, str(e)))
                return
            except Exception as e:  # not a refusal the engine documents: answer, keep the thread alive
                _post(live, Failed(500, f"the engine could not take the request: {type(e).__name__}: {e}"))
                return
            self._live[rid] = live
            _post(live, Accepted(rid))
            self._snapshot()
        elif kind == "abort":
            if self._live.pop(cmd[1], None) is not None:
                self.engine.abort(cmd[1])
                _forget(self.engine, cmd[1])
                self._snapshot()
        elif kind == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:
                fut.set_exception(e)
        elif kind == "drain":
            self._drain_deadline = time.monotonic() + cmd[1]

    def _take_commands_until_stop(self) -> None:
        while True:
            cmd = self._commands.get()
            if cmd[0] == "stop":
                return
            if cmd[0] == "add":
                _post(cmd[3], Failed(503, self.error or "the engine has stopped"))
            elif cmd[0] == "call":
                cmd[2].set_exception(RuntimeError(self.error or "the engine has stopped"))

    def _deliver_token(self, event: TokenEvent) -> None:
        live = self._live.get(event.request_id)
        if live is None:
            return
        _post(live, event)
        if event.finished:
            del self._live[event.request_id]
            _post(live, Finished(self.engine.output(event.request_id)))
            _forget(self.engine, event.request_id)

    def _fail_all(self, status: int, message: str, abort: bool = True) -> None:
        for rid, live in list(self._live.items()):
            if abort:
                self.engine.abort(rid)
                _forget(self.engine, rid)
            _post(live, Failed(status, message))
        self._live.clear()
        self._snapshot()

    def _snapshot(self) -> None:
        e = self.engine
        stats = Stats(gathered=self.gathered)
        sched, bm = getattr(e, "scheduler", None), getattr(e, "block_manager", None)
        if sched is not None:
            stats.waiting, stats.running = len(sched.waiting), len(sched.running)
        if bm is not None:
            stats.kv_blocks_total = bm.num_blocks
            stats.kv_blocks_used = sum(1 for r in bm.ref_count if r > 0)
            stats.prefix_hit_tokens, stats.prefix_lookup_tokens = bm.num_hit_tokens, bm.num_lookup_tokens
        lines = getattr(e, "metric_lines", None)
        if callable(lines):
            stats.extra_lines = lines()
        self.stats = stats  # one reference swap: readers see a whole snapshot


class Rejected(Exception):
    """The engine refused a request (``failure.status``: 400 bad request, 503 shutting down)."""

    def __init__(self, failure: Failed) -> None:
        super().__init__(failure.message)
        self.failure = failure


def _post(live: _Live, item: Any) -> None:
    try:
        live.loop.call_soon_threadsafe(live.queue.put_nowait, item)
    except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
        pass


def _forget(engine: Any, request_id: str) -> None:
    """Drop a finished request's bookkeeping so a long-running server does not grow without bound."""
    release = getattr(engine, "release", None)
    if release is not None:
        release(request_id)
    elif isinstance(getattr(engine, "requests", None), dict):
        engine.requests.pop(request_id, None)
