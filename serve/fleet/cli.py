"""The fleet command and its Python face, ``Fleet``: sites started, servers measured, gateway served.

    python -m serve fleet SCENARIO.toml [--host 127.0.0.1] [--port 8000] [--api-keys KEYS.toml]
                          [--site-keys KEYS.toml] [--trace trace.jsonl] [--delays] [--colocate]
                          [--workdir DIR] [--num-blocks 256] [--poll-s 0.5] [--ray ADDRESS|local]
                          [--body-timeout 60] [--shutdown-grace 10]

The tenants of ``--api-keys`` (serve's keys file) must be the scenario's traffic class names, on the
same plans. Without it the bearer token is the traffic class name, and only a loopback address is
allowed. The gateway talks to its servers with one key per tenant (``--site-keys``, or a file it
writes for the servers it starts), so each server schedules and salts its prefix cache per tenant.
"""

from __future__ import annotations

import argparse
import logging
import re
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import httpx

from reference.cluster.scenario import Scenario, ScenarioError, load_scenario
from reference.sched import DEFAULT_PLAN_WEIGHTS
from serve.door import BODY_TIMEOUT_S
from serve.fleet.gateway import Gateway, create_gateway_app, load_site_keys
from serve.fleet.sites import FleetError, Sites, plan_workers
from serve.fleet.view import SiteReplica, site_replicas
from serve.keys import LOOPBACK, KeysError, KeyTable

WARMUP = "fleet-warmup"  # the servers' tenant of the gateway's warm-up requests
WARMUP_OUTPUT = 8  # tokens the warm-up request generates (its prompt fills one step's token budget)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serve fleet", description=__doc__.split("\n")[0])
    p.add_argument("scenario", help="a reference.cluster scenario (.toml or .json)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument("--api-keys", help="serve's keys file; tenants are the scenario's traffic classes")
    p.add_argument("--site-keys", help="keys file the servers run with (default: one written for local servers)")
    p.add_argument("--trace", help="write one JSON line per request here (the simulator's trace format, extended)")
    p.add_argument("--delays", action="store_true", help="add the scenario's network delays (access + path)")
    p.add_argument("--colocate", action="store_true",
                   help="run disaggregated sites colocated, one server per replica (default: one disaggregated "
                        "endpoint per model, P:D from the site's prefill/decode replicas)")
    p.add_argument("--workdir", help="where server logs, keys and the tiny checkpoint go (default: a temp dir)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks of each server")
    p.add_argument("--poll-s", type=float, default=0.5, help="seconds between health/load polls of each server")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                   help="seconds a client may take to send its request body before it gets 408 (default 60)")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="on SIGTERM, seconds the gateway lets requests in flight finish (default 10)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run every site's servers as Ray actors placed by node labels (jurisdiction, tier), "
                        "restarted and scaled by Ray: a running cluster's address, or `local` to start one here "
                        "(serve/fleet/README.md; needs pip install -e '.[ray]')")
    args = p.parse_args(argv)
    if args.api_keys is None and args.host not in LOOPBACK:
        p.error(f"--host {args.host} without --api-keys would serve anyone who can reach it")
    if args.num_blocks < 1 or not args.poll_s > 0 or not args.body_timeout > 0 or args.shutdown_grace < 0:
        p.error("--num-blocks must be >= 1, --poll-s and --body-timeout > 0, --shutdown-grace >= 0")
    return args


def check_keys(s: Scenario, keys: KeyTable, where: str) -> None:
    """Every tenant of the keys file is a traffic class of the scenario, on that class's plan."""
    classes = {t.name: t.plan for t in s.traffic}
    for tenant, plan in keys.tenants.plan_of.items():
        if tenant not in classes:
            raise KeysError(f"{where}: tenant {tenant!r} is not a traffic class of the scenario ({sorted(classes)})")
        if plan != classes[tenant]:
            raise KeysError(f"{where}: tenant {tenant!r} is on plan {plan!r}, its traffic class on {classes[tenant]!r}")


def write_site_keys(s: Scenario, path: Path) -> dict[str, str]:
    """A keys file for the local servers: a fresh random key per traffic class, on its plan, and one for
    the gateway's own warm-up requests (tenant ``WARMUP``, so no tenant's counters show them)."""
    keys = {t.name: f"fleet-{secrets.token_hex(12)}" for t in s.traffic}
    keys[WARMUP] = f"fleet-{secrets.token_hex(12)}"
    plan = {t.name: t.plan for t in s.traffic} | {WARMUP: s.traffic[0].plan}
    plans = sorted(set(plan.values()))
    lines = ["[plans]", *(f'"{p}" = {DEFAULT_PLAN_WEIGHTS.get(p, 1.0)}' for p in plans), "", "[keys]"]
    lines += [f'"{key}" = {{ tenant = "{name}", plan = "{plan[name]}" }}' for name, key in keys.items()]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return keys


def warm_up(reps: list[SiteReplica], keys: dict[str, str], s: Scenario) -> None:
    """One streamed request per server: it proves the server answers and measures its prefill time per
    prompt token (a prompt of one whole step budget, as the simulated replica's estimate prices it) and its
    decode step time, which the router's wait estimate uses. It is sent as the
    ``WARMUP`` tenant, or (servers with a keys file of their own) as a tenant allowed at the server. A
    disaggregated endpoint does not take ``ignore_eos``: its warm-up may stop early at an end token."""
    n = max(1, min(s.max_num_batched_tokens, 2000))
    prompt = {"prompt": [100 + i % 1000 for i in range(n)], "max_tokens": WARMUP_OUTPUT, "stream": True,
              "temperature": 0}
    with httpx.Client(timeout=60) as client:
        for rep in reps:
            body = prompt if rep.worker.disaggregated else {**prompt, "ignore_eos": True}
            allowed = [t.name for t in s.traffic if rep.jurisdiction in t.allowed and t.name in keys]
            key = keys.get(WARMUP) or (keys[allowed[0]] if allowed else None)
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            cards = client.get(f"http://{rep.worker.address}/v1/models", headers=headers)
            if cards.status_code == 200:  # the server's context, for the gateway's early refusal
                data = cards.json().get("data", [])
                lens = [c.get("max_model_len") for c in data if isinstance(c, dict)]
                rep.max_model_len = max((n for n in lens if isinstance(n, int) and n > 0),
                                        default=None)
            t0 = time.perf_counter()
            times = []
            with client.stream("POST", f"http://{rep.worker.address}/v1/completions", json={**body, "model": rep.model},
                               headers=headers) as resp:
                if resp.status_code != 200:
                    raise FleetError(f"sites[{rep.site}] worker {rep.index}: warm-up got HTTP {resp.status_code}: "
                                     f"{resp.read()[:200]!r}")
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter() - t0)
            if not times:
                raise FleetError(f"sites[{rep.site}] worker {rep.index}: the warm-up request streamed no token")
            # the engine's own clock, from the server's histograms (the stream may bunch tokens together)
            sums = dict(HISTOGRAM.findall(client.get(f"http://{rep.worker.address}/metrics").text))
            ttft = _mean(sums, "unfire_time_to_first_token_seconds")
            itl = _mean(sums, "unfire_inter_token_latency_seconds")
            rep.tok_s = (ttft if ttft is not None else times[0]) / n
            if itl is not None:
                rep.decode_s = itl
            rep.alive = True


HISTOGRAM = re.compile(r"^(unfire_\w+_seconds_(?:sum|count)) ([0-9.eE+-]+)$", re.M)


def _mean(sums: dict[str, str], name: str) -> float | None:
    n = float(sums.get(name + "_count", 0))
    return float(sums[name + "_sum"]) / n if n > 0 else None


class Fleet:
    """A running fleet: its servers (``sites``), the gateway state (``gateway``) and its HTTP server."""

    def __init__(self, scenario: Scenario | str | Path, *, workdir: str | Path | None = None,
                 keys: KeyTable | None = None, site_keys: Path | None = None, trace: IO[str] | None = None,
                 delays: bool = False, colocate: bool = False, num_blocks: int = 256, poll_s: float = 0.5,
                 engine_args: list[str] | None = None, ray: str | None = None,
                 body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        """``ray``: a Ray cluster's address (or ``local``) to run the servers on as actors (ray_sites.py)."""
        self.s = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="unfire-fleet-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        if keys is not None:
            check_keys(self.s, keys, "--api-keys")
        self.workers = plan_workers(self.s, colocate)
        local = any(not w.address for w in self.workers)
        if site_keys is not None:
            key_file, tenant_keys = site_keys, load_site_keys(site_keys)
        elif local:
            key_file = self.workdir / "site-keys.toml"
            tenant_keys = write_site_keys(self.s, key_file)
        else:
            key_file, tenant_keys = None, {}
        server_args = ["--num-blocks", str(num_blocks), *(engine_args or [])]
        if ray:
            from serve.fleet.ray_sites import RaySites

            self.sites: Any = RaySites(self.s, self.workers, self.workdir, key_file, server_args, ray)
        else:
            self.sites = Sites(self.s, self.workers, self.workdir, key_file, server_args)
        self.replicas = site_replicas(self.s, self.workers)
        self.gateway = Gateway(self.s, self.replicas, _tokenizer(self.s, self.workdir), keys=keys,
                               site_keys=tenant_keys, trace=trace, delays=delays, poll_s=poll_s,
                               body_timeout_s=body_timeout_s)
        self.tenant_keys = tenant_keys
        self.server: Any = None
        self.url = ""

    def start_sites(self) -> None:
        self.sites.start()
        try:
            warm_up([r for r in self.replicas if r.worker.address], self.tenant_keys, self.s)
        except (httpx.HTTPError, FleetError):
            self.sites.stop()
            raise
        if hasattr(self.sites, "follow"):  # on Ray: addresses from the actors, scaling
            self.sites.follow(self.replicas)
        self.gateway.t0 = time.monotonic()

    def bind(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Take the gateway's socket (port 0: a free one); returns the gateway's URL."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            raise FleetError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self._sock.listen(2048)  # connections wait in the backlog until the gateway serves
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        return self.url

    def serve(self, log_level: str = "warning", in_thread: bool = False, shutdown_grace: float = 10.0,
              banner: str = "") -> str:
        """Serve the gateway on the bound socket (``bind``; a free loopback port if not bound), in this
        thread or in a daemon thread (then it returns the URL once the gateway is up). ``banner`` is
        printed once the gateway serves (and handles SIGTERM): a client that reads it may connect."""
        import uvicorn

        class Announcing(uvicorn.Server):
            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets)
                if banner and not self.should_exit:
                    print(banner, flush=True)

        if not self.url:
            self.bind()
        config = uvicorn.Config(create_gateway_app(self.gateway), log_level=log_level,
                                timeout_graceful_shutdown=int(shutdown_grace) + 5)
        self.server = Announcing(config)
        if not in_thread:
            self.server.run(sockets=[self._sock])
            return self.url
        thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise FleetError("the gateway did not start")
            time.sleep(0.02)
        self._thread = thread
        return self.url

    def stop(self) -> None:
        if self.server is not None and hasattr(self, "_thread"):
            self.server.should_exit = True
            self._thread.join(15)
        self.sites.stop()
        if self._tmp is not None:
            self._tmp.cleanup()


def _tokenizer(s: Scenario, workdir: Path) -> Any:
    """The tokenizer the gateway counts prompt tokens with (for the router): the first served model's."""
    from reference.model.tokenizer import load_tokenizer

    first = next(iter(s.sites.values())).serve_model
    return load_tokenizer("smollm2" if first == "tiny" else first)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request it forwards
    trace = None
    try:
        keys = KeyTable.load(args.api_keys) if args.api_keys else None
        trace = open(args.trace, "w", encoding="utf-8") if args.trace else None  # noqa: SIM115
        fleet = Fleet(args.scenario, workdir=args.workdir, keys=keys,
                      site_keys=Path(args.site_keys) if args.site_keys else None, trace=trace, delays=args.delays,
                      colocate=args.colocate, num_blocks=args.num_blocks, poll_s=args.poll_s, ray=args.ray,
                      body_timeout_s=args.body_timeout)
    except (ScenarioError, KeysError, FleetError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # SIGTERM stops the servers too (uvicorn turns it into a shutdown of the gateway, then we stop the sites)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        url = fleet.bind(args.host, args.port)
        fleet.start_sites()
        for w in fleet.workers:
            if not w.address:  # a scaled site's server not started yet
                continue
            kind = f", disaggregated {w.prefill_workers}:{w.decode_workers}" if w.disaggregated else ""
            kind += f", pipeline {w.pipeline}" if w.pipeline else ""
            where = fleet.sites.describe(w) if hasattr(fleet.sites, "describe") else ""
            print(f"  {w.site:12s} worker {w.index}: {w.model} ({w.serve_model}{kind}) at http://{w.address}{where}",
                  flush=True)
        n_sites = len({w.site for w in fleet.workers})
        on = f", on Ray ({args.ray})" if args.ray else ""
        fleet.serve(args.log_level, shutdown_grace=args.shutdown_grace,
                    banner=f"fleet: {sum(bool(w.address) for w in fleet.workers)} servers at {n_sites} sites{on}; "
                    f"gateway on {url}/v1 (routing with reference.cluster.router)")
    except (FleetError, httpx.HTTPError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        fleet.stop()
        if trace is not None:
            trace.close()
    print("stopped", flush=True)
    return 0
