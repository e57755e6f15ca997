"""The disaggregated endpoint: ``python -m serve --prefill-workers P --decode-workers D``.

The OpenAI-compatible server (``serve/app.py``, ``serve/worker.py``) fronts ``DisaggEngine`` instead of one
engine. ``DisaggEngine`` has the engine's interface (``add_request``, ``step``, ``abort``, ``output``,
``release``) over the coordinator of ``reference/disagg``: P prefill and D decode worker processes, each the
engine's control plane (scheduler, block manager, prefix cache) over a model runner, with KV going from
prefill to decode layer by layer as ``reference/disagg/PROTOCOL.md`` specifies (authenticated frames,
``--kv-wire fp32|bf16|fp8``). Tokens come from the decode worker, through the coordinator, to the client.

Workers are started here (``--prefill-workers``/``--decode-workers``, on 127.0.0.1) or already run on other
hosts (``--workers HOST:PORT,...``, each started with ``python -m reference.disagg worker --listen
HOST:PORT``); all share the secret in ``UNFIRE_DISAGG_SECRET``.

Faults (tested with real processes in ``tests/test_serve_disagg_faults.py``):
  * a prefill worker killed: its decode worker computes the prompt itself (PROTOCOL.md section 6);
  * a decode worker killed: the request *migrates* (as Dynamo's request migration does): a live decode
    worker gets the prompt plus the tokens already streamed as its prompt, and the tokens it produces are
    streamed on from where the client is, so no token is sent twice; after ``max_attempts``: an error event;
  * a worker that sends nothing (not even a heartbeat) for ``lease_s`` seconds, e.g. stopped or hung, is
    treated as lost the same way (its process, when it is ours, is killed), so what it holds is given up;
    a prefill worker's KV held for a decode worker that stops reading is freed by the prefill worker when
    its handshake lease ends (``handshake_timeout`` x retries);
  * a lost worker is restarted (ours) or reconnected to (``--workers``) and rejoins the pool.

Greedy only: the prefill worker samples the first token by argmax, so a request with temperature > 0
is refused (400) rather than silently decoded otherwise. Tenants' cache salts and scheduling policies are
not carried to the workers (the REQUEST frame has no field for them): requests of every tenant may share
the workers' prefix caches.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from reference.disagg import messages
from reference.disagg.cluster import SECRET_ENV, ProcessCluster, WorkerOptions
from reference.disagg.coordinator import Coordinator, CoordinatorError, RequestState
from reference.disagg.frames import Frame, Kind
from reference.disagg.routing import Worker
from reference.disagg.transport import Endpoint, Link, SocketEndpoint
from reference.engine.params import RequestRejected, SamplingParams
from reference.engine.request import RequestMetrics, RequestOutput, TokenEvent
from serve.worker import EngineWorker, Failed, Finished, Stats, _forget, _post


@dataclass
class NodeStats:
    """What the coordinator saw of one worker (all counted at the coordinator, per worker node)."""

    role: str
    pid: int = 0
    kv_bytes_sent: int = 0  # KV payload bytes a prefill worker sent
    kv_bytes_received: int = 0  # KV payload bytes forwarded to a decode worker
    handoffs: int = 0  # prefill: DONE frames sent; decode: requests finished on received KV
    recomputes: int = 0  # decode: requests whose prompt (or part of it) it computed itself
    exposed_transfer_s: float = 0.0  # decode: DONE forwarded -> first token back, summed
    exposed_transfers: int = 0


@dataclass
class Migration:
    """A request as the client asked it; after a decode worker is lost it goes on from ``delivered``."""

    prompt: list[int]
    max_tokens: int
    delivered: list[int] = field(default_factory=list)  # tokens already sent to the client
    offset: int = 0  # tokens of ``delivered`` that the current attempt was given as prompt


class ServeCoordinator(Coordinator):
    """The batch coordinator plus per-worker accounting, request migration and worker leases."""

    lease_s = 15.0

    def __init__(self, secret: bytes, **kwargs: Any) -> None:
        super().__init__(secret, **kwargs)
        self.stats: dict[int, NodeStats] = {}
        self.migrations: dict[str, Migration] = {}
        self.last_seen: dict[Endpoint, float] = {}
        self._done_at: dict[int, float] = {}  # stream -> when its DONE was forwarded
        self.on_lease_expired: Any = None  # the cluster kills the process

    def _handle(self, endpoint: Endpoint, data: bytes | None) -> None:
        if data is not None:
            self.last_seen[endpoint] = self.clock()
        super()._handle(endpoint, data)

    def _hello(self, link: Link, frame: Frame) -> None:
        known = frame.src in self.workers
        super()._hello(link, frame)
        if not known and frame.src in self.workers:
            body = messages.load(Kind.HELLO, frame.payload)
            self.stats[frame.src] = NodeStats(body["role"], body["pid"])

    def _stream_frame(self, w: Worker, frame: Frame) -> None:
        req = self.by_stream.get(frame.stream)
        if req is not None and req.result is None:
            mine = self.stats.get(w.node)
            peer = self.stats.get(req.decode) if req.decode is not None else None
            if w.role == "prefill" and frame.kind is Kind.KV and mine and peer:
                mine.kv_bytes_sent += len(frame.payload)
                peer.kv_bytes_received += len(frame.payload)
            elif w.role == "prefill" and frame.kind is Kind.DONE and mine:
                mine.handoffs += 1
                self._done_at.setdefault(frame.stream, self.clock())
            elif w.role == "decode" and frame.kind is Kind.TOKEN and mine and frame.stream in self._done_at:
                mine.exposed_transfer_s += self.clock() - self._done_at.pop(frame.stream)
                mine.exposed_transfers += 1
            elif w.role == "decode" and frame.kind is Kind.FINISH and mine:
                self._done_at.pop(frame.stream, None)
                body = messages.load(Kind.FINISH, frame.payload)
                if body["recomputed"]:
                    mine.recomputes += 1
                elif body["finish_reason"] != "error":
                    mine.handoffs += 1
        super()._stream_frame(w, frame)

    def _route(self, req: RequestState) -> None:
        m = self.migrations.get(req.id)
        if m is not None and req.attempts > 0 and req.result is None:  # a retry: go on from what the client has
            done = m.delivered
            if len(done) >= m.max_tokens or (done and done[-1] in self.eos):
                return self._end(req, done, "length" if len(done) >= m.max_tokens else "stop", None)
            req.prompt, req.max_tokens, m.offset = m.prompt + done, m.max_tokens - len(done), len(done)
            self.counters["requests_migrated"] = self.counters.get("requests_migrated", 0) + 1
        super()._route(req)

    def poll(self, timeout: float = 0.05) -> None:
        super().poll(timeout)
        now = self.clock()
        for w in list(self.workers.values()):
            seen = self.last_seen.get(w.link.endpoint)
            if w.alive and w.bye is None and seen is not None and now - seen > self.lease_s:
                self.counters["worker_leases_expired"] = self.counters.get("worker_leases_expired", 0) + 1
                if self.on_lease_expired is not None:
                    self.on_lease_expired(w)
                self._lost(w)
        if len(self._done_at) > 65536:  # streams whose first token never came: forget the oldest
            for stream in list(self._done_at)[:32768]:
                del self._done_at[stream]


class ServeCluster(ProcessCluster):
    """Local worker processes (restarted when lost) and remote ones (reconnected to when lost)."""

    def __init__(self, model_spec: str, num_prefill: int, num_decode: int, remote: list[tuple[str, int]], *,
                 secret: bytes | None, opts: WorkerOptions, lease_s: float = 15.0,
                 ready_timeout: float = 300.0, log: str | None = None) -> None:
        self.remote_addr: dict[Endpoint, tuple[str, int]] = {}
        self.reconnect: dict[tuple[str, int], float] = {}  # address -> when to try next
        self.restart_times: list[float] = []
        super().__init__(model_spec, num_prefill, num_decode, secret=secret, opts=opts, restart=True,
                         deadline=lambda p, o: 120.0 + 0.5 * o, ready_timeout=ready_timeout, log=log,
                         coordinator=ServeCoordinator)
        coord = self.coordinator
        assert isinstance(coord, ServeCoordinator)
        coord.lease_s, coord.on_lease_expired = lease_s, self._expired
        for addr in remote:
            self._connect(addr)
        want = num_prefill + num_decode + len(remote)
        end = time.monotonic() + ready_timeout
        while len(coord.live("prefill")) + len(coord.live("decode")) < want or not coord.live("decode"):
            if time.monotonic() > end:
                self.close()
                raise TimeoutError(f"{want} workers did not all say HELLO within {ready_timeout} s")
            self.pump()

    def _connect(self, addr: tuple[str, int]) -> bool:
        try:
            sock = socket.create_connection(addr, timeout=5.0)
        except OSError:
            self.reconnect[addr] = time.monotonic() + 1.0
            return False
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        endpoint = SocketEndpoint(sock, self.coordinator.inbox, start=False)
        self.coordinator.attach(endpoint)
        self.remote_addr[endpoint] = addr
        self.reconnect.pop(addr, None)
        endpoint.start()
        return True

    def housekeeping(self) -> None:
        """Reconnect to lost remote workers whose time has come."""
        now = time.monotonic()
        for addr, when in list(self.reconnect.items()):
            if now >= when:
                self._connect(addr)

    def _expired(self, w: Worker) -> None:
        if w.node in self.procs:
            self.kill(w.node)

    def _lost(self, w: Worker) -> None:
        addr = self.remote_addr.pop(w.link.endpoint, None)
        if addr is not None:
            self.reconnect[addr] = time.monotonic() + 1.0
            return
        now = time.monotonic()
        self.restart_times = [t for t in self.restart_times if now - t < 60.0]
        if len(self.restart_times) < 8:  # a worker that dies at once, again and again, is not restarted forever
            self.restart_times.append(now)
            self.restarts += 1
            self.procs = {n: p for n, p in self.procs.items() if p.poll() is None}  # reap the dead
            self.spawn(w.role)


@dataclass(frozen=True)
class Ended:
    """A request ended without a token to carry the news (its FINISH came later, or an error)."""

    request_id: str
    error: str | None = None


@dataclass
class _Entry:
    prompt: list[int]
    params: SamplingParams
    tenant: str
    metrics: RequestMetrics
    migration: Migration
    finish_reason: str | None = None
    error: str | None = None


class DisaggEngine:
    """The engine interface ``EngineWorker`` drives, over a coordinator and its worker processes."""

    def __init__(self, model_spec: str, tokenizer: Any, *, num_prefill: int = 1, num_decode: int = 1,
                 remote: list[tuple[str, int]] | None = None, opts: WorkerOptions | None = None,
                 secret: bytes | None = None, lease_s: float = 15.0, max_model_len: int | None = None,
                 log: str | None = None, cluster: Any = None) -> None:
        self.tokenizer = tokenizer
        opts = opts or WorkerOptions()
        # cluster: one already running (torchrun's ranks: serve/disagg_dist.py); else our processes + remote ones
        self.cluster = cluster or ServeCluster(model_spec, num_prefill, num_decode, remote or [], secret=secret,
                                               opts=opts, lease_s=lease_s, log=log)
        self.coordinator: ServeCoordinator = self.cluster.coordinator  # type: ignore[assignment]
        context = self.coordinator.max_context
        self.max_model_len = min(context, max_model_len) if max_model_len else context
        self.eos_token_ids = tuple(self.coordinator.eos)
        self.entries: dict[str, _Entry] = {}
        self.wire = opts.wire

    # -- the engine interface ---------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, *, tenant: str = "default",
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        if not params.greedy:
            raise RequestRejected("temperature: the disaggregated endpoint decodes greedily; send temperature 0")
        if params.ignore_eos:
            raise RequestRejected("ignore_eos is not supported by the disaggregated endpoint")
        rid = str(request_id)
        if len(prompt) >= self.max_model_len:
            raise RequestRejected(f"prompt of {len(prompt)} tokens does not fit the context of {self.max_model_len}")
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt))
        try:
            self.coordinator.submit(rid, list(prompt), max_tokens)
        except CoordinatorError as e:
            raise RequestRejected(str(e)) from None
        self.coordinator.migrations[rid] = Migration(list(prompt), max_tokens)
        self.entries[rid] = _Entry(list(prompt), params, tenant, RequestMetrics(time.monotonic()),
                                   self.coordinator.migrations[rid])
        return rid

    def abort(self, request_id: str) -> bool:
        e = self.entries.get(request_id)
        if e is None or e.finish_reason is not None:
            return False
        self.coordinator.cancel(request_id)
        e.finish_reason, e.metrics.finish_time = "abort", time.monotonic()
        return True

    def has_unfinished(self) -> bool:
        return any(e.finish_reason is None for e in self.entries.values())

    def step(self) -> list[TokenEvent | Ended]:
        """Handle what the workers sent (waiting up to 20 ms), and return the new tokens and endings."""
        self.cluster.pump()
        self.cluster.housekeeping()
        events: list[TokenEvent | Ended] = []
        for rid, e in self.entries.items():
            if e.finish_reason is None:
                events += self._collect(rid, e)
        return events

    def _collect(self, rid: str, e: _Entry) -> list[TokenEvent | Ended]:
        req = self.coordinator.requests.get(rid)
        if req is None:
            return []
        m, out = e.migration, []
        tokens = req.tokens
        if req.result is not None and req.result["finish_reason"] in ("stop", "length"):
            tokens = req.result["output_token_ids"]
        for i in range(len(m.delivered) - m.offset, len(tokens)):
            token, now = tokens[i], time.monotonic()
            m.delivered.append(token)
            e.metrics.token_times.append(now)
            stop = token in e.params.stop_token_ids
            last = req.result is not None and i == len(tokens) - 1 and req.result["finish_reason"] in ("stop", "length")
            if stop or last:
                e.finish_reason = "stop" if stop else req.result["finish_reason"]  # type: ignore[index]
                e.metrics.finish_time = now
                if stop:
                    self.coordinator.cancel(rid, "stop token")
            text = self.tokenizer.decode([token], skip_special=True) if self.tokenizer is not None else ""
            out.append(TokenEvent(rid, token, len(m.delivered) - 1, now, e.finish_reason is not None,
                                  e.finish_reason, text))
            if e.finish_reason is not None:
                return out
        if req.result is not None:
            reason, error = req.result["finish_reason"], req.result["error"]
            e.metrics.finish_time = time.monotonic()
            if reason in ("stop", "length"):  # its last token came earlier: the news alone
                e.finish_reason = reason
                out.append(Ended(rid))
            else:
                e.finish_reason, e.error = "error" if reason == "error" else "abort", error or f"request {reason}"
                out.append(Ended(rid, e.error))
        return out

    def output(self, request_id: str) -> RequestOutput:
        e = self.entries[request_id]
        toks = list(e.migration.delivered)
        text = self.tokenizer.decode(toks, skip_special=True) if self.tokenizer is not None else ""
        return RequestOutput(request_id, e.prompt, toks, text, e.finish_reason, e.tenant, e.metrics, 0)

    def release(self, request_id: str) -> RequestOutput:
        out = self.output(request_id)
        del self.entries[request_id]
        self.coordinator.migrations.pop(request_id, None)
        self.coordinator.requests.pop(request_id, None)
        return out

    def idle(self) -> None:
        """Between requests: notice lost workers, restart them, reconnect, read heartbeats."""
        self.coordinator.poll(0)
        self.cluster.housekeeping()

    def close(self) -> None:
        self.cluster.close()

    # -- what /metrics shows ------------------------------------------------------------------
    def metric_lines(self) -> list[str]:
        c = self.coordinator
        live = [w for w in c.workers.values() if w.alive]
        queued: dict[int, int] = {w.node: 0 for w in live}
        for req in c.by_stream.values():
            if req.result is not None:
                continue
            for node in (req.prefill if not _done(req) else None, req.decode):
                if node in queued:
                    queued[node] += 1
        rows = [
            ("unfire_disagg_worker_up", "gauge", "1 for each live worker (labels: node, role, pid).",
             lambda w, s: 1),
            ("unfire_disagg_worker_requests", "gauge", "Requests routed to the worker and not yet done there.",
             lambda w, s: queued.get(w.node, 0)),
            ("unfire_disagg_worker_inflight_tokens", "gauge", "Tokens routed to the worker and not yet done.",
             lambda w, s: w.inflight_tokens),
            ("unfire_disagg_worker_kv_blocks_free", "gauge", "Free (or evictable) KV blocks, from its heartbeat.",
             lambda w, s: w.free_blocks),
            ("unfire_disagg_worker_kv_blocks_total", "gauge", "KV blocks of the worker.", lambda w, s: w.num_blocks),
            ("unfire_disagg_worker_kv_bytes_sent_total", "counter", "KV payload bytes sent (prefill).",
             lambda w, s: s.kv_bytes_sent),
            ("unfire_disagg_worker_kv_bytes_received_total", "counter", "KV payload bytes received (decode).",
             lambda w, s: s.kv_bytes_received),
            ("unfire_disagg_worker_exposed_transfer_seconds_total", "counter",
             "Decode: DONE forwarded to the first token back, summed over handoffs.",
             lambda w, s: round(s.exposed_transfer_s, 6)),
            ("unfire_disagg_worker_handoffs_total", "counter",
             "Prefill: handoffs sent (DONE); decode: requests finished on received KV.", lambda w, s: s.handoffs),
            ("unfire_disagg_worker_recomputes_total", "counter",
             "Decode: requests whose prompt it computed (some of) itself.", lambda w, s: s.recomputes),
        ]
        lines: list[str] = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            for w in live:
                s = c.stats.get(w.node) or NodeStats(w.role)
                lines.append(f'{name}{{node="{w.node}",role="{w.role}",pid="{s.pid}"}} {value(w, s)}')
        lines += ["# HELP unfire_disagg_events_total Coordinator events (workers lost, requests migrated, ...).",
                  "# TYPE unfire_disagg_events_total counter"]
        events = {k: v for k, v in c.counters.items() if not k.startswith(("frames_sent", "bytes_sent"))}
        events["worker_restarts"] = self.cluster.restarts
        lines += [f'unfire_disagg_events_total{{event="{k}"}} {v}' for k, v in sorted(events.items())]
        return lines


def _done(req: RequestState) -> bool:
    return bool(req.tokens)  # the first token came: the prefill side is done with it


@dataclass
class DisaggStats(Stats):
    extra_lines: list[str] = field(default_factory=list)


class DisaggWorker(EngineWorker):
    """``EngineWorker`` over a ``DisaggEngine``: endings without a token, errors as error events, and a
    ticker that keeps the coordinator going (heartbeats, lost workers, restarts) while no request runs."""

    def __init__(self, engine: DisaggEngine, *, tick_s: float = 0.1, **kwargs: Any) -> None:
        super().__init__(engine, **kwargs)
        self.tick_s = tick_s
        self._ticker = threading.Thread(target=self._tick, name="disagg-ticker", daemon=True)
        self._stopping = threading.Event()

    def start(self) -> None:
        self._snapshot()  # /metrics shows the workers from the first request on (the thread is not running yet)
        super().start()
        self._ticker.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        super().stop(timeout)

    def _tick(self) -> None:
        pending = None
        while not self._stopping.wait(self.tick_s):
            if pending is None or pending.done():
                pending = self.call(lambda engine: (engine.idle(), self._snapshot()))

    def _deliver_token(self, event: Any) -> None:
        if not isinstance(event, Ended):
            return super()._deliver_token(event)
        live = self._live.pop(event.request_id, None)
        if live is None:
            return
        if event.error is None:
            _post(live, Finished(self.engine.output(event.request_id)))
        else:
            _post(live, Failed(503, f"the request failed on the disaggregated workers: {event.error}"))
        _forget(self.engine, event.request_id)

    def _snapshot(self) -> None:
        engine: DisaggEngine = self.engine
        c = engine.coordinator
        live = [w for w in c.workers.values() if w.alive]
        stats = DisaggStats()
        stats.waiting = len(c.waiting)
        stats.running = sum(e.finish_reason is None for e in engine.entries.values())
        stats.kv_blocks_total = sum(w.num_blocks for w in live)
        stats.kv_blocks_used = sum(max(0, w.num_blocks - w.free_blocks) for w in live)
        stats.extra_lines = engine.metric_lines()
        self.stats = stats


# -- the command line ------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregated prefill/decode (see serve/disagg.py)")
    g.add_argument("--prefill-workers", type=int, default=0, help="prefill worker processes started here")
    g.add_argument("--decode-workers", type=int, default=0, help="decode worker processes started here")
    g.add_argument("--workers", default="", help="HOST:PORT,... of workers started with `python -m reference.disagg "
                                                 f"worker --listen HOST:PORT` (shared secret in ${SECRET_ENV})")
    g.add_argument("--kv-wire", choices=["fp32", "bf16", "fp8"], default="fp32", help="KV dtype on the wire")
    g.add_argument("--worker-lease", type=float, default=15.0,
                   help="seconds a worker may send nothing before it is treated as lost")


def wanted(args: argparse.Namespace) -> bool:
    return bool(args.prefill_workers or args.decode_workers or args.workers)


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.prefill_workers < 0 or args.decode_workers < 0:
        p.error("--prefill-workers and --decode-workers must be >= 0")
    if args.workers:
        try:
            parse_workers(args.workers)
        except ValueError as e:
            p.error(str(e))
        if not os.environ.get(SECRET_ENV):
            p.error(f"--workers needs the workers' shared secret (64 hex digits) in ${SECRET_ENV}")
    elif wanted(args) and (args.prefill_workers < 1 or args.decode_workers < 1):
        p.error("a disaggregated endpoint needs --prefill-workers >= 1 and --decode-workers >= 1")
    if args.worker_lease <= 0:
        p.error("--worker-lease must be > 0")


def parse_workers(text: str) -> list[tuple[str, int]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--workers: {item!r} is not HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    return out


def build(args: argparse.Namespace) -> DisaggEngine:
    """The engine of ``python -m serve`` with the disaggregation options. Raises ValueError on bad input."""
    from reference.model.tokenizer import load_tokenizer

    if args.engine != "reference":
        raise ValueError("the disaggregated workers run the reference runner; use --engine reference")
    secret_hex = os.environ.get(SECRET_ENV, "")
    try:
        secret = bytes.fromhex(secret_hex) if secret_hex else None
    except ValueError:
        raise ValueError(f"${SECRET_ENV} must be hex digits") from None
    opts = WorkerOptions(num_blocks=args.num_blocks, block_size=args.block_size, wire=args.kv_wire,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    return DisaggEngine(args.model, load_tokenizer(args.model), num_prefill=args.prefill_workers,
                        num_decode=args.decode_workers, remote=parse_workers(args.workers), opts=opts,
                        secret=secret, lease_s=args.worker_lease, max_model_len=args.max_model_len)
