"""The discrete-event simulator: the real scheduler per replica, on a virtual clock.

Events live in one heap ordered by (virtual time, sequence number), so equal times pop in the order
they were pushed and a run is a pure function of (scenario, seed): the only randomness is one
``numpy`` Generator, and nothing reads the wall clock (a test runs a whole simulation with
``time.time``/``monotonic``/``perf_counter`` made to raise). Every processed event is folded into a
BLAKE2b hash, the **event-log hash**: the same scenario and seed give the same hash.

A request's life: it arrives at its origin site; the router (``router.py``) picks a replica; after
the network delay it joins that replica's scheduler; each step of that replica takes the time the
step cost model gives; each sampled token reaches the client one network delay later. On a
disaggregated prefill replica the request generates its first token, then its KV travels to a
decode replica (time from the path's RTT and bandwidth), which decodes the rest. A site failure
empties its replicas; their requests (and any in transit to them) are routed again from scratch.
Every site that computes a request or that its KV crosses is recorded in ``Request.visited``,
independently of the router, so the residency rule can be audited afterwards.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
import zlib
from collections.abc import Callable
from typing import IO

import numpy as np

from reference.cluster.costs import kv_bytes_per_token
from reference.cluster.fleet import Request, RequestSource, build_replicas
from reference.cluster.network import Network, Path
from reference.cluster.replica import Replica
from reference.cluster.report import SimResult, trace_record
from reference.cluster.router import Decision, Router, RouteRequest
from reference.cluster.scenario import Scenario, ScenarioError
from reference.engine.cost import StepShape
from reference.sched import RequestError
from reference.sched import Sequence as SchedSequence

ARRIVE, REACH, STEP, KV, FAIL, RECOVER, RETRY, REPLAY = range(8)
RETRY_AFTER_S = 0.5  # a request with no live replica allowed tries again this much later


class Simulator:
    def __init__(self, scenario: Scenario, seed: int = 0, *, lengths: np.ndarray | None = None,
                 cost_override: Callable[[StepShape], float] | None = None, num_blocks: int | None = None,
                 replay: list[tuple[float, list[int], int]] | None = None, trace: IO[str] | None = None,
                 record_gaps: bool = False, record_ids: bool = False) -> None:
        """``replay``: instead of drawing arrivals, replay these (arrival time, prompt ids, output length)
        as traffic class 0 (to mirror a workload run on a real engine); see ``build_replicas`` for the
        overrides. ``record_gaps``/``record_ids``: keep every inter-token gap / each request's TTFT by id.
        Requests are drawn from the RNG before any routing, so two runs of scenarios that differ only in
        routing rules see the same requests under the same ids."""
        if lengths is None and any(t.lengths == "sharegpt" for t in scenario.traffic):
            from reference.cluster.lengths import sharegpt_lengths

            lengths = sharegpt_lengths()
        self.s = scenario
        self.rng = np.random.default_rng(seed)
        self.replicas: list[Replica] = build_replicas(scenario, cost_override, num_blocks)
        self.replay = replay
        self.network = Network(scenario)
        self.router = Router(scenario, self.replicas, self.network)
        self.source = RequestSource(scenario, self.rng, lengths)
        self.trace, self.record_gaps = trace, record_gaps
        self.heap: list[tuple[float, int, int, object, object]] = []
        self.count = 0
        self.now = 0.0
        self.hash = hashlib.blake2b(digest_size=16, person=b"unfire-cluster")
        self.result = SimResult(ttft_by_id={} if record_ids else None)
        self.kv_bytes = {m.name: kv_bytes_per_token(m) for m in scenario.models.values()}

    def push(self, t: float, kind: int, a: object = None, b: object = None) -> None:
        heapq.heappush(self.heap, (t, self.count, kind, a, b))
        self.count += 1

    def run(self, on_progress: Callable[[float], None] | None = None) -> SimResult:
        """Process every event; returns the metrics. ``on_progress(virtual time)`` every 10,000 events."""
        if self.replay is None:
            for k in range(len(self.s.traffic)):
                self.push(self.source.gap(k), ARRIVE, k)
        else:
            for i, (arrival, _, _) in enumerate(self.replay):
                self.push(arrival, REPLAY, i)
        for f in self.s.failures:
            self.push(f.at_s, FAIL, f.site)
            self.push(f.at_s + f.duration_s, RECOVER, f.site)
        handlers = {ARRIVE: self._arrive, REACH: self._reach, STEP: self._step, KV: self._kv,
                    FAIL: self._fail, RECOVER: self._recover, RETRY: lambda r, _: self._route(r),
                    REPLAY: lambda i, _: self._route(self.source.make_from(0, self.now, *self.replay[i][1:]))}
        n = 0
        while self.heap:
            t, _, kind, a, b = heapq.heappop(self.heap)
            self.now = t
            self.hash.update(struct.pack("<dBq", t, kind, _event_id(a)))
            handlers[kind](a, b)
            n += 1
            if on_progress is not None and n % 10_000 == 0:
                on_progress(t)
        self.result.finalize(self.replicas, self.now, n, self.hash.hexdigest(), self.s.duration_s)
        return self.result

    # ---- events --------------------------------------------------------------------------------

    def _arrive(self, k: int, _: object) -> None:
        nxt = self.now + self.source.gap(k)
        if nxt < self.s.duration_s:
            self.push(nxt, ARRIVE, k)
        r = self.source.make(k, self.now)
        self._route(r)

    def _route(self, r: Request) -> None:
        d: Decision = self.router.route(RouteRequest(r.origin, r.allowed, r.models, r.prefix_keys))
        r.decision, r.reason = d, d.reason
        if d.refused:
            self._done(r, "refused")
        elif d.wait:
            if self.now + RETRY_AFTER_S - r.arrival > self.s.max_wait_s:
                r.reason = f"refused: no live replica in {list(r.allowed)} within max_wait_s {self.s.max_wait_s} s"
                self._done(r, "refused")
            else:
                self.push(self.now + RETRY_AFTER_S, RETRY, r)
        else:
            self.push(self.now + r.access_s + d.path_in.one_way_s, REACH, r, (d.prefill, d.prefill.epoch))

    def _reach(self, r: Request, target: tuple[Replica, int]) -> None:
        rep, epoch = target
        if not rep.alive or rep.epoch != epoch:
            return self._reroute(r)
        r.visited.extend(r.decision.path_in.sites[1:-1])  # sites the prompt crossed on its way (not the origin)
        disagg = rep.role == "prefill"
        seq = SchedSequence(prompt_token_ids=r.prompt, max_tokens=1 if disagg else r.output_len, tenant=r.plan,
                            arrival_time=self.now, request=r)
        self._admit(r, rep, seq)

    def _admit(self, r: Request, rep: Replica, seq: SchedSequence) -> None:
        try:
            rep.add(seq, self.now)
        except RequestError as e:
            r.reason = f"refused by {rep.site}: {e}"
            return self._done(r, "refused")
        r.visited.append(rep.site)
        self._kick(rep)

    def _kick(self, rep: Replica) -> None:
        planned = rep.start_step(self.now)
        if planned is not None:
            batch, end = planned
            self.push(end, STEP, rep, (batch, rep.epoch))

    def _step(self, rep: Replica, payload: tuple) -> None:
        batch, epoch = payload
        if rep.epoch != epoch:
            return  # the replica failed during this step
        for e in rep.finish_step(batch, self.now):
            if not e.needs_sample:
                continue
            r: Request = e.seq.request
            d: Decision = r.decision
            back = d.path_in.one_way_s if rep is d.prefill else self._path(rep.site, r).one_way_s
            self._token(r, self.now + back + r.access_s)
            if not e.seq.is_finished:
                continue
            if rep.role == "prefill" and r.output_len > 1:
                dec = d.decode
                seconds = d.kv_path.transfer_s(len(r.prompt) * self.kv_bytes[rep.model])
                r.visited.extend(d.kv_path.sites)
                self.push(self.now + seconds, KV, r, (rep, rep.epoch, dec, dec.epoch))
            else:
                r.finish = r.last_token
                self._done(r, "done")
        self._kick(rep)

    def _kv(self, r: Request, payload: tuple) -> None:
        src, src_epoch, dec, dec_epoch = payload
        if src.epoch != src_epoch or dec.epoch != dec_epoch or not dec.alive:
            return self._reroute(r)  # the transfer was lost with a failed site
        tokens = [*r.prompt, 0]
        dec.import_kv(tokens)
        seq = SchedSequence(prompt_token_ids=tokens, max_tokens=r.output_len - 1, tenant=r.plan,
                            arrival_time=self.now, request=r)
        self._admit(r, dec, seq)

    def _fail(self, site: str, _: object) -> None:
        if site not in self.s.sites:
            raise ScenarioError(f"failure at unknown site {site!r}")
        lost = []
        for rep in self.replicas:
            if rep.site == site:
                lost += [seq.request for seq in (*rep.scheduler.running, *rep.scheduler.waiting)]
                rep.alive = False
                rep.epoch += 1
                rep.reset()
        self.result.failures += 1
        for r in sorted(lost, key=lambda r: r.rid):
            self._reroute(r)

    def _recover(self, site: str, _: object) -> None:
        for rep in self.replicas:
            if rep.site == site:
                rep.alive = True

    # ---- helpers -------------------------------------------------------------------------------

    def _reroute(self, r: Request) -> None:
        r.retries += 1
        self._route(r)

    def _path(self, site: str, r: Request) -> Path:
        return self.network.path(site, r.origin, r.allowed, also=r.origin)

    def _token(self, r: Request, t: float) -> None:
        if r.first_token is None:
            r.first_token = t
        elif self.record_gaps:
            r.gaps.append(t - r.last_token)
        r.last_token = t

    def _done(self, r: Request, outcome: str) -> None:
        r.outcome = outcome
        self.result.add(r, self.network.jurisdiction)
        if self.trace is not None:
            self.trace.write(trace_record(r, self.network.jurisdiction) + "\n")


def _event_id(a: object) -> int:
    if isinstance(a, Request):
        return a.rid
    if isinstance(a, Replica):
        return a.index
    if isinstance(a, int):
        return a
    return -1 if a is None else zlib.crc32(str(a).encode())


def simulate(scenario: Scenario, seed: int = 0, **kwargs: object) -> SimResult:
    """Run one scenario to completion (see ``Simulator``)."""
    return Simulator(scenario, seed, **kwargs).run()

