"""Running a batch of requests through a pool (``run_requests``), and the process-level faults
(``ProcessFaults``: kill a worker mid-transfer, cancel a request) that the batch command and the
fault-matrix test inject."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from reference.disagg.coordinator import CoordinatorError, RequestState
from reference.disagg.frames import Frame, Kind
from reference.disagg.pool import WorkerPool


class ProcessFaults:
    """Process-level faults on one request chosen by the seed: kill its prefill worker when its
    first KV frame passes, kill its decode worker at its second token, or cancel it after its first
    KV frame."""

    def __init__(self, pool: WorkerPool, faults: Sequence[str], seed: int,
                 num_requests: int) -> None:
        self.pool, self.faults = pool, set(faults)
        self.target = random.Random(seed).randrange(max(1, min(num_requests, 4)))
        self.seen: list[str] = []
        self.done: set[str] = set()
        pool.coordinator.on_stream_frame = self.on_frame

    def on_frame(self, req: RequestState, frame: Frame) -> None:
        if req.id not in self.seen and frame.kind is Kind.KV:
            self.seen.append(req.id)
        if len(self.seen) <= self.target or req.id != self.seen[self.target]:
            return
        if (
            "kill-prefill" in self.faults
            and "kill-prefill" not in self.done
            and frame.kind is Kind.KV
            and req.prefill is not None
        ):
            self.done.add("kill-prefill")
            self.pool.kill(req.prefill)
        if "abort" in self.faults and "abort" not in self.done and frame.kind is Kind.KV:
            self.done.add("abort")
            self.pool.coordinator.cancel(req.id)
        if (
            "kill-decode" in self.faults
            and "kill-decode" not in self.done
            and frame.kind is Kind.TOKEN
            and len(req.tokens) >= 2
            and req.decode is not None
        ):
            self.done.add("kill-decode")
            self.pool.kill(req.decode)


def run_requests(pool: WorkerPool, requests: Sequence[dict], *,
                 arrivals: Sequence[float] | None = None,
                 on_progress: Callable[[int], None] | None = None,
                 timeout: float = 3600.0) -> list[dict]:
    """Submit every request (at ``arrivals[i]`` seconds from now, if given), run until each has
    ended, and return one result per request, in order:
    ``{"id", "output_token_ids", "finish_reason", "error"}``."""
    coord = pool.coordinator
    results: list[dict | None] = [None] * len(requests)
    start = time.monotonic()
    order = sorted(range(len(requests)), key=lambda i: arrivals[i] if arrivals else 0.0)
    pos, finished = 0, 0
    while pos < len(order) or coord.unfinished():
        now = time.monotonic() - start
        while pos < len(order) and (arrivals is None or arrivals[order[pos]] <= now):
            i = order[pos]
            r = requests[i]
            try:
                coord.submit(r.get("id"), r.get("prompt_token_ids"), r.get("max_tokens"),
                             sampling=r.get("sampling"))
            except CoordinatorError as e:
                results[i] = {"id": r.get("id"), "output_token_ids": [], "finish_reason": "error",
                              "error": f"not accepted: {e}"}
            pos += 1
        if now > timeout:
            for req in coord.requests.values():
                if req.result is None:
                    coord.cancel(req.id, f"run timed out after {timeout} s")
        pool.pump()
        done = sum(r.result is not None for r in coord.requests.values())
        if on_progress is not None and done != finished:
            on_progress(done - finished)
            finished = done
    for i, r in enumerate(requests):
        if results[i] is None:
            results[i] = dict(coord.requests[r["id"]].result)
    return results  # type: ignore[return-value]

