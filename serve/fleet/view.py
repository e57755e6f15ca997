"""The router's view of the real fleet: one ``SiteReplica`` per server, kept fresh from ``/metrics``.

``reference.cluster.router.Router`` routes over objects with a replica's fields (``index, site,
jurisdiction, tier, model, role, alive``) and ``est_wait_s``. Here each is a real server: the gateway
counts the prompt tokens it sent that have no first token yet and the output tokens still to come
(token-aware load, as the simulated replica counts them), the poller reads the server's queue and
running sequences from ``/metrics`` (load that did not come through this gateway) and its health,
and the estimate is the simulated replica's formula with this server's measured per-token prefill
time and decode step time (from a warm-up request at start).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import httpx

from reference.cluster.scenario import Scenario
from serve.fleet.sites import Worker

GAUGE = re.compile(r"^(unfire_queue_depth|unfire_running_sequences) ([0-9.eE+-]+)$", re.M)
# vLLM's gauges (ours export them too, so a vLLM server can stand in a site's address list)
VLLM_GAUGE = re.compile(r"^(vllm:num_requests_running|vllm:num_requests_waiting"
                        r"|vllm:kv_cache_usage_perc)\{[^}\n]*\} ([0-9.eE+-]+)$", re.M)


@dataclass(eq=False)
class SiteReplica:
    """One server, as the router sees it."""

    worker: Worker
    jurisdiction: str
    tier: str
    max_num_seqs: int  # sequences it runs at once (a disaggregated endpoint: per decode worker, times D)
    role: str = "colocated"
    prefill_lanes: int = 1  # prompts computed side by side (a disaggregated endpoint: its P prefill workers)
    alive: bool = False  # set by the first health check
    tok_s: float = 1e-3  # seconds of prefill per prompt token (measured at start)
    decode_s: float = 5e-3  # seconds per decode step (measured at start)
    pending_prefill: int = 0  # prompt tokens sent through this gateway, first token not yet seen
    pending_decode: int = 0  # output tokens still to come, of requests sent through this gateway
    live: int = 0  # requests in flight through this gateway
    remote_live: int = 0  # queued + running sequences the server reports (all its clients)
    running: float = 0.0  # the server's vLLM gauges, as last polled
    waiting: float = 0.0
    kv_usage: float = 0.0
    max_model_len: int | None = None  # the server's context (its /v1/models card, read at start)
    errors: list[str] = field(default_factory=list)

    @property
    def index(self) -> int:
        return self.worker.index

    @property
    def site(self) -> str:
        return self.worker.site

    @property
    def model(self) -> str:
        return self.worker.model

    def est_wait_s(self, now: float = 0.0) -> float:
        """``reference.cluster.replica.Replica.est_wait_s`` over this server's counters (the prompt tokens
        shared by a disaggregated endpoint's prefill workers, as the simulator's P prefill replicas)."""
        cap = self.max_num_seqs
        n = max(self.live, self.remote_live)
        wait = self.pending_prefill * self.tok_s / self.prefill_lanes
        if n + 1 > cap:
            wait += (n + 1 - cap) / cap * (self.pending_decode / max(n, 1)) * self.decode_s
        return wait

    def view(self) -> dict:
        w = self.worker
        return {"index": self.index, "site": self.site, "model": self.model, "tier": self.tier,
                "disaggregated": f"{w.prefill_workers}:{w.decode_workers}" if w.disaggregated else None,
                "pipeline": w.pipeline or None,
                "jurisdiction": self.jurisdiction, "address": self.worker.address,
                "pid": self.worker.pid, "node": self.worker.node or None, "alive": self.alive,
                "live": self.live, "remote_live": self.remote_live, "pending_prefill": self.pending_prefill,
                "pending_decode": self.pending_decode, "est_wait_ms": round(self.est_wait_s() * 1000, 3),
                "tok_ms": round(self.tok_s * 1000, 4), "decode_step_ms": round(self.decode_s * 1000, 4)}


def site_replicas(s: Scenario, workers: list[Worker]) -> list[SiteReplica]:
    return [SiteReplica(w, s.sites[w.site].jurisdiction, s.sites[w.site].tier,
                        s.max_num_seqs * max(1, w.decode_workers), prefill_lanes=max(1, w.prefill_workers))
            for w in workers]


async def check(client: httpx.AsyncClient, rep: SiteReplica, timeout: float = 2.0) -> None:
    """One health + load poll: ``alive`` is whether ``/health`` answers ok, ``remote_live`` from ``/metrics``."""
    if not rep.worker.address:
        rep.alive = False
        return
    base = f"http://{rep.worker.address}"
    try:
        health = await client.get(base + "/health", timeout=timeout)
        metrics = await client.get(base + "/metrics", timeout=timeout)
    except httpx.HTTPError as e:
        rep.alive = False
        rep.errors = [f"{type(e).__name__}: {e}"[:200]]
        return
    rep.alive = health.status_code == 200 and metrics.status_code == 200
    gauges = {m.group(1): float(m.group(2)) for m in GAUGE.finditer(metrics.text)}
    vllm: dict[str, float] = {}
    for m in VLLM_GAUGE.finditer(metrics.text):  # requests summed over its engines, KV use the most
        name, value = m.group(1), float(m.group(2))
        old = vllm.get(name, 0.0)
        vllm[name] = max(old, value) if name.endswith("perc") else old + value
    rep.running = vllm.get("vllm:num_requests_running", 0.0)
    rep.waiting = vllm.get("vllm:num_requests_waiting", 0.0)
    rep.kv_usage = vllm.get("vllm:kv_cache_usage_perc", 0.0)
    if gauges:
        queued, running = gauges.get("unfire_queue_depth", 0), gauges.get("unfire_running_sequences", 0)
        rep.remote_live = int(queued + running)
    else:
        rep.remote_live = int(rep.running + rep.waiting)


async def poll_forever(reps: list[SiteReplica], every_s: float) -> None:
    async with httpx.AsyncClient() as client:
        while True:
            await asyncio.gather(*(check(client, r) for r in reps))
            await asyncio.sleep(every_s)
