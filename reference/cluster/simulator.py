"""The discrete-event simulator: the real scheduler per replica, on a virtual clock.

Events live in one heap ordered by virtual time; at equal times the end of a replica's step comes
after every other event (so a request that reaches a replica exactly when a step ends joins the next
step), steps ending together go in replica order, and other events in the order they were pushed. An
idle replica that a request reaches while more events are due at that same time starts its step
after them too (a ``KICK`` event): a burst of requests joins one step, as the engine takes in every
request that has arrived before it plans a step. A
run is a pure function of (scenario, seed): the only randomness is one ``numpy`` Generator, and
nothing reads the wall clock (a test runs a whole simulation with ``time.time``/``monotonic``/
``perf_counter`` made to raise). Every event (time, kind, subject) is hashed with BLAKE2b and the
hashes are summed modulo 2**128 (``eventlog.py``): the **event-log hash**, a fingerprint of the
whole log that the same scenario and seed reproduce.

Macro steps (``macro.py``, on unless ``macro_steps=False``): when a replica's next steps are
provably plain decode steps, one queued event stands for up to ``macro_cap`` of them. The run is the
same either way: the same per-request times, the same event-log hash and event count (each planned
step is logged as the step event it stands for); only the queue holds fewer events.

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

import gc
import heapq
from collections.abc import Callable
from typing import IO

import numpy as np

from reference.cluster.build import Request, RequestSource, build_replicas
from reference.cluster.costs import kv_bytes_per_token
from reference.cluster.eventlog import EventLog, event_id
from reference.cluster.macro import MacroStep
from reference.cluster.network import Network, Path
from reference.cluster.replica import Replica
from reference.cluster.report import SimResult, trace_record
from reference.cluster.router import Decision, Router, RouteRequest
from reference.cluster.scenario import Scenario, ScenarioError
from reference.engine.cost import StepShape
from reference.sched import RequestError
from reference.sched import Sequence as SchedSequence

ARRIVE, REACH, STEP, KV, FAIL, RECOVER, RETRY, REPLAY, KICK = range(9)
RETRY_AFTER_S = 0.5  # a request with no live replica allowed tries again this much later
MACRO_CAP = 256  # most plain decode steps one macro step stands for


class Simulator:
    def __init__(self, scenario: Scenario, seed: int = 0, *, lengths: np.ndarray | None = None,
                 cost_override: Callable[[StepShape], float] | None = None,
                 num_blocks: int | None = None,
                 replay: list[tuple[float, list[int], int]] | None = None,
                 trace: IO[str] | None = None, record_gaps: bool = False, record_ids: bool = False,
                 macro_steps: bool = True) -> None:
        """``replay``: instead of drawing arrivals, replay these (arrival time, prompt ids, output
        length) as traffic class 0 (to mirror a workload run on a real engine); see
        ``build_replicas`` for the overrides. ``record_gaps``/``record_ids``: keep every inter-token
        gap / each request's TTFT by id.
        ``macro_steps=False``: one event per step (the same run, more slowly; see the module
        docstring). Requests are drawn from the RNG before any routing, so two runs of scenarios
        that differ only in routing rules see the same requests under the same ids."""
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
        self.heap: list[tuple[float, int, int, int, int, object, object]] = []
        self.count = 0
        self.now = 0.0
        self.kick_due: set[int] = set()  # replicas with a deferred step start queued (``_admit``)
        self.macro_steps = macro_steps
        # each replica's next macro-step length: halved towards what a cut plan used, doubled after
        # a whole
        # plan ran (steps planned past a cut are wasted work; the run is the same whatever the
        # length)
        self.caps = [8] * len(self.replicas)
        # every event logged (a macro step logs each step it stands for)
        self.event_log = EventLog()
        self.queue_events = 0  # events taken from the queue
        self.result = SimResult(ttft_by_id={} if record_ids else None)
        self.kv_bytes = {m.name: kv_bytes_per_token(m) for m in scenario.models.values()}

    def push(self, t: float, kind: int, a: object = None, b: object = None) -> None:
        """Queue an event; a step's end (or a deferred step start) sorts after the other events at
        its time, then by replica."""
        if kind in (STEP, KICK):
            heapq.heappush(self.heap, (t, 1, a.index, self.count, kind, a, b))
        else:
            heapq.heappush(self.heap, (t, 0, 0, self.count, kind, a, b))
        self.count += 1

    def run(self, on_progress: Callable[[float], None] | None = None) -> SimResult:
        """Process every event; returns the metrics. ``on_progress(virtual time)`` every 10,000
        events."""
        if self.replay is None:
            for k in range(len(self.s.traffic)):
                self.push(self.source.gap(k), ARRIVE, k)
        else:
            for i, (arrival, _, _) in enumerate(self.replay):
                self.push(arrival, REPLAY, i)
        for f in self.s.failures:
            self.push(f.at_s, FAIL, f.site)
            self.push(f.at_s + f.duration_s, RECOVER, f.site)
        handlers = {
            ARRIVE: self._arrive,
            REACH: self._reach,
            STEP: self._step,
            KV: self._kv,
            KICK: self._kicked,
            FAIL: self._fail,
            RECOVER: self._recover,
            RETRY: lambda r, _: self._route(r),
            REPLAY: lambda i, _: self._route(
                self.source.make_from(0, self.now, *self.replay[i][1:])
            ),
        }
        thresholds = gc.get_threshold()
        # the loop allocates fast and makes no garbage cycles to speak of:
        gc.set_threshold(50_000, *thresholds[1:])
        # a young-generation sweep every 50,000 allocations, not 700;
        freeze = gc.get_freeze_count() == 0
        # and what exists now (the replicas' block tables: millions of slots) is left out of full
        # sweeps
        if freeze:
            gc.freeze()
        try:
            self._loop(handlers, on_progress)
        finally:
            gc.set_threshold(*thresholds)
            if freeze:
                gc.unfreeze()
        self.result.finalize(self.replicas, self.now, self.event_log.events,
                             self.event_log.hexdigest(), self.s.duration_s)
        self.result.queue_events = self.queue_events
        return self.result

    def _loop(self, handlers: dict, on_progress: Callable[[float], None] | None) -> None:
        while self.heap:
            t, _, _, _, kind, a, b = heapq.heappop(self.heap)
            if kind == STEP and len(b) == 3 and b[2] != b[0].version:
                continue  # the end of a macro step that was cut short: a new end event replaced it
            self.now = t
            self.event_log.add(t, kind, event_id(a))
            handlers[kind](a, b)
            self.queue_events += 1
            if on_progress is not None and self.queue_events % 10_000 == 0:
                on_progress(t)

    # ---- events --------------------------------------------------------------------------------

    def _arrive(self, k: int, _: object) -> None:
        nxt = self.now + self.source.gap(k)
        if nxt < self.s.duration_s:
            self.push(nxt, ARRIVE, k)
        r = self.source.make(k, self.now)
        self._route(r)

    def _route(self, r: Request) -> None:
        d: Decision = self.router.route(RouteRequest(r.origin, r.allowed, r.models, r.prefix_keys),
                                        self.now)
        r.decision, r.reason = d, d.reason
        if d.refused:
            self._done(r, "refused")
        elif d.wait:
            if self.now + RETRY_AFTER_S - r.arrival > self.s.max_wait_s:
                r.reason = (f"refused: no live replica in {list(r.allowed)} within max_wait_s "
                            f"{self.s.max_wait_s} s")
                self._done(r, "refused")
            else:
                self.push(self.now + RETRY_AFTER_S, RETRY, r)
        else:
            self.push(self.now + r.access_s + d.path_in.one_way_s, REACH, r,
                      (d.prefill, d.prefill.epoch))

    def _reach(self, r: Request, target: tuple[Replica, int]) -> None:
        rep, epoch = target
        if not rep.alive or rep.epoch != epoch:
            return self._reroute(r)
        # sites the prompt crossed on its way (not the origin)
        r.visited.extend(r.decision.path_in.sites[1:-1])
        disagg = rep.role == "prefill"
        seq = SchedSequence(prompt_token_ids=r.prompt, max_tokens=1 if disagg else r.output_len,
                            tenant=r.plan, arrival_time=self.now, request=r)
        self._admit(r, rep, seq)

    def _admit(self, r: Request, rep: Replica, seq: SchedSequence) -> None:
        self._sync(rep)
        try:
            rep.add(seq, self.now)
        except RequestError as e:
            r.reason = f"refused by {rep.site}: {e}"
            return self._done(r, "refused")
        r.visited.append(rep.site)
        r.back_s = (
            r.decision.path_in.one_way_s
            if rep is r.decision.prefill
            else self._path(rep.site, r).one_way_s
        )
        if self.heap and self.heap[0][0] == self.now and self.heap[0][1] == 0:
            # more requests (or KV) are due at this very time, e.g. a burst: like the engine, which
            # takes in every
            # request that has arrived before it plans a step, start the step once they are all in
            if rep.index not in self.kick_due and not rep.stepping:
                self.kick_due.add(rep.index)
                self.push(self.now, KICK, rep)
        else:
            self._kick(rep)

    def _kicked(self, rep: Replica, _: object) -> None:
        self.kick_due.discard(rep.index)
        self._kick(rep)

    def _kick(self, rep: Replica) -> None:
        planned = rep.start_step(self.now, self.caps[rep.index] if self.macro_steps else 0)
        if planned is None:
            return
        work, end = planned
        if isinstance(work, MacroStep):
            self.push(end, STEP, rep, (work, rep.epoch, work.version))
        else:
            self.push(end, STEP, rep, (work, rep.epoch))

    def _sync(self, rep: Replica, tokens: bool = False) -> None:
        """Something is about to change ``rep`` (a request joins, KV arrives, the site fails): bring
        a macro step in flight up to now, and end it with the step in flight (the next one must see
        the change).
        ``tokens``: also hand out the tokens of the steps that ended (else they go at the plan's
        end)."""
        plan = rep.macro
        if plan is None:
            return
        rep.advance_macro(self.now)
        if tokens:
            self._macro_tokens(rep, plan, plan.completed)
        if plan.cut():
            self.caps[rep.index] = max(4, 2 * plan.k)
            self.push(plan.ends[plan.k - 1], STEP, rep, (plan, rep.epoch, plan.version))

    def _macro_tokens(self, rep: Replica, plan: MacroStep, upto: int) -> None:
        """Steps plan.emitted+1 .. upto of a macro step ended: log each as its step event, hand out
        its tokens, and close the requests that finished in them. Nothing reads a running request's
        token times or a finished request's record before the plan ends or its site fails, so this
        waits."""
        done = plan.emitted
        if upto <= done:
            return
        plan.emitted = upto
        # the last step's event is the queued one,
        for i in range(done, upto - 1 if upto == plan.k else upto):
            self.event_log.add(plan.ends[i], STEP, rep.index)  # logged by run()
        ends, record_gaps = plan.ends, self.record_gaps
        for seq, last in zip(plan.seqs, plan.finish_step, strict=True):
            if last <= done:
                continue  # finished in an earlier part of the plan
            r: Request = seq.request
            stop = upto if upto < last else last
            if record_gaps or r.first_token is None:
                for i in range(done, stop):
                    self._token(r, ends[i] + r.back_s + r.access_s)
            else:
                r.last_token = ends[stop - 1] + r.back_s + r.access_s
            if last <= upto:
                r.finish = r.last_token
                self._done(r, "done")

    def _step(self, rep: Replica, payload: tuple) -> None:
        if rep.epoch != payload[1]:
            return  # the replica failed during this step
        if len(payload) == 3:
            plan: MacroStep = payload[0]
            if plan.version == 0:
                self.caps[rep.index] = min(MACRO_CAP, 2 * self.caps[rep.index])
            rep.finish_macro(plan)
            self._macro_tokens(rep, plan, plan.k)
            return self._kick(rep)
        batch = payload[0]
        for e in rep.finish_step(batch, self.now):
            if not e.needs_sample:
                continue
            r: Request = e.seq.request
            d: Decision = r.decision
            self._token(r, self.now + r.back_s + r.access_s)
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
        self._sync(dec)
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
                # tokens of the steps that ended before the failure reached clients
                self._sync(rep, tokens=True)
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


def simulate(scenario: Scenario, seed: int = 0, **kwargs: object) -> SimResult:
    """Run one scenario to completion (see ``Simulator``)."""
    return Simulator(scenario, seed, **kwargs).run()

