"""The disaggregated endpoint: ``python -m serve --prefill-workers P --decode-workers D``.

The OpenAI-compatible server (``serve/app.py``, ``serve/engine_thread.py``) fronts ``DisaggEngine`` instead of one
engine. ``DisaggEngine`` has the engine's interface (``add_request``, ``step``, ``abort``, ``output``,
``release``) over the coordinator and pool of ``reference/disagg``, the same machinery that the batch
command (``python -m reference.disagg run``) runs on: P prefill and D decode worker processes, each the
engine's control plane (scheduler, block manager, prefix cache) over a model runner, with KV going from
prefill to decode layer by layer as ``reference/disagg/PROTOCOL.md`` specifies (authenticated frames,
``--kv-wire fp32|bf16|fp8``). Tokens come from the decode worker, through the coordinator, to the client.

Workers are started here (``--prefill-workers``/``--decode-workers``, on 127.0.0.1) or already run on other
hosts (``--workers HOST:PORT,...``, each started with ``python -m reference.disagg worker --listen
HOST:PORT``); all share the secret in ``UNFIRE_DISAGG_SECRET``.

Faults (``reference/disagg/coordinator.py`` and ``pool.py`` handle them, for the batch command too;
tested at the endpoint with real processes in ``tests/test_serve_disagg_faults.py``):
  * a prefill worker killed: its decode worker computes the prompt itself (PROTOCOL.md section 6);
  * a decode worker killed: the request *migrates* (as Dynamo's request migration does): a live decode
    worker gets the prompt plus the tokens already streamed as its prompt, and the tokens it produces are
    streamed on from where the client is, so no token is sent twice; after ``max_attempts``: an error event;
  * a worker that sends nothing (not even a heartbeat) for ``lease_s`` seconds, e.g. stopped or hung, is
    treated as lost the same way (its process, when it is ours, is killed), so what it holds is given up;
    a prefill worker's KV held for a decode worker that stops reading is freed by the prefill worker when
    its handshake lease ends (``handshake_timeout`` x retries);
  * a lost worker is restarted (ours) or reconnected to (``--workers``) and rejoins the pool.

The workers step on the fast engine's runner (``python -m fast.disagg.worker``: torch, ``--dtype``,
``--compressed``, a container as ``--model``) when the server's engine is fast (``--engine auto`` with
torch), else on the reference runner (``python -m reference.disagg worker``). Each request's tenant, cache
salt and weight travel in its REQUEST (revision 1, PROTOCOL.md section 3.1): the workers' prefix caches
are salted per tenant, and their schedulers queue tenants fairly by weight.

The penalties, ``min_p``, ``logit_bias``, a grammar (structured output), logprobs and prompt logprobs
travel in the REQUEST (revision 3): the workers adjust, mask and sample as the engine does, a grammar's
matcher and the penalties seeing the request's output so far (after a migration, the prompt's last
``generated`` tokens), and each token's logprob comes back with it (DONE for the first, TOKEN for the
rest); the prompt's logprobs come with the DONE (or the first TOKEN of a decode worker that computed
the prompt itself), the prefix caches salted per request so every prompt row is computed. ``n`` works
(its choices are requests).

Sampling: a request's temperature, top_k, top_p and seed travel in its REQUEST (revision 2), and both
workers sample as the engine does (``reference/engine/sampling.py``): the random number of the token at
position i is a function of (seed, i) only, so the prefill worker's first token, the decode worker's
rest and a migrated attempt's tokens are the tokens a colocated engine gives the same seed. A request
without a seed gets a fresh one here, kept over its migrations. ``ignore_eos`` and stop token ids
travel as the REQUEST's end tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from reference.disagg.accounting import NodeStats
from reference.disagg.coordinator import Coordinator, CoordinatorError, RequestState
from reference.disagg.nixl_carrier import CARRIERS, CarrierError, require_nixl
from reference.disagg.pool import SECRET_ENV, ProcessPool, WorkerOptions, parse_workers
from reference.engine.params import RequestRejected, SamplingParams
from reference.engine.request import RequestMetrics, RequestOutput, TokenEvent
from reference.sched import Tenants, UnknownTenantError
from serve.engine_thread import EngineThread, Failed, Finished, Stats, _forget, _post


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
    delivered: list[int] = field(default_factory=list)  # tokens already sent to the client
    finish_reason: str | None = None
    error: str | None = None


class DisaggEngine:
    """The engine interface ``EngineThread`` drives, over a coordinator and its worker processes."""

    def __init__(self, model_spec: str, tokenizer: Any, *, num_prefill: int = 1, num_decode: int = 1,
                 remote: list[tuple[str, int]] | None = None, opts: WorkerOptions | None = None,
                 secret: bytes | None = None, lease_s: float = 15.0, max_model_len: int | None = None,
                 log: str | None = None, worker_command: list[str] | None = None,
                 tenants: Tenants | None = None, pool: Any = None) -> None:
        """``worker_command``: the program each local worker runs (default the reference worker);
        ``tenants``: the tenants' weights, carried to the workers with each request; ``pool``: one already
        running (torchrun's ranks: ``serve/disagg_dist.py``), else our processes and the remote ones."""
        self.tokenizer = tokenizer
        self.tenants = tenants
        opts = opts or WorkerOptions()
        self.pool = pool or ProcessPool(
            model_spec, num_prefill, num_decode, remote=remote or [], secret=secret, opts=opts, restart=True,
            deadline=lambda p, o: 120.0 + 0.5 * o, ready_timeout=300.0, log=log, lease_s=lease_s,
            worker_command=worker_command)
        self.coordinator: Coordinator = self.pool.coordinator
        context = self.coordinator.max_context
        self.max_model_len = min(context, max_model_len) if max_model_len else context
        self.eos_token_ids = tuple(self.coordinator.eos)
        self.entries: dict[str, _Entry] = {}
        self.wire = opts.wire

    # -- the engine interface ---------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, *, tenant: str = "default",
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        rid = str(request_id)
        if len(prompt) >= self.max_model_len:
            raise RequestRejected(f"prompt of {len(prompt)} tokens does not fit the context of {self.max_model_len}")
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt))
        if params.prompt_logprobs is not None:  # every prompt row computed: no prefix cache hit
            cache_salt = f"{cache_salt or ''}\0prompt-logprobs\0{rid}"
        try:
            weight = self.tenants.weight(tenant) if self.tenants is not None else 1.0
            self.coordinator.submit(rid, list(prompt), max_tokens, tenant=tenant, cache_salt=cache_salt,
                                    weight=weight, sampling=sampling_fields(params),
                                    eos_token_ids=end_tokens(params, self.eos_token_ids),
                                    extra=protocol_fields(params))
        except (CoordinatorError, UnknownTenantError) as e:
            raise RequestRejected(str(e)) from None
        self.entries[rid] = _Entry(list(prompt), params, tenant, RequestMetrics(time.monotonic()))
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
        self.pool.pump()  # reconnects to lost remote workers too
        events: list[TokenEvent | Ended] = []
        for rid, e in self.entries.items():
            if e.finish_reason is None:
                events += self._collect(rid, e)
        return events

    def _collect(self, rid: str, e: _Entry) -> list[TokenEvent | Ended]:
        req = self.coordinator.requests.get(rid)
        if req is None:
            return []
        out: list[TokenEvent | Ended] = []
        whole = req.result is not None and req.result["finish_reason"] in ("stop", "length")
        tokens = req.result["output_token_ids"] if whole else req.tokens  # over all attempts (migrations)
        for i in range(len(e.delivered), len(tokens)):
            token, now = tokens[i], time.monotonic()
            e.delivered.append(token)
            e.metrics.token_times.append(now)
            stop = token in e.params.stop_token_ids
            last = whole and i == len(tokens) - 1
            if stop or last:
                e.finish_reason = "stop" if stop else req.result["finish_reason"]  # type: ignore[index]
                e.metrics.finish_time = now
                if stop:
                    self.coordinator.cancel(rid, "stop token")
            text = self.tokenizer.decode([token], skip_special=True) if self.tokenizer is not None else ""
            logprob = req.logprobs[i] if i < len(req.logprobs) else None
            prompt_lps = None
            if i == 0 and e.params.prompt_logprobs is not None:
                if req.prompt_logprobs is None:  # never silently without them
                    self.coordinator.cancel(rid, "prompt logprobs lost")
                    e.finish_reason, e.error = "error", "the prompt's logprobs did not arrive from the workers"
                    return out + [Ended(rid, e.error)]
                prompt_lps = req.prompt_logprobs
            out.append(TokenEvent(rid, token, len(e.delivered) - 1, now, e.finish_reason is not None,
                                  e.finish_reason, text, logprob, prompt_lps))
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
        toks = list(e.delivered)
        text = self.tokenizer.decode(toks, skip_special=True) if self.tokenizer is not None else ""
        return RequestOutput(request_id, e.prompt, toks, text, e.finish_reason, e.tenant, e.metrics, 0)

    def release(self, request_id: str) -> RequestOutput:
        out = self.output(request_id)
        del self.entries[request_id]
        self.coordinator.requests.pop(request_id, None)
        return out

    def idle(self) -> None:
        """Between requests: notice lost workers, restart them, reconnect, read heartbeats."""
        self.coordinator.poll(0)
        self.pool.housekeeping()

    def close(self) -> None:
        self.pool.close()

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
            ("unfire_disagg_worker_kv_bytes_nixl_total", "counter",
             "Of the KV bytes sent / received: read by the decode worker with NIXL (--kv-carrier nixl).",
             lambda w, s: s.kv_bytes_nixl),
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
                s = c.accounting.stats.get(w.node) or NodeStats(w.role)
                lines.append(f'{name}{{node="{w.node}",role="{w.role}",pid="{s.pid}"}} {value(w, s)}')
        lines += ["# HELP unfire_disagg_events_total Coordinator events (workers lost, requests migrated, ...).",
                  "# TYPE unfire_disagg_events_total counter"]
        events = {k: v for k, v in c.counters.items() if not k.startswith(("frames_sent", "bytes_sent"))}
        events["worker_restarts"] = self.pool.restarts
        lines += [f'unfire_disagg_events_total{{event="{k}"}} {v}' for k, v in sorted(events.items())]
        return lines


def sampling_fields(params: SamplingParams) -> dict | None:
    """A REQUEST's sampling fields (None: greedy); a request without a seed gets a fresh random one."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbelow(1 << 63)
    return {"temperature": float(params.temperature), "top_k": params.top_k, "top_p": float(params.top_p),
            "seed": seed}


def protocol_fields(params: SamplingParams) -> dict | None:
    """A REQUEST's revision-3 fields (None: none differs from the default): the penalties, min_p,
    logit_bias, grammar and logprobs."""
    default, out = SamplingParams(), {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "grammar", "logprobs",
                 "prompt_logprobs"):
        if getattr(params, name) != getattr(default, name):
            out[name] = getattr(params, name)
    if params.logit_bias:
        out["logit_bias"] = [[t, b] for t, b in params.logit_bias]
    return out or None


def end_tokens(params: SamplingParams, eos: tuple[int, ...]) -> list[int]:
    """The tokens that end a request on the workers: the model's end tokens (none with ignore_eos), then
    its stop ids, as the engine's sequence has them."""
    base = [] if params.ignore_eos else list(eos)
    return base + [t for t in params.stop_token_ids if t not in base]


def _done(req: RequestState) -> bool:
    return len(req.tokens) > req.offset  # the attempt's first token came: the prefill side is done with it


@dataclass
class DisaggStats(Stats):
    extra_lines: list[str] = field(default_factory=list)


class DisaggEngineThread(EngineThread):
    """``EngineThread`` over a ``DisaggEngine``: endings without a token, errors as error events, and a
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
    g.add_argument("--kv-carrier", choices=list(CARRIERS), default="tcp",
                   help="how KV moves prefill -> decode: tcp (inside the frames) or nixl (the decode worker reads the "
                        "prefill worker's registered memory with NIXL/UCX; needs pip install -e '.[nixl]')")
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
    if getattr(args, "kv_carrier", "tcp") == "nixl":
        if not wanted(args) or args.workers or getattr(args, "ray", None):
            p.error("--kv-carrier nixl works only with workers this server starts (--prefill-workers P "
                    "--decode-workers D); not with --workers, --ray or torchrun")
        try:
            require_nixl()
        except CarrierError as e:
            p.error(str(e))


def worker_program(args: argparse.Namespace) -> tuple[list[str], str]:
    """The command line that starts a local worker for ``args.engine`` ("fast" or "reference"), and the
    decode workers' KV cache dtype (the colocated engine's: the model's dtype on the fast runner)."""
    from serve.engines import parse_compressed

    compressed = parse_compressed(args.compressed)
    if args.engine == "reference":
        if compressed:
            raise ValueError(f"--compressed {','.join(compressed)} needs the fast engine (the reference runner "
                             "decodes a container to float32 and serves it plain)")
        return [sys.executable, "-m", "reference.disagg", "worker"], "float32"
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("fast.disagg") is None:
        raise ValueError("--engine fast needs torch and fast/ for the disaggregated workers; use --engine reference")
    command = [sys.executable, "-m", "fast.disagg.worker", "--dtype", args.dtype]
    return command + (["--compressed", ",".join(compressed)] if compressed else []), args.dtype


def build(args: argparse.Namespace, tenants: Tenants | None = None) -> DisaggEngine:
    """The engine of ``python -m serve`` with the disaggregation options. Raises ValueError on bad input."""
    from reference.model.tokenizer import load_tokenizer

    command, kv_dtype = worker_program(args)
    secret_hex = os.environ.get(SECRET_ENV, "")
    try:
        secret = bytes.fromhex(secret_hex) if secret_hex else None
    except ValueError:
        raise ValueError(f"${SECRET_ENV} must be hex digits") from None
    opts = WorkerOptions(num_blocks=args.num_blocks, block_size=args.block_size, wire=args.kv_wire, kv_dtype=kv_dtype,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                         kv_carrier=getattr(args, "kv_carrier", "tcp"))
    pool = None
    if getattr(args, "ray", None):  # the workers as Ray actors (serve/disagg_ray.py)
        from serve import disagg_ray

        pool = disagg_ray.start(args, command, opts, secret, args.worker_lease)
    return DisaggEngine(args.model, load_tokenizer(args.model), num_prefill=args.prefill_workers,
                        num_decode=args.decode_workers, remote=parse_workers(args.workers), opts=opts,
                        secret=secret, lease_s=args.worker_lease, max_model_len=args.max_model_len,
                        worker_command=command, tenants=tenants, pool=pool)
