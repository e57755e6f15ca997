"""The coordinator: accepts requests, routes each to a prefill and a decode worker, relays the
handoff between them, collects the tokens, and makes sure every accepted request ends exactly once.

Topology: a star. Each worker has one link, to the coordinator; the frames of a handoff (MANIFEST,
KV, DONE from the prefill worker; ACK, ABORT from the decode worker) are forwarded unchanged,
tag and all, so the decode worker checks the prefill worker's signature itself. The fault injector,
when there is one, sits on this forwarding path (``faults.py``).

Routing (``routing.py``): prefill by prefix affinity, then fewest in-flight prefill tokens; decode
by fewest in-flight decode tokens, then most free blocks.

Faults and their outcomes (``PROTOCOL.md`` section 6): a prefill worker lost -> its decode workers
are told to compute those prompts themselves; a decode worker lost -> its requests *migrate* (as
Dynamo's request migration does): a new attempt (new stream) on a live decode worker gets the prompt
plus the tokens already streamed as its prompt, and its tokens are appended to those, so none is
counted twice; up to ``max_attempts``, else they fail with an error. A worker that sends nothing,
not even a heartbeat, for ``lease_s`` seconds (stopped, hung) is lost the same way
(``on_lease_expired`` first: the pool kills its process). A request past its deadline -> aborted
everywhere and answered with an error. A FINISH for an ended request or an old attempt is ignored
(counted), so nothing is answered twice. Per worker, ``accounting`` counts KV bytes, handoffs and
recomputes.

A peer's bad input never escapes the loop: a frame that fails its checks is refused (counted, logged
with the reason); a correctly signed frame whose payload breaks its schema drops the peer that sent
it (logged, counted in ``peers_dropped``), which is then handled as a lost worker. A link that has
not said HELLO may send only handshake-sized frames (``transport.HANDSHAKE_PAYLOAD``), and a socket
link is closed if no HELLO comes within ``hello_timeout`` seconds (a worker connects once its model
is loaded); at most ``max_pending_links`` such links are kept (the listener refuses more); closed
links are forgotten.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reference.disagg import messages
from reference.disagg.accounting import Accounting
from reference.disagg.frames import MAX_PAYLOAD, STREAM_KINDS, Frame, Kind
from reference.disagg.messages import MessageError
from reference.disagg.routing import Worker, choose_decode, choose_prefill
from reference.disagg.transport import HANDSHAKE_PAYLOAD, Endpoint, Link, LinkClosed
from reference.disagg.worker_base import logprob_from, prompt_logprobs_from
from reference.kv.prefix_hash import prefix_keys

log = logging.getLogger("reference.disagg")


class CoordinatorError(ValueError):
    """A request the coordinator refuses (the message says why); nothing was queued."""


@dataclass
class RequestState:
    id: str
    prompt: list[int]
    max_tokens: int
    arrival: float
    deadline: float
    stream: int = 0
    prefill: int | None = None
    decode: int | None = None
    attempts: int = 0
    # every token streamed so far, over all attempts
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    # the decode worker's CPU seconds at each token
    token_cpu: list[float] = field(default_factory=list)
    offset: int = 0  # tokens of ``tokens`` that the current attempt was given as part of its prompt
    result: dict | None = None  # {"id", "output_token_ids", "finish_reason", "error"} once ended
    recomputed: bool = False
    first_kv_seen: bool = False
    # carried to the workers (REQUEST, revision 1): their schedulers' weight
    tenant: str = "default"
    cache_salt: str | None = None  # and their prefix caches' salt
    weight: float = 1.0
    # ends the request here (None: the model's; () with ignore_eos)
    eos: tuple[int, ...] | None = None
    # REQUEST revision 2: temperature, top_k, top_p, seed (None: greedy)
    sampling: dict | None = None
    # REQUEST revision 3: penalties, min_p, logit_bias, grammar, logprobs (messages.REVISION_3)
    extra: dict | None = None
    # the logprob of each of ``tokens`` (None where not asked), from the DONE / TOKEN frames
    logprobs: list = field(default_factory=list)
    # the prompt's logprobs (extra["prompt_logprobs"] asked), from the DONE or the first TOKEN
    prompt_logprobs: tuple | None = None

    def attempt_prompt(self) -> list[int]:
        """The current attempt's prompt: the client's, then the tokens streamed before this
        attempt."""
        return self.prompt + self.tokens[:self.offset]


class Coordinator:
    def __init__(self, secret: bytes, *, deadline: Callable[[int, int], float] = lambda p,
                 o: 60.0 + 0.5 * o, max_attempts: int = 2, injector: Any = None,
                 clock: Callable[[], float] = time.monotonic,
                 hello_timeout: float = 10.0, max_pending_links: int = 16,
                 lease_s: float | None = 15.0) -> None:
        self.secret = secret
        self.lease_s = lease_s  # None: no lease (a silent worker is lost only when its link closes)
        self.last_seen: dict[Endpoint, float] = {}  # when each link last sent a frame
        self.accounting = Accounting()
        self.hello_timeout, self.max_pending_links = hello_timeout, max_pending_links
        # when each link that has not said HELLO yet was attached
        self.opened: dict[Endpoint, float] = {}
        # the model's, from the workers' HELLO
        self.vocab_size, self.eos, self.max_context = 0, (), 0
        self.deadline_for, self.max_attempts, self.injector, self.clock = (
            deadline,
            max_attempts,
            injector,
            clock,
        )
        self.inbox: queue.Queue = queue.Queue()
        self.links: dict[Endpoint, Link] = {}
        self.workers: dict[int, Worker] = {}
        self.requests: dict[str, RequestState] = {}
        self.by_stream: dict[int, RequestState] = {}
        self.waiting: list[RequestState] = []  # accepted, not yet routed (no live worker)
        self.counters: dict[str, int] = {}
        self._streams = itertools.count(1)
        self.on_worker_lost: Callable[[Worker], None] | None = None  # the pool restarts it
        self.on_lease_expired: Callable[[Worker], None] | None = None  # the pool kills its process
        self.shutting_down = False
        # fault hooks (kill, abort)
        self.on_stream_frame: Callable[[RequestState, Frame], None] | None = None

    # -- workers --------------------------------------------------------------------------
    def attach(self, endpoint: Endpoint) -> Link:
        """A new worker link (its HELLO names it). Its frames arrive in ``self.inbox``."""
        link = Link(endpoint, self.secret, node=0, counters=self.counters)
        # a socket anyone may open: a handshake's worth, for a while
        if hasattr(endpoint, "max_payload"):
            endpoint.max_payload = HANDSHAKE_PAYLOAD
            self.opened[endpoint] = self.clock()
        self.links[endpoint] = link
        return link

    def pending_links(self) -> int:
        """Links attached that have not said HELLO yet (a listener refuses new ones past
        ``max_pending_links``)."""
        return len(self.opened)

    def drop(self, link: Link, counter: str, reason: str) -> None:
        """Close a peer's link for ``reason`` (logged, counted); a worker behind it is handled as
        lost."""
        self.counters[counter] = self.counters.get(counter, 0) + 1
        log.warning("dropping %s: %s", link.peer_name(), reason)
        w = link.peer
        if isinstance(w, Worker) and w.alive:
            self._lost(w)
        else:
            link.endpoint.close(flush_s=0.0)
        self._forget(link.endpoint)

    def _forget(self, endpoint: Endpoint) -> None:
        self.links.pop(endpoint, None)
        self.opened.pop(endpoint, None)
        self.last_seen.pop(endpoint, None)

    def live(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.alive and w.role == role]

    # -- requests -------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: list[int], max_tokens: int, *,
               tenant: str = "default",
               cache_salt: str | None = None, weight: float = 1.0, sampling: dict | None = None,
               eos_token_ids: Sequence[int] | None = None, extra: dict | None = None) -> None:
        """Accept a request. Raises CoordinatorError, changing nothing, on bad input.
        ``tenant``, ``cache_salt`` and ``weight`` go to the workers: sequences with other salts
        never share prefix-cached blocks there, and the workers' fair queuing gives the tenant
        ``weight``.
        ``sampling``:
        {temperature > 0, top_k, top_p, seed} (None: greedy), the same on every attempt, so a
        migrated request draws the numbers it would have drawn (``reference/engine/sampling.py``).
        ``eos_token_ids``:
        the tokens that end it (None: the model's; [] with ignore_eos; stop ids may be added).
        ``extra``: the REQUEST fields of revision 3 (penalties, min_p, logit_bias, grammar,
        logprobs), the same on every attempt; each attempt is told how many of its prompt's tokens
        it generated."""
        if not isinstance(request_id, str) or not request_id or len(request_id) > 256:
            raise CoordinatorError(
                "request id must be a non-empty string of at most 256 characters"
            )
        if not self.workers:
            raise CoordinatorError("no worker has said HELLO yet: the model's vocabulary and "
                                   "context are unknown")
        if request_id in self.requests:
            raise CoordinatorError(f"request id {request_id!r} is already in use")
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                for t in prompt
            )
        ):
            raise CoordinatorError("prompt_token_ids must be a non-empty list of integers in [0, "
                                   f"{self.vocab_size})")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise CoordinatorError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if len(prompt) >= self.max_context:
            raise CoordinatorError(f"prompt of {len(prompt)} tokens does not fit the context of "
                                   f"{self.max_context}")
        tenant_fields = {"tenant": tenant, "cache_salt": cache_salt, "weight": weight}
        eos = tuple(self.eos) if eos_token_ids is None else tuple(eos_token_ids)
        unknown = sorted(set(extra or {}) - set(messages.REVISION_3))
        if unknown:
            raise CoordinatorError(f"extra: {unknown} are not among the fields "
                                   f"{list(messages.REVISION_3)}")
        try:
            messages.check(Kind.REQUEST, {"id": "", "prompt": [], "max_tokens": 1,
                                          "eos_token_ids": list(eos),
                                          **tenant_fields, **(sampling or {}), **(extra or {})})
        except MessageError as e:
            raise CoordinatorError(
                f"tenant, cache salt, weight, end tokens, sampling or revision 3 fields: {e}"
            ) from None
        older = [w.node for w in self.workers.values() if w.alive and w.revision < 3]
        if extra and older:
            raise CoordinatorError(f"workers {older} speak a revision of the protocol before 3: "
                                   f"they know no {sorted(extra)} (run the workers of the server's "
                                   "release)")
        old = [w.node for w in self.workers.values() if w.alive and w.revision < 2]
        if sampling and old:
            raise CoordinatorError(f"workers {old} speak a revision of the protocol before 2: they "
                                   "decode greedily "
                                   "only (run the workers of the server's release to sample)")
        now = self.clock()
        req = RequestState(request_id, prompt, max_tokens, now,
                           now + self.deadline_for(len(prompt), max_tokens),
                           **tenant_fields, eos=eos, sampling=dict(sampling) if sampling else None,
                           extra=dict(extra) if extra else None)
        self.requests[request_id] = req
        self._route(req)

    def cancel(self, request_id: str, reason: str = "aborted by the client") -> bool:
        req = self.requests.get(request_id)
        if req is None or req.result is not None:
            return False
        self._abort_stream(req, "cancel", reason)
        self._end(req, req.tokens, "abort", reason)
        return True

    def unfinished(self) -> int:
        return sum(r.result is None for r in self.requests.values())

    def _route(self, req: RequestState) -> None:
        decoders = self.live("decode")
        if not decoders:
            if req not in self.waiting:
                self.waiting.append(req)
            return
        done = req.tokens
        if req.attempts:  # a retry (migration): it goes on from the tokens already streamed
            if len(done) >= req.max_tokens or (done and done[-1] in self._eos(req)):
                return self._end(req, done, "length" if len(done) >= req.max_tokens else "stop",
                                 None)
            self.counters["requests_migrated"] = self.counters.get("requests_migrated", 0) + 1
        d = choose_decode(decoders)
        req.stream, req.attempts, req.decode, req.offset = (
            next(self._streams),
            req.attempts + 1,
            d.node,
            len(done),
        )
        self.by_stream[req.stream] = req
        d.inflight_tokens += len(req.prompt) + req.max_tokens
        if not self._send(d, Kind.REQUEST, req.stream, self._request_body(req, d)):
            return
        prefillers = self.live("prefill")
        if not prefillers:  # no prefill worker: the decode worker computes the prompt itself
            req.prefill = None
            self._send(d, Kind.ABORT, req.stream, messages.dump(Kind.ABORT, {
                "reason": "no prefill worker alive", "action": "recompute"}))
            return
        prompt = req.attempt_prompt()
        p = choose_prefill(prefillers, prefix_keys(prompt, prefillers[0].block_size,
                                                   req.cache_salt))
        req.prefill = p.node
        p.inflight_tokens += len(prompt)
        self._send(p, Kind.REQUEST, req.stream, self._request_body(req, p))

    def _request_body(self, req: RequestState, w: Worker) -> bytes:
        """The REQUEST payload for ``w``: the attempt's prompt and token budget (after a migration,
        the prompt goes on with the tokens already streamed), with the tenant's fields for a worker
        of revision >= 1 (a revision-0 worker refuses fields it does not know, so it gets the old
        REQUEST; it then shares its prefix cache across tenants: logged when it says HELLO)."""
        body = {"id": req.id, "prompt": req.attempt_prompt(),
                "max_tokens": req.max_tokens - req.offset, "eos_token_ids": list(self._eos(req))}
        if w.revision >= 1:
            body.update(tenant=req.tenant, cache_salt=req.cache_salt, weight=req.weight)
        if req.sampling:  # revision 2 (submit refused sampling while an older worker was live)
            body.update(req.sampling)
        if req.extra:  # revision 3 (likewise); a later attempt's prompt logprobs are known already
            body.update({k: v for k, v in req.extra.items()
                         if k != "prompt_logprobs" or not req.offset})
        if w.revision >= 3 and req.offset:
            body["generated"] = req.offset
        return messages.dump(Kind.REQUEST, body)

    def _eos(self, req: RequestState) -> tuple[int, ...]:
        return tuple(self.eos) if req.eos is None else req.eos

    def _end(self, req: RequestState, output: list[int], reason: str, error: str | None) -> None:
        if req.result is not None:
            self.counters["late_finish"] = self.counters.get("late_finish", 0) + 1
            return
        req.result = {"id": req.id, "output_token_ids": list(output), "finish_reason": reason,
                      "error": error}
        # let the prefill worker close its side now (its ACK may have been lost)
        if req.prefill in self.workers:
            self._send(self.workers[req.prefill], Kind.ABORT, req.stream,
                       messages.dump(Kind.ABORT, {
                "reason": "request ended", "action": "cancel"}))
        self._release(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def _release(self, req: RequestState) -> None:
        """Forget the current attempt's load on its workers."""
        prompt_len = len(req.prompt) + req.offset
        for node, tokens in ((req.prefill, prompt_len), (req.decode,
                                                         len(req.prompt) + req.max_tokens)):
            w = self.workers.get(node) if node is not None else None
            if w is not None:
                w.inflight_tokens = max(0, w.inflight_tokens - tokens)
        self.by_stream.pop(req.stream, None)

    def _abort_stream(self, req: RequestState, action: str, reason: str) -> None:
        body = messages.dump(Kind.ABORT, {"reason": reason, "action": action})
        for node in (req.prefill, req.decode):
            if node is not None and node in self.workers:
                self._send(self.workers[node], Kind.ABORT, req.stream, body)

    def _send(self, w: Worker, kind: Kind, stream: int, payload: bytes) -> bool:
        if not w.alive:
            return False
        try:
            w.link.send(kind, stream, payload)
            return True
        except LinkClosed:
            self._lost(w)
            return False

    # -- the loop -------------------------------------------------------------------------
    def poll(self, timeout: float = 0.05) -> None:
        """Handle what arrived (waiting up to ``timeout`` for the first item), then timers."""
        try:
            item = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
            while True:
                self._handle(*item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass
        now = self.clock()
        for endpoint, since in list(self.opened.items()):
            if now - since > self.hello_timeout and endpoint in self.links:
                self.drop(self.links[endpoint], "links_idle",
                          f"no HELLO within {self.hello_timeout:.0f} s")
        if self.injector is not None:
            self.injector.pump(now)
        for w in list(self.workers.values()):
            seen = self.last_seen.get(w.link.endpoint)
            if (
                self.lease_s
                and w.alive
                and w.bye is None
                and seen is not None
                and now - seen > self.lease_s
            ):
                self.counters["worker_leases_expired"] = (
                    self.counters.get("worker_leases_expired", 0) + 1
                )
                log.warning("node %d (%s) sent nothing for %.0f s: treated as lost", w.node, w.role,
                            self.lease_s)
                if self.on_lease_expired is not None:
                    self.on_lease_expired(w)
                self._lost(w)
        for req in list(self.requests.values()):
            if req.result is None and now > req.deadline:
                self.counters["deadline_exceeded"] = self.counters.get("deadline_exceeded", 0) + 1
                self._abort_stream(req, "cancel", "deadline exceeded")
                self._end(req, req.tokens, "error", f"deadline of {req.deadline - req.arrival:.1f} "
                                                    "s exceeded")
        for req in list(self.waiting):
            if self.live("decode"):
                self.waiting.remove(req)
                self._route(req)

    def _handle(self, endpoint: Endpoint, data: bytes | None) -> None:
        link = self.links.get(endpoint)
        if link is None:
            return
        if data is not None:
            self.last_seen[endpoint] = self.clock()
        if data is None:
            w = link.peer
            if isinstance(w, Worker):
                self._lost(w)
            self._forget(endpoint)
            return
        frame = link.accept(data)
        if frame is None:
            return
        try:
            self._handle_frame(link, frame)
        except MessageError as e:  # signed with the secret, yet malformed: a broken or hostile peer
            self.drop(link, "peers_dropped", f"its {frame.kind.name} frame breaks the schema: {e}")

    def _handle_frame(self, link: Link, frame: Frame) -> None:
        if frame.kind is Kind.HELLO:
            return self._hello(link, frame)
        w = link.peer
        if not isinstance(w, Worker) or frame.src != w.node:
            link.refuse("frames_from_unknown_node", f"a {frame.kind.name} frame from node "
                                                    f"{frame.src}, "
                        f"which is not this link's worker")
            return
        if frame.kind is Kind.HEARTBEAT:
            body = messages.load(Kind.HEARTBEAT, frame.payload)
            w.free_blocks = body["free_blocks"]
        elif frame.kind is Kind.BYE:
            w.bye = messages.load(Kind.BYE, frame.payload)
        else:
            self._stream_frame(w, frame)

    def _hello(self, link: Link, frame: Frame) -> None:
        if link.peer is not None:
            link.refuse("hello_refused", "a second HELLO on a link that already said one")
            return
        body = messages.load(Kind.HELLO, frame.payload)
        if body["node"] != frame.src or frame.src in self.workers:
            link.refuse("hello_refused", f"HELLO from node {frame.src} (body says {body['node']}): "
                        "a node id that is taken or does not match")
            return
        if self.workers and (body["vocab_size"], tuple(body["eos_token_ids"])) != (
            self.vocab_size,
            self.eos,
        ):
            link.refuse("hello_refused", f"HELLO from node {frame.src} for another model "
                                         "(vocabulary "
                        f"{body['vocab_size']}, eos {body['eos_token_ids']})")
            return
        self.vocab_size, self.eos = body["vocab_size"], tuple(body["eos_token_ids"])
        self.max_context = min(body["max_context"], self.max_context or body["max_context"])
        w = Worker(frame.src, body["role"], link, body["layout"]["block_size"], body["num_blocks"],
                   free_blocks=body["num_blocks"], revision=body.get("revision", 0))
        if w.revision < 1:
            log.warning("worker %d speaks revision %d of the control payloads: it is not told "
                        "requests' tenants, "
                        "so tenants share its prefix cache and its scheduler weighs them alike",
                        w.node, w.revision)
        link.peer = w
        self.workers[w.node] = w
        self.accounting.joined(w.node, w.role, body["pid"])
        self.opened.pop(link.endpoint, None)
        if hasattr(link.endpoint, "max_payload"):
            link.endpoint.max_payload = MAX_PAYLOAD  # authenticated: KV frames may come now

    def _stream_frame(self, w: Worker, frame: Frame) -> None:
        req = self.by_stream.get(frame.stream)
        if req is None or req.result is not None:
            self.counters["frames_for_old_streams"] = (
                self.counters.get("frames_for_old_streams", 0) + 1
            )
            return
        self.accounting.count(w, req.decode, frame, self.clock())
        if w.role == "prefill" and frame.kind in (Kind.MANIFEST, Kind.KV, Kind.DONE, Kind.ABORT):
            if frame.kind is Kind.KV and not req.first_kv_seen:
                req.first_kv_seen = True
            if frame.kind is Kind.DONE:
                self._keep_prompt_logprobs(req, messages.load(Kind.DONE, frame.payload))
            if frame.kind is Kind.DONE and req.prefill in self.workers:
                p = self.workers[req.prefill]
                p.inflight_tokens = max(0, p.inflight_tokens - len(req.prompt) - req.offset)
            self._forward(req.decode, frame)
        elif w.role == "decode" and frame.kind in (Kind.ACK, Kind.ABORT):
            self._forward(req.prefill, frame)
        elif w.role == "decode" and frame.kind is Kind.TOKEN:
            body = messages.load(Kind.TOKEN, frame.payload)
            # the attempt counts from its own first token
            if body["index"] == 0 and not req.offset:
                self._keep_prompt_logprobs(req, body)
            if body["index"] == len(req.tokens) - req.offset:
                req.tokens.append(body["token"])
                req.logprobs.append(logprob_from(body, body["token"]))
                req.token_times.append(self.clock())
                req.token_cpu.append(body["cpu_us"] / 1e6)
        elif w.role == "decode" and frame.kind is Kind.FINISH:
            body = messages.load(Kind.FINISH, frame.payload)
            req.recomputed = bool(body["recomputed"])
            if body["finish_reason"] == "error":
                self._abort_stream(req, "cancel", "decode worker failed the request")
            self._end(req, req.tokens[:req.offset] + body["output"], body["finish_reason"],
                      body["error"])
        if self.on_stream_frame is not None and req.result is None:
            self.on_stream_frame(req, frame)

    def _keep_prompt_logprobs(self, req: RequestState, body: dict) -> None:
        """The prompt's logprobs from a DONE or first TOKEN, if asked, carried and not kept yet."""
        k = (req.extra or {}).get("prompt_logprobs")
        if k is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = prompt_logprobs_from(body, req.prompt, min(k, self.vocab_size))

    def _forward(self, node: int | None, frame: Frame) -> None:
        w = self.workers.get(node) if node is not None else None
        if w is None or not w.alive:
            return
        try:
            if self.injector is not None and frame.kind in STREAM_KINDS:
                self.injector.forward(w.link, frame, self.clock())
            else:
                w.link.forward(frame.raw)
        except LinkClosed:
            self._lost(w)

    def _lost(self, w: Worker) -> None:
        """A worker's link closed: it died or was killed. Its requests go on elsewhere (see module
        doc)."""
        if not w.alive:
            return
        w.alive = False
        w.link.endpoint.close()
        if w.bye is not None:  # it said goodbye: a normal exit
            return
        self.counters[f"{w.role}_workers_lost"] = self.counters.get(f"{w.role}_workers_lost", 0) + 1
        for req in list(self.by_stream.values()):
            if req.result is not None:
                continue
            if w.role == "prefill" and req.prefill == w.node:
                req.prefill = None
                d = self.workers.get(req.decode) if req.decode is not None else None
                if d is not None:
                    self._send(d, Kind.ABORT, req.stream, messages.dump(Kind.ABORT, {
                        "reason": "prefill worker lost", "action": "recompute"}))
            elif w.role == "decode" and req.decode == w.node:
                self._abort_stream(req, "cancel", "decode worker lost")
                self._release(req)
                if req.attempts < self.max_attempts:
                    self.counters["requests_retried"] = self.counters.get("requests_retried", 0) + 1
                    self._route(req)
                else:
                    self._end(req, req.tokens, "error", f"decode worker lost after {req.attempts} "
                                                        "attempts")
        if self.on_worker_lost is not None and not self.shutting_down:
            self.on_worker_lost(w)

    def shutdown(self, wait: float = 5.0, pump: Callable[[], None] | None = None) -> list[dict]:
        """Ask every live worker to stop; returns their BYEs (final counters, free blocks) that came
        within ``wait`` seconds. ``pump`` makes progress meanwhile (default: ``poll``)."""
        self.shutting_down = True
        asked = self.live("prefill") + self.live("decode")
        for w in asked:
            if w.bye is None:
                self._send(w, Kind.SHUTDOWN, 0, messages.dump(Kind.SHUTDOWN, {}))
        end = self.clock() + wait
        while self.clock() < end and any(w.bye is None and w.alive for w in asked):
            (pump or (lambda: self.poll(0.05)))()
        return [w.bye for w in self.workers.values() if w.bye is not None]
