"""The engine thread with a scripted engine: token delivery, aborts, an engine fault, drain on shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from reference.engine.params import EngineError, SamplingParams
from reference.engine.request import RequestMetrics, RequestOutput, TokenEvent
from serve.engine_thread import Arrival, EngineThread, Failed, Finished, Rejected, Submission


class ScriptedEngine:
    """One token per request per step; ``fail_at``: the step number that raises."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.live: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.steps, self.fail_at, self.aborted = 0, fail_at, []

    def add_request(self, ids, params, *, tenant, request_id, cache_salt):
        if ids == [0]:
            raise EngineError("token 0 is refused")
        self.live[request_id], self.max_tokens[request_id] = [], params.max_tokens

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list[TokenEvent]:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("device lost")
        time.sleep(0.01)
        events = []
        for rid, out in list(self.live.items()):
            out.append(len(out))
            done = len(out) == self.max_tokens[rid]
            events.append(TokenEvent(rid, out[-1], len(out) - 1, 0.0, done, "length" if done else None))
            if done:
                self.finished = self.live.pop(rid)
        return events

    def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        return self.live.pop(rid, None) is not None

    def output(self, rid: str) -> RequestOutput:
        return RequestOutput(rid, [1], list(self.finished), "", "length", "default", RequestMetrics(0.0), 0)


async def collect(worker: EngineThread, max_tokens: int) -> list:
    ticket = await worker.submit(Submission([1, 2], SamplingParams(max_tokens=max_tokens)))
    return [item async for item in ticket]


def test_tokens_arrive_in_order_then_finished_and_refusals_are_400():
    worker = EngineThread(ScriptedEngine())
    worker.start()
    try:
        items = asyncio.run(collect(worker, 3))
        assert [i.token_id for i in items[:-1]] == [0, 1, 2] and isinstance(items[-1], Finished)
        with pytest.raises(Rejected) as e:
            asyncio.run(worker.submit(Submission([0], SamplingParams())))
        assert e.value.failure.status == 400 and "token 0" in e.value.failure.message
    finally:
        worker.stop()
    assert not worker._thread.is_alive()


def test_an_engine_fault_fails_every_request_and_later_ones():
    worker = EngineThread(ScriptedEngine(fail_at=3))
    worker.start()
    try:
        items = asyncio.run(collect(worker, 50))
        assert isinstance(items[-1], Failed) and items[-1].status == 503 and "device lost" in items[-1].message
        assert not worker.alive and "device lost" in worker.error
        with pytest.raises(Rejected) as e:
            asyncio.run(worker.submit(Submission([1], SamplingParams())))
        assert e.value.failure.status == 503
    finally:
        worker.stop()


def test_drain_aborts_what_outlives_the_grace_period():
    engine = ScriptedEngine()
    worker = EngineThread(engine, idle_poll_s=0.01)
    worker.start()

    async def run() -> list:
        ticket = await worker.submit(Submission([1], SamplingParams(max_tokens=10_000)))
        worker.drain(0.2)
        started = time.monotonic()
        items = [item async for item in ticket]
        assert time.monotonic() - started < 5
        with pytest.raises(Rejected):  # no new work while draining
            await worker.submit(Submission([1], SamplingParams()))
        return items

    try:
        items = asyncio.run(run())
        assert isinstance(items[-1], Failed) and "shutting down" in items[-1].message
        assert 0 < len(items) - 1 < 10_000 and engine.aborted and not engine.live
    finally:
        worker.stop()


def test_a_real_engine_forgets_answered_requests_and_trims_its_step_log():
    """A server runs for days: answered (or aborted) requests are released, the step log stays bounded."""
    from reference.engine import Engine
    from tests.test_engine_intake import tiny_model

    engine = Engine(tiny_model(), num_blocks=16, block_size=4)
    worker = EngineThread(engine, keep_steps=3)
    worker.start()

    async def run() -> None:
        await asyncio.gather(*(collect(worker, 12) for _ in range(3)))
        ticket = await worker.submit(Submission([1, 2], SamplingParams(max_tokens=10_000, ignore_eos=True)))
        worker.abort(ticket.request_id)

    try:
        asyncio.run(run())
        deadline = time.monotonic() + 10
        while worker.call(lambda e: bool(e.requests) or e.has_unfinished()).result(timeout=10):
            assert time.monotonic() < deadline, "the aborted request was never released"
            time.sleep(0.01)
        assert len(engine.step_log) <= 6
    finally:
        worker.stop()


def test_an_emulated_device_step_lasts_at_least_its_floor():
    """``--emulate-step-ms``: each step sleeps up to the floor (so replicas scale as devices would)."""
    worker = EngineThread(ScriptedEngine(), step_floor_s=0.05)
    worker.start()
    try:
        t0 = time.monotonic()
        items = asyncio.run(collect(worker, 4))
        assert isinstance(items[-1], Finished) and time.monotonic() - t0 >= 4 * 0.05
    finally:
        worker.stop()


def test_emulate_step_ms_is_checked():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "serve", "--emulate-step-ms", "-1"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--emulate-step-ms must be in 0..10000" in r.stderr


class CountingEngine(ScriptedEngine):
    """Records how many requests each step carries and when the first step ran."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.first_step_at: float | None = None

    def step(self) -> list[TokenEvent]:
        self.sizes.append(len(self.live))
        if self.first_step_at is None:
            self.first_step_at = time.monotonic()
        return super().step()


def test_a_burst_reaching_an_idle_engine_is_gathered_into_one_first_step():
    """--burst-gather-ms: requests arriving 5 ms apart (gap allowed: 200 ms) join the first step; a lone
    request waits one gap, not the whole 2 s window."""
    engine = CountingEngine()
    worker = EngineThread(engine, gather_s=2.0, gather_gap_s=0.2)
    worker.start()

    async def burst() -> list:
        async def late(i: int) -> list:
            await asyncio.sleep(0.005 * i)
            return await collect(worker, 3)
        return await asyncio.gather(*(late(i) for i in range(4)))

    try:
        results = asyncio.run(burst())
        assert all(isinstance(r[-1], Finished) for r in results)
        assert engine.sizes[0] == 4
        lone = CountingEngine()
        alone = EngineThread(lone, gather_s=2.0, gather_gap_s=0.2)
        alone.start()
        try:
            t0 = time.monotonic()
            assert isinstance(asyncio.run(collect(alone, 2))[-1], Finished)
            assert lone.first_step_at - t0 < 1.0  # one gap, not the 2 s window
        finally:
            alone.stop()
    finally:
        worker.stop()


def test_the_gather_waits_for_a_request_still_being_read_past_the_gap():
    """A request an HTTP handler is still reading (``arriving``) holds the first step past the gap; the
    step goes as soon as nothing is arriving and the gap passes."""
    engine = CountingEngine()
    worker = EngineThread(engine, gather_s=5.0, gather_gap_s=0.05)
    worker.start()

    async def two() -> list:
        arrival = Arrival(worker)  # a second request is on its way
        first = asyncio.ensure_future(collect(worker, 2))
        await asyncio.sleep(0.4)  # 8 gaps
        ticket = await worker.submit(Submission([1, 2], SamplingParams(max_tokens=2)), arrival)  # queued, then closed
        assert not arrival.open and worker.arriving == 0
        second = [item async for item in ticket]
        return [await first, second]

    try:
        t0 = time.monotonic()
        results = asyncio.run(two())
        assert all(isinstance(r[-1], Finished) for r in results)
        assert engine.sizes[0] == 2 and worker.gathered == 1
        assert engine.first_step_at - t0 < 3.0  # not the whole 5 s window
    finally:
        worker.stop()
