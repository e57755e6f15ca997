"""The fleet's front door: one OpenAI-compatible endpoint that routes every request with the real router.

For each request: the API key gives the tenant, which is one of the scenario's traffic classes (its
plan, allowed jurisdictions, origins and acceptable models); the ``model`` the client names is the
request's trait that sets its tier, as in claim R1: ``auto`` (or the class's first model) means any
of the class's models, the small one preferred (edge first), a larger model named means only the
models from it on in the class's list (regional or central). ``reference.cluster.router.Router``
then picks a server exactly as it does in the simulator: residency filter first, tiers with spill,
prefix affinity (on the prompt's token ids), least estimated wait. The request goes to that server
over HTTP; if the server cannot be reached or fails before the first token, it is marked down and
the router decides again (never outside the allowed jurisdictions). When the router finds no live
server that the tenant allows, the answer is HTTP 503 with the router's reason.

Every request ends in one line of the trace, in the simulator's trace format
(``reference.cluster.report.trace_record``) plus the tenant, arrival, tier, worker, the token times
seen here and the HTTP status; and in a ``SimResult`` (the simulator's own accounting, residency
audit included), which ``GET /fleet`` reports with the router's view of every server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from reference.cluster.build import AFFINITY_BLOCKS
from reference.cluster.build import Request as Trip
from reference.cluster.network import Network
from reference.cluster.report import SimResult, trace_record
from reference.cluster.router import Decision, Router, RouteRequest
from reference.cluster.scenario import Scenario, Traffic
from reference.kv.prefix_hash import prefix_keys
from serve.door import BODY_TIMEOUT_S, bearer_client, bearer_token, door_app, gone, read_request
from serve.fleet.view import SiteReplica, poll_forever
from serve.keys import KeyTable
from serve.metrics import RequestLatencies, family, vllm_labels
from serve.protocol import ApiError, Parsed, parse_chat, parse_completion

AUTO = "auto"
DEFAULT_MAX_TOKENS = 256  # the router's estimate of a request's output when the client sets no max_tokens


@dataclass
class Tenant:
    name: str
    plan: str
    traffic: int  # index of its traffic class
    spec: Traffic
    site_key: str | None  # the key this gateway sends to the servers for this tenant


class Gateway:
    """What the handlers share: scenario, router, the servers' view, tenants, the trace."""

    def __init__(self, s: Scenario, replicas: list[SiteReplica], tokenizer: Any, *, keys: KeyTable | None,
                 site_keys: dict[str, str], trace: IO[str] | None = None, delays: bool = False,
                 poll_s: float = 0.5, body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.s, self.replicas, self.tokenizer, self.keys = s, replicas, tokenizer, keys
        self.network = Network(s)
        self.router = Router(s, replicas, self.network)  # type: ignore[arg-type]
        self.tenants = {t.name: Tenant(t.name, t.plan, k, t, site_keys.get(t.name)) for k, t in enumerate(s.traffic)}
        self.trace, self.delays, self.poll_s = trace, delays, poll_s
        self.body_timeout_s = body_timeout_s
        self.result = SimResult()
        self.latencies = RequestLatencies()  # as the gateway's clients see them, per model
        self.t0 = time.monotonic()
        self.next_id = 0
        self.models = list(s.models)
        self.http: httpx.AsyncClient | None = None

    def context_limit(self) -> int | None:
        """The longest context of any server (a prompt that fits none is refused here; one that fits
        some is checked again by the server that takes it). None until the servers were measured."""
        known = [r.max_model_len for r in self.replicas if r.max_model_len]
        return max(known) if known else None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def tenant_of(self, request: Request) -> Tenant:
        """The key's tenant (serve's own key table and header parsing); without a key table, the bearer
        token names the tenant (a loopback-only mode for trying the fleet out)."""
        if self.keys is not None:
            name = bearer_client(self.keys, request).tenant
        else:
            name = bearer_token(request)
        tenant = self.tenants.get(name)
        if tenant is None:
            raise ApiError(401, "missing or invalid API key: without --api-keys the key is the name of a traffic "
                           f"class of the scenario ({sorted(self.tenants)})" if self.keys is None else
                           f"the key's tenant {name!r} is not a traffic class of the scenario", code="invalid_api_key")
        return tenant

    def models_for(self, tenant: Tenant, name: str) -> tuple[str, ...]:
        """The request's acceptable models from the model it names (the trait that sets its tier)."""
        wanted = tenant.spec.models
        if name == AUTO:
            return wanted
        if name in wanted:
            return wanted[wanted.index(name):]
        if name in self.s.models:
            return (name,)
        raise ApiError(404, f"model {name!r} does not exist; the fleet serves {[AUTO, *self.models]}", param="model",
                       code="model_not_found")

    def record(self, r: Trip, outcome: str, status: int, tenant: Tenant, token_times: list[float],
               usage: dict[str, Any] | None = None, finish_reason: str | None = None) -> None:
        r.outcome = outcome
        jur = self.network.jurisdiction
        d0: Decision | None = r.decision  # type: ignore[assignment]
        if outcome == "done" and d0 is not None and d0.prefill is not None:
            usage = usage or {}
            self.latencies.record(
                model=d0.prefill.model, tenant=tenant.name,
                prompt=int(usage.get("prompt_tokens") or 0),
                generated=int(usage.get("completion_tokens") or 0),
                ttft=None if r.first_token is None else r.first_token - r.arrival,
                gaps=list(r.gaps), e2e=None if r.finish is None else r.finish - r.arrival,
                finish_reason=finish_reason)
        if outcome in ("done", "refused"):
            self.result.add(r, jur)
        else:  # failed / aborted / error: the simulator's accounting has no latencies for these
            self._count_other(r, jur)
        if self.trace is not None:
            rec = json.loads(trace_record(r, jur))
            d: Decision | None = r.decision  # type: ignore[assignment]
            rec.update(tenant=tenant.name, plan=tenant.plan, arrival_s=round(r.arrival, 6), status=status,
                       tier=d.prefill.tier if d is not None and d.prefill is not None else None,
                       worker=d.prefill.index if d is not None and d.prefill is not None else None,
                       disaggregated=_split(d.prefill) if d is not None and d.prefill is not None else None,
                       visited=list(r.visited),
                       token_times_ms=[round((t - r.arrival) * 1e3, 3) for t in token_times])
            if outcome != "done" and r.first_token is not None:
                rec["ttft_ms"] = round((r.first_token - r.arrival) * 1e3, 3)
            self.trace.write(json.dumps(rec, sort_keys=True) + "\n")
            self.trace.flush()

    def _count_other(self, r: Trip, jur: dict[str, str]) -> None:
        self.result.requests += 1
        self.result.outcomes[r.outcome] += 1
        self.result.retries += r.retries
        if any(jur[site] not in r.allowed for site in r.visited):
            self.result.violations.append(r.rid)

    def metrics_text(self) -> str:
        """The gateway's /metrics: its own counters, the latencies and tokens its clients saw (per
        model, per tenant, under the project's and vLLM's names), and every server's load as last
        polled (vLLM's gauges, one series per server, labelled with its site and worker)."""
        lines = self.latencies.lines(self.models)
        lines += family("unfire_fleet_requests_total", "counter", "Requests by outcome.",
                        {(("outcome", k),): v for k, v in self.result.outcomes.items()})
        lines += family("unfire_fleet_tier_total", "counter", "Requests served per tier.",
                        {(("tier", k),): v for k, v in self.result.tier.items()})
        lines += family("unfire_fleet_requests_in_flight", "gauge",
                        "Requests in flight through the gateway.",
                        {(): sum(r.live for r in self.replicas)})
        per_server = [(r, (("site", r.site), ("worker", str(r.index)))) for r in self.replicas]
        lines += family("unfire_fleet_server_up", "gauge", "Server health as the gateway sees it.",
                        {labels: int(r.alive) for r, labels in per_server})
        polled = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             "running"),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting"),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
        ]
        for name, help_text, attr in polled:
            lines += family(name, "gauge", help_text + " Per server, as last polled.",
                            {(*vllm_labels(r.model), *labels): getattr(r, attr)
                             for r, labels in per_server})
        return "\n".join(lines) + "\n"

    def view(self) -> dict[str, Any]:
        summary = self.result.summary()
        summary.pop("utilization", None)
        for key in ("events", "queue_events", "simulated_s", "event_log_hash"):
            summary.pop(key, None)
        return {"servers": [r.view() for r in self.replicas], "outcomes": dict(self.result.outcomes),
                "summary": no_nan(summary), "uptime_s": round(self.now(), 3)}


def no_nan(obj: Any) -> Any:
    """``obj`` with every NaN (a percentile of nothing) as None, so that it is valid JSON."""
    if isinstance(obj, dict):
        return {k: no_nan(v) for k, v in obj.items()}
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def create_gateway_app(g: Gateway) -> Starlette:
    async def models(request: Request) -> Response:
        g.tenant_of(request)
        cards = [{"id": m, "object": "model", "owned_by": "unfire-fleet"} for m in [AUTO, *g.models]]
        return JSONResponse({"object": "list", "data": cards})

    async def health(request: Request) -> Response:
        alive = sum(r.alive for r in g.replicas)
        return JSONResponse({"status": "ok" if alive else "error", "servers_alive": alive,
                             "servers": len(g.replicas)}, 200 if alive else 503)

    async def fleet(request: Request) -> Response:
        return JSONResponse(g.view())

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(g.metrics_text(), media_type="text/plain; version=0.0.4")

    async def completions(request: Request) -> Response:
        return await route(g, request, chat=False)

    async def chat(request: Request) -> Response:
        return await route(g, request, chat=True)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        g.http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0),
                                   limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        poller = asyncio.create_task(poll_forever(g.replicas, g.poll_s))
        try:
            yield
        finally:
            poller.cancel()
            await g.http.aclose()

    routes = [Route("/v1/models", models), Route("/health", health), Route("/fleet", fleet), Route("/metrics", metrics),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"])]
    return door_app(routes, lifespan=lifespan)


async def route(g: Gateway, request: Request, chat: bool) -> Response:
    tenant = g.tenant_of(request)
    models: tuple[str, ...] = ()

    def parse(body: Any) -> Parsed:  # the model named is checked here, the rest as a server does
        nonlocal models
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "model: required: 'auto' or a model of the scenario "
                           "(GET /v1/models)", param="model")
        models = g.models_for(tenant, name)
        return (parse_chat if chat else parse_completion)(body, name)

    incoming = await read_request(request, parse, g.tokenizer, g.context_limit(), g.body_timeout_s)
    if incoming is None:
        return gone()
    body, parsed, ids = incoming.body, incoming.parsed, incoming.ids
    spec = tenant.spec
    origin = spec.origins[g.next_id % len(spec.origins)]
    bs = g.s.block_size
    r = Trip(rid=g.next_id, traffic=tenant.traffic, origin=origin, allowed=spec.allowed, models=models,
             plan=tenant.plan, arrival=g.now(), prompt=ids, output_len=parsed.max_tokens or DEFAULT_MAX_TOKENS,
             access_s=spec.access_rtt_ms / 2000, prefix_keys=tuple(prefix_keys(ids[:AFFINITY_BLOCKS * bs], bs)))
    g.next_id += 1
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return await forward(g, r, tenant, body, parsed, path)


async def forward(g: Gateway, r: Trip, tenant: Tenant, body: dict[str, Any], parsed: Parsed,
                  path: str) -> Response:
    """Send ``r`` where the router says; on a server that fails before answering, mark it down and
    ask again. A stream is asked for with its usage (the token counts the gateway's /metrics adds
    up per tenant); the client gets the usage chunk only if it asked for it."""
    assert g.http is not None
    stream = parsed.stream
    if stream:
        options = body.get("stream_options") or {}
        body = {**body, "stream_options": {**options, "include_usage": True}}
    headers = {"Authorization": f"Bearer {tenant.site_key}"} if tenant.site_key else {}
    for _ in range(2 * len(g.replicas) + 1):
        d = g.router.route(RouteRequest(r.origin, r.allowed, r.models, r.prefix_keys), g.now())
        r.decision, r.reason = d, d.reason
        if d.refused or d.wait:
            r.decision = None
            g.record(r, "refused", 503, tenant, [])
            raise ApiError(503, f"no server may take this request: {d.reason}", code="no_allowed_site",
                           headers={"Retry-After": "1"})
        rep: SiteReplica = d.prefill  # type: ignore[assignment]
        if g.delays:
            await asyncio.sleep(r.access_s + d.path_in.one_way_s)
        out = {**body, "model": rep.model}
        rep.live += 1
        rep.pending_prefill += len(r.prompt)
        rep.pending_decode += r.output_len
        counted = Counted(rep, len(r.prompt), r.output_len)
        r.visited.extend([*d.path_in.sites[1:-1], rep.site])  # sites the prompt crossed, and the one computing it
        try:
            # serialized here: json.dumps writes NaN as our servers read it (httpx refuses NaN)
            req = g.http.build_request("POST", f"http://{rep.worker.address}{path}",
                                       content=json.dumps(out),
                                       headers={**headers, "Content-Type": "application/json"})
            resp = await g.http.send(req, stream=True)
        except httpx.HTTPError as e:
            counted.settle()
            rep.alive = False
            rep.errors = [f"{type(e).__name__}: {e}"[:200]]
            r.retries += 1
            continue
        if resp.status_code >= 500:  # overloaded or failing: try another server the router allows
            await resp.aclose()
            counted.settle()
            r.retries += 1
            continue
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            counted.settle()
            g.record(r, "error", resp.status_code, tenant, [])
            return Response(content, resp.status_code, media_type="application/json")
        relay = Relay(g, r, tenant, rep, resp, counted, parsed.include_usage)
        if not stream:
            try:
                content = await resp.aread()
            except httpx.HTTPError:
                relay.failed_before_answer()
                continue
            finally:
                await resp.aclose()
            relay.whole(content)
            return Response(content, 200, media_type="application/json")
        try:
            first = await relay.first_event()
        except httpx.HTTPError:
            await resp.aclose()
            relay.failed_before_answer()
            continue
        return StreamingResponse(relay.events(first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    g.record(r, "failed", 503, tenant, [])
    raise ApiError(503, f"every server tried failed ({r.retries} tries); last decision: {r.reason}",
                   code="fleet_unavailable", headers={"Retry-After": "1"})


class Counted:
    """A request's share of a server's load counters, given back as its tokens come (and at the end)."""

    def __init__(self, rep: SiteReplica, prompt: int, output: int) -> None:
        self.rep, self.prompt, self.output, self.open = rep, prompt, output, True

    def token(self) -> None:
        if self.prompt:
            self.rep.pending_prefill -= self.prompt
            self.prompt = 0
        if self.output:
            self.rep.pending_decode -= 1
            self.output -= 1

    def settle(self) -> None:
        if self.open:
            self.rep.pending_prefill -= self.prompt
            self.rep.pending_decode -= self.output
            self.rep.live -= 1
            self.prompt = self.output = 0
            self.open = False


class Relay:
    """One answer coming back from a server: its token times, the added network delay, the trace line."""

    def __init__(self, g: Gateway, r: Trip, tenant: Tenant, rep: SiteReplica, resp: httpx.Response,
                 counted: Counted, client_usage: bool = False) -> None:
        self.g, self.r, self.tenant, self.rep, self.resp, self.counted = g, r, tenant, rep, resp, counted
        self.client_usage = client_usage  # the client asked for the usage chunk (include_usage)
        self.lines = resp.aiter_lines()
        self.times: list[float] = []
        self.error: str | None = None  # the server's own error event (e.g. a disaggregated worker lost)
        self.usage: dict[str, Any] | None = None  # the server's token counts (usage chunk or body)
        self.finish_reason: str | None = None
        self.back_s = (r.access_s + r.decision.path_in.one_way_s) if g.delays else 0.0  # type: ignore[union-attr]

    def failed_before_answer(self) -> None:
        self.counted.settle()
        self.rep.alive = False
        self.r.retries += 1

    def whole(self, content: bytes) -> None:
        self.counted.settle()
        t = self.g.now()
        self.r.first_token = self.r.last_token = self.r.finish = t  # not streamed: TTFT is the whole answer
        try:
            answer = json.loads(content)
            self.usage = answer.get("usage")
            self.finish_reason = (answer.get("choices") or [{}])[0].get("finish_reason")
        except (ValueError, AttributeError, IndexError):
            pass  # not the server's JSON: the answer is passed on as it is, its tokens not counted
        self.g.record(self.r, "done", 200, self.tenant, [t], self.usage, self.finish_reason)

    async def first_event(self) -> list[tuple[float, str]]:
        """Read up to the first token (nothing has gone to the client yet, so a failure here is retried)."""
        seen = []
        async for line in self.lines:
            if line.startswith("data:"):
                t = self.g.now()
                out = self._saw(line, t)
                if out is not None:
                    seen.append((t, out))
                if self.error is not None and not self.times:  # failed before its first token: try again
                    raise httpx.RemoteProtocolError(f"the server failed before its first token: {self.error}")
                if self.times or line.strip() == "data: [DONE]":
                    return seen
        raise httpx.RemoteProtocolError("the server's stream ended before its first token")

    def _saw(self, line: str, now: float) -> str | None:
        """Note a server event's token (its time) or error; returns the event for the client (None:
        not for the client: the usage chunk it did not ask for)."""
        payload = line[5:].strip()
        if payload == "[DONE]" or not payload.startswith("{"):
            return line
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            return line
        if not isinstance(chunk, dict):
            return line
        if isinstance(chunk.get("error"), dict):
            self.error = str(chunk["error"].get("message", "error"))[:200]
            return line
        if "usage" in chunk:
            if isinstance(chunk["usage"], dict):
                self.usage = chunk["usage"]
            if not self.client_usage:
                if not chunk.get("choices"):
                    return None
                del chunk["usage"]
                line = "data: " + json.dumps(chunk, ensure_ascii=False)
        choices = chunk.get("choices") or [{}]
        if not isinstance(choices[0], dict):
            return line
        self.finish_reason = choices[0].get("finish_reason") or self.finish_reason
        piece = choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
        if piece:
            t = now + self.back_s
            if self.r.first_token is None:
                self.r.first_token = t
            else:
                self.r.gaps.append(t - self.r.last_token)
            self.r.last_token = t
            self.times.append(t)
            self.counted.token()
        return line

    async def _pump(self, queue: asyncio.Queue) -> None:
        """Read the server's stream as it comes (token times are taken here, not when the client gets them)."""
        try:
            async for line in self.lines:
                if line.startswith("data:"):
                    t = self.g.now()
                    out = self._saw(line, t)
                    if out is not None:
                        await queue.put((t, out))
            await queue.put((self.g.now(), None))
        except httpx.HTTPError as e:
            await queue.put((self.g.now(), e))

    async def events(self, first: list[tuple[float, str]]) -> Any:
        outcome, status, done = "aborted", 200, False
        queue: asyncio.Queue = asyncio.Queue()
        for item in first:
            await queue.put(item)
        pump = asyncio.create_task(self._pump(queue)) if first[-1][1].strip() != "data: [DONE]" else None
        try:
            while True:
                t, line = await queue.get()
                if not isinstance(line, str):
                    raise httpx.RemoteProtocolError(str(line or "the server's stream ended without [DONE]"))
                if self.back_s:  # the way back from the serving site to the user: every event shifted alike
                    await asyncio.sleep(max(0.0, t + self.back_s - self.g.now()))
                yield line + "\n\n"
                if line.strip() == "data: [DONE]":
                    done = True
                    break
        except httpx.HTTPError:
            outcome, status = "failed", 502
            self.rep.alive = False
            err = {"error": {"message": f"site {self.rep.site} failed mid-stream; the answer is cut short",
                             "type": "server_error", "param": None, "code": "site_failed"}}
            yield f"data: {json.dumps(err)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if pump is not None:
                pump.cancel()
            await self.resp.aclose()
            self.counted.settle()
            if done:
                outcome = "done" if self.error is None else "failed"  # ended by the server's error event
                self.r.finish = self.r.last_token if self.r.last_token is not None else self.g.now()
                if self.r.first_token is None:
                    self.r.first_token = self.r.finish
            self.g.record(self.r, outcome, status, self.tenant, self.times, self.usage,
                          self.finish_reason)


def _split(rep: Any) -> str | None:
    """"P:D" of a disaggregated endpoint, None for a colocated server."""
    w = rep.worker
    return f"{w.prefill_workers}:{w.decode_workers}" if w.disaggregated else None


def load_site_keys(path: Path) -> dict[str, str]:
    """tenant -> the key the gateway sends to the servers, from a serve keys file (first key per tenant)."""
    import tomllib

    KeyTable.load(path)  # checked as the servers will check it
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    for key, entry in data["keys"].items():
        out.setdefault(entry["tenant"], key)
    return out
