"""Pools: a coordinator and its workers, in one process (queues) or as OS processes (sockets).

    with ProcessPool("smollm2", num_prefill=1, num_decode=1) as pool:   # run_requests: batch.py
        results = run_requests(pool, [{"id": "a", "prompt_token_ids": [...], "max_tokens": 16}])

Both kinds have ``coordinator``, ``pump()`` (one round of work), ``kill(node)`` and ``close()``. A
lost worker (its link closed, or its lease ran out: then it is killed first) is restarted, at most 8
times a minute, and rejoins with a fresh node id; ``ProcessPool`` also serves workers already
running on other hosts (``remote``: ``python -m reference.disagg worker --listen HOST:PORT``),
reconnecting to a lost one every second until it answers. The batch command and the endpoint
(``serve/disagg.py``) both run on
``ProcessPool``. Worker processes are started with
``python -m reference.disagg worker --secret-stdin ...``, read the shared secret from a pipe on
their stdin (never the command line, nor the environment, which other users' tools read in
``/proc/PID/environ``), load their model, connect to 127.0.0.1, and exit when the link closes, so
none outlives its coordinator. ``close()`` asks each to stop, then kills and reaps what is left. The
listener refuses a connection (logged) while ``max_pending_links`` links have not said HELLO.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from reference.disagg import messages
from reference.disagg.coordinator import Coordinator
from reference.disagg.decode import DecodeWorker
from reference.disagg.faults import FaultInjector
from reference.disagg.frames import Kind
from reference.disagg.messages import MessageError
from reference.disagg.models import digest_of, load_model
from reference.disagg.nixl_carrier import CARRIERS, NixlSink, NixlSource
from reference.disagg.prefill import PrefillWorker
from reference.disagg.routing import Worker
from reference.disagg.transport import Link, SocketEndpoint, listen, pipe, socket_peer

SECRET_ENV = "UNFIRE_DISAGG_SECRET"  # workers started by hand (--listen) and torchrun ranks read it
log = logging.getLogger("reference.disagg")


def parse_workers(text: str) -> list[tuple[str, int]]:
    """``--workers HOST:PORT,...`` of both doors as (host, port) pairs; ValueError naming a bad
    item."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--workers: {item!r} is not HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    return out


def read_secret(stream: Any) -> bytes:
    """The shared secret as a worker reads it: one line of hex from ``stream`` (its stdin pipe).
    Raises ValueError naming the problem."""
    line = stream.readline(256).strip()
    try:
        secret = bytes.fromhex(line)
    except ValueError:
        raise ValueError("the shared secret on stdin is not hex") from None
    if len(secret) < 16:
        raise ValueError(f"the shared secret on stdin has {len(secret)} bytes; at least 16 are "
                         "needed")
    return secret


@dataclass(frozen=True)
class WorkerOptions:
    num_blocks: int = 512
    block_size: int = 16
    wire: str = "fp32"
    kv_dtype: str = "float32"  # the decode worker's cache
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 32
    # resend an unacknowledged MANIFEST / DONE every handshake_timeout s, give up after
    # handshake_retries
    # resends; a decode worker recomputes a stream that is silent for stream_timeout s. Generous,
    # because a
    # busy worker reads its frames only between steps (seconds on a loaded CPU); FAST_FAULTS is the
    # short profile that tests and --inject use so that faults resolve quickly.
    handshake_timeout: float = 1.0
    handshake_retries: int = 8
    stream_timeout: float = 60.0
    # the decode worker installs received KV for at most this share of its last step's time before
    # each
    # step while sequences are running (DecodeWorker.install_share); 0: install each frame as it
    # arrives
    install_share: float = 0.25
    # how KV values move: "tcp" inside the KV frames, "nixl" read by the decode worker out of the
    # prefill worker's registered arena (nixl_carrier.py; the frames carry only descriptors)
    kv_carrier: str = "tcp"
    nixl_arena_mb: int = 64  # each worker's registered NIXL arena (MiB)


FAST_FAULTS = {"handshake_timeout": 0.5, "handshake_retries": 2, "stream_timeout": 3.0}


def make_worker(role: str, model_spec: str, link: Link, opts: WorkerOptions,
                loaded: tuple[Any, str] | None = None) -> PrefillWorker | DecodeWorker:
    """A worker stepping on ``model_spec``'s NumPy runner, or on ``loaded`` = (a model that makes
    runners, its digest): the fast engine's (``fast/disagg/worker_runner.py``), which reference/
    never imports."""
    model, digest = loaded if loaded is not None else (load_model(model_spec),
                                                       digest_of(model_spec))
    common = {"model_digest": digest, "num_blocks": opts.num_blocks, "block_size": opts.block_size,
              "max_num_batched_tokens": opts.max_num_batched_tokens,
              "max_num_seqs": opts.max_num_seqs}
    if opts.kv_carrier not in CARRIERS:
        raise ValueError(f"kv_carrier must be one of {CARRIERS}, got {opts.kv_carrier!r}")
    nixl = opts.kv_carrier == "nixl"
    arena = opts.nixl_arena_mb << 20
    worker = _worker(role, model, link, opts, nixl, arena, common)
    worker.model_spec = model_spec  # a grammar's tokenizer is the checkpoint's
    return worker


def _worker(role: str, model: Any, link: Link, opts: WorkerOptions, nixl: bool, arena: int,
            common: dict[str, Any]) -> PrefillWorker | DecodeWorker:
    if role == "prefill":
        return PrefillWorker(model, link, wire=opts.wire, handshake_timeout=opts.handshake_timeout,
                             retries=opts.handshake_retries,
                             nixl=NixlSource(link.node, arena) if nixl else None, **common)
    return DecodeWorker(model, link, kv_dtype=opts.kv_dtype, stream_timeout=opts.stream_timeout,
                        install_share=opts.install_share or None,
                        nixl=NixlSink(link.node, arena) if nixl else None, **common)


def hello(worker: PrefillWorker | DecodeWorker, link: Link, model_spec: str,
          opts: WorkerOptions) -> None:
    c = worker.model.config
    layout = {"num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
              "block_size": opts.block_size, "wire": opts.wire, "scale_rule": "pow2-per-block-head"
              if opts.wire == "fp8" else "none"}
    link.send(Kind.HELLO, 0, messages.dump(Kind.HELLO, {
        "role": worker.role, "node": link.node, "model_digest": worker.digest, "layout": layout,
        "num_blocks": opts.num_blocks, "pid": os.getpid(), "vocab_size": c.vocab_size,
        "max_context": min(c.max_position, opts.num_blocks * opts.block_size),
        "eos_token_ids": list(c.eos_token_ids), "revision": messages.REVISION}))


def handle(worker: PrefillWorker | DecodeWorker, link: Link, data: bytes) -> bool:
    """One arrived frame into the worker. False when it says to stop (SHUTDOWN, answered with
    BYE)."""
    frame = link.accept(data)
    if frame is None:
        return True
    if frame.kind is Kind.SHUTDOWN:
        link.send(Kind.BYE, 0, messages.dump(Kind.BYE, worker.bye()))
        return False
    try:
        worker.on_frame(frame)
    except (MessageError, ValueError):  # a peer's bad payload: refuse it, count it, keep serving
        link.count("frames_bad_payload")
    return True


def serve(worker: PrefillWorker | DecodeWorker, link: Link, heartbeat_s: float = 0.25) -> None:
    """A worker process's loop: frames in, one step, a heartbeat now and then; ends when told or cut
    off."""
    inbox, next_beat = link.endpoint.inbox, 0.0
    while True:
        try:
            idle = getattr(worker, "poll_s", lambda: 0.02)()  # a decode worker awaiting NIXL reads
            item = inbox.get(timeout=0 if worker.has_work() else idle)
            while True:
                _, data = item
                if data is None or not handle(worker, link, data):
                    return
                item = inbox.get_nowait()
        except queue.Empty:
            pass
        worker.tick()
        if time.monotonic() >= next_beat:
            worker.heartbeat()
            next_beat = time.monotonic() + heartbeat_s


class WorkerPool:
    """What both kinds share: the coordinator, node ids, restarts, process faults."""

    # a worker that dies at once, again and again, is not restarted forever
    max_restarts_per_minute = 8

    def __init__(self, model_spec: str, *, secret: bytes | None, opts: WorkerOptions,
                 injector: FaultInjector | None,
                 restart: bool, deadline: Callable[[int, int], float] | None,
                 coordinator: type[Coordinator] = Coordinator,
                 lease_s: float | None = 15.0) -> None:
        self.model_spec, self.opts, self.restart = model_spec, opts, restart
        self.secret = secret if secret is not None else secrets.token_bytes(32)
        kwargs: dict[str, Any] = {"deadline": deadline} if deadline is not None else {}
        self.coordinator = coordinator(self.secret, injector=injector, lease_s=lease_s, **kwargs)
        self.coordinator.on_worker_lost = self._lost
        self.coordinator.on_lease_expired = lambda w: self.kill(w.node)
        self._nodes = iter(range(1, 65536))
        self.restarts = 0
        self.restart_times: list[float] = []
        self.byes: list[dict] = []

    def _lost(self, w: Worker) -> None:
        now = time.monotonic()
        self.restart_times = [t for t in self.restart_times if now - t < 60.0]
        if self.restart and len(self.restart_times) < self.max_restarts_per_minute:
            self.restart_times.append(now)
            self.restarts += 1
            self.spawn(w.role)

    def spawn(self, role: str) -> int:
        raise NotImplementedError

    def kill(self, node: int) -> None:
        raise NotImplementedError

    def wait_ready(self, num_prefill: int, num_decode: int, timeout: float,
                   others: int = 0) -> None:
        """Until that many workers of each role (and ``others`` more, of any role; one decode worker
        at least) have said HELLO. Raises TimeoutError."""
        end = time.monotonic() + timeout
        while True:
            p, d = len(self.coordinator.live("prefill")), len(self.coordinator.live("decode"))
            if (
                p >= num_prefill
                and d >= max(num_decode, 1)
                and p + d >= num_prefill + num_decode + others
            ):
                return
            if time.monotonic() > end:
                raise TimeoutError(f"{num_prefill + num_decode + others} workers did not all say "
                                   "HELLO "
                                   f"within {timeout} s")
            self.pump()

    def pump(self) -> None:
        self.coordinator.poll(0.02)

    def shutdown(self, wait: float = 5.0) -> list[dict]:
        """Stop every worker; their BYEs (counters, free blocks) are kept in ``self.byes``."""
        self.byes = self.coordinator.shutdown(wait, pump=self.pump)
        return self.byes

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class InProcessPool(WorkerPool):
    """Everything in this thread: the coordinator and every worker take turns (deterministic)."""

    def __init__(self, model_spec: str, num_prefill: int = 1, num_decode: int = 1, *,
                 secret: bytes | None = None,
                 opts: WorkerOptions = WorkerOptions(), injector: FaultInjector | None = None,
                 restart: bool = True, deadline: Callable[[int, int], float] | None = None,
                 lease_s: float | None = 15.0) -> None:
        super().__init__(model_spec, secret=secret, opts=opts, injector=injector, restart=restart,
                         deadline=deadline, lease_s=lease_s)
        self.workers: dict[int, tuple[PrefillWorker | DecodeWorker, Link]] = {}
        for role, n in (("prefill", num_prefill), ("decode", num_decode)):
            for _ in range(n):
                self.spawn(role)
        self.wait_ready(num_prefill, num_decode, 10.0)

    def spawn(self, role: str) -> int:
        node = next(self._nodes)
        a, b = pipe(inbox_a=self.coordinator.inbox)
        self.coordinator.attach(a)
        link = Link(b, self.secret, node)
        worker = make_worker(role, self.model_spec, link, self.opts)
        self.workers[node] = (worker, link)
        hello(worker, link, self.model_spec, self.opts)
        return node

    def kill(self, node: int) -> None:
        worker, link = self.workers.pop(node, (None, None))
        if link is not None:
            link.endpoint.close()

    def pump(self) -> None:
        self.coordinator.poll(0)
        for node, (worker, link) in list(self.workers.items()):
            inbox = link.endpoint.inbox
            while True:
                try:
                    _, data = inbox.get_nowait()
                except queue.Empty:
                    break
                if data is None or not handle(worker, link, data):
                    self.workers.pop(node, None)
                    break
            if node in self.workers:
                worker.tick()
                worker.heartbeat()

    def close(self) -> None:
        self.shutdown(wait=1.0)
        for node in list(self.workers):
            self.kill(node)


class ProcessPool(WorkerPool):
    """Workers as OS processes over TCP on 127.0.0.1 (and ``remote`` ones, already running
    elsewhere); the coordinator runs in this process."""

    def __init__(self, model_spec: str, num_prefill: int = 1, num_decode: int = 1, *,
                 secret: bytes | None = None,
                 opts: WorkerOptions = WorkerOptions(), injector: FaultInjector | None = None,
                 restart: bool = True,
                 deadline: Callable[[int, int], float] | None = None, ready_timeout: float = 120.0,
                 log: str | None = None, coordinator: type[Coordinator] = Coordinator,
                 remote: list[tuple[str, int]] | None = None, lease_s: float | None = 15.0,
                 worker_command: list[str] | None = None) -> None:
        super().__init__(model_spec, secret=secret, opts=opts, injector=injector, restart=restart,
                         deadline=deadline, coordinator=coordinator, lease_s=lease_s)
        self.procs: dict[int, subprocess.Popen] = {}
        # endpoint -> the address of the worker behind it
        self.remote_addr: dict[Any, tuple[str, int]] = {}
        # address of a lost remote worker -> when to try next
        self.reconnect: dict[tuple[str, int], float] = {}
        # the program each local worker runs, with the options below (the fast runner's:
        # fast.disagg.worker)
        self.worker_command = worker_command or [sys.executable, "-m", "reference.disagg", "worker"]
        # closed in close()
        self.log = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        self.server = listen()
        self.port = self.server.getsockname()[1]
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True)
        self._acceptor.start()
        try:
            for role, n in (("prefill", num_prefill), ("decode", num_decode)):
                for _ in range(n):
                    self.spawn(role)
            for addr in remote or []:
                self._connect(addr)
            self.wait_ready(num_prefill, num_decode, ready_timeout, others=len(remote or []))
        except BaseException:
            self.close()
            raise

    def _connect(self, addr: tuple[str, int]) -> bool:
        """Open a link to a remote worker (its HELLO names it); if it does not answer, try again in
        1 s."""
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
        """Reconnect to lost remote workers whose time has come (and to those whose link was closed
        before their HELLO came, e.g. for the HELLO timeout)."""
        now = time.monotonic()
        for endpoint, addr in list(self.remote_addr.items()):
            if endpoint not in self.coordinator.links:
                del self.remote_addr[endpoint]
                self.reconnect.setdefault(addr, now + 1.0)
        for addr, when in list(self.reconnect.items()):
            if now >= when:
                self._connect(addr)

    def pump(self) -> None:
        self.coordinator.poll(0.02)
        self.housekeeping()

    def _lost(self, w: Worker) -> None:
        addr = self.remote_addr.pop(w.link.endpoint, None)
        if addr is not None:  # not ours to start: connect to it again once it is back
            self.reconnect[addr] = time.monotonic() + 1.0
            return
        self.procs = {n: p for n, p in self.procs.items() if p.poll() is None}  # reap the dead
        super()._lost(w)

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            if self.coordinator.pending_links() >= self.coordinator.max_pending_links:
                self.coordinator.counters["links_refused"] = (
                    self.coordinator.counters.get("links_refused", 0) + 1
                )
                log.warning("refusing a connection from %s: %d links have not said HELLO yet",
                            socket_peer(sock), self.coordinator.pending_links())
                sock.close()
                continue
            endpoint = SocketEndpoint(sock, self.coordinator.inbox, start=False)
            self.coordinator.attach(endpoint)
            endpoint.start()

    def spawn(self, role: str) -> int:
        node = next(self._nodes)
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        o = self.opts
        cmd = [*self.worker_command, "--secret-stdin", "--role", role, "--node",
               str(node), "--port", str(self.port), "--model", self.model_spec, "--kv-wire", o.wire,
               "--options", ",".join(f"{k}={v}" for k, v in asdict(o).items() if k != "wire")]
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=self.log,
                                stderr=self.log)
        self.procs[node] = proc
        try:
            assert proc.stdin is not None
            proc.stdin.write(self.secret.hex().encode() + b"\n")
            proc.stdin.close()
        except OSError:  # it died at once; the coordinator never hears its HELLO
            pass
        return node

    def kill(self, node: int) -> None:
        proc = self.procs.get(node)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def close(self) -> None:
        self._closing = True
        try:
            self.shutdown(wait=5.0)
        finally:
            self.server.close()  # a worker still starting up finds no one to connect to and exits
            for link in list(self.coordinator.links.values()):
                link.endpoint.close(flush_s=0.5)
            for proc in self.procs.values():
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            if self.log is not subprocess.DEVNULL:
                self.log.close()

    def leaked_processes(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.poll() is None]
