"""The fleet on Ray: ``python -m serve fleet SCENARIO --ray ADDRESS`` (see serve/fleet/README.md).

Every server of every site runs as a Ray actor (``serve.rayproc.ProcessHost``) whose ``label_selector``
is the site's ``jurisdiction`` and ``tier``: Ray places it only on a node carrying both labels, and when
the actor dies (its server killed, its node removed) Ray restarts it (``max_restarts``) on such a node,
or keeps it pending while none is left. The gateway keeps its routing, residency and keys; it learns
each server's address from its actor: ``RaySites`` asks every actor where it is, twice a second, and a
server whose actor is down has no address, so the router does not see it alive (requests go elsewhere
in the tenant's jurisdictions, or get the router's 503). ``ADDRESS`` ``local`` starts a cluster on this
machine: a head without CPUs and one node per site, labelled with the site's jurisdiction, tier and name.

A site with ``min_workers``/``max_workers`` scales with load: ``RaySites`` is also its autoscaler. Every
``scale_every_s`` it adds the requests each of the site's servers holds (queued + running, as the
gateway's poller reads them from the server's ``/metrics``, or the gateway's own count if larger) and
wants ``ceil(load / target_ongoing_requests)`` servers, between the minimum and the maximum: one more
actor at once when it wants more, one fewer (the newest: first out of the router's view, stopped once
its requests are done) when it has wanted fewer for ``down_delay_s``.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

from reference.cluster.scenario import Scenario, Site
from serve.fleet.sites import ADDRESS, START_TIMEOUT_S, FleetError, Worker, server_command
from serve.rayproc import Connection, RayUnavailable, actor_class

LABELS = ("jurisdiction", "tier")  # the node labels a site's servers are placed by
SITE_LABEL = "site"  # also on the nodes of a local cluster (information; not a placement constraint)


def selector(site: Site) -> dict[str, str]:
    return {"jurisdiction": site.jurisdiction, "tier": site.tier}


def scaled(site: Site) -> bool:
    return site.max_workers > 0


def first_servers(s: Scenario, workers: list[Worker]) -> list[Worker]:
    """The servers started at once: all of a fixed site's, the first ``min_workers`` of a scaled site's."""
    out, seen = [], dict.fromkeys(s.sites, 0)
    for w in workers:
        site = s.sites[w.site]
        if w.address:  # a remote site: nothing to start
            continue
        seen[w.site] += 1
        if not scaled(site) or seen[w.site] <= site.min_workers:
            out.append(w)
    return out


def local_nodes(s: Scenario, workers: list[Worker]) -> list[tuple[dict[str, str], int]]:
    """The nodes of a ``local`` cluster: one per site with servers to start, as many CPUs as servers."""
    count: dict[str, int] = {}
    for w in workers:
        if not w.address:
            count[w.site] = count.get(w.site, 0) + 1
    return [({**selector(s.sites[name]), SITE_LABEL: name}, n) for name, n in count.items()]


class RaySites:
    """The fleet's servers as Ray actors: the interface of ``serve.fleet.sites.Sites`` (start, stop,
    kill_site), plus the thread that follows the actors (``follow``) and scales the scaled sites."""

    def __init__(self, s: Scenario, workers: list[Worker], workdir: Path, keys_file: Path | None,
                 engine_args: list[str], address: str, *, scale_every_s: float = 1.0,
                 down_delay_s: float = 5.0) -> None:
        self.s, self.workers, self.workdir, self.engine_args = s, workers, workdir, engine_args
        self.files = {"keys.toml": keys_file.read_text()} if keys_file else {}
        self.scale_every_s, self.down_delay_s = scale_every_s, down_delay_s
        try:
            self.conn = Connection(address, local_nodes(s, workers))
        except RayUnavailable as e:
            raise FleetError(str(e)) from None
        self.ray = self.conn.ray
        self.actor = actor_class(self.ray)
        self.events: list[dict] = []  # what happened to the actors: started, down, restarted, scaled
        self.history: list[tuple[float, str, int]] = []  # (time, site, servers up) at every change
        self.replicas: list[Any] = []
        self._asked: dict[int, Any] = {}  # worker index -> its outstanding where() call
        self._low_since: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = time.monotonic()

    # -- starting and stopping ----------------------------------------------------------------
    def command(self, w: Worker) -> list[str]:
        model = "{tiny}" if w.serve_model == "tiny" else w.serve_model
        keys = "{dir}/keys.toml" if self.files else None
        return server_command(self.s, w, model, "{host}", keys, self.engine_args)

    def spawn(self, w: Worker) -> None:
        """Create ``w``'s actor (it starts the server on a node with the site's labels)."""
        site = self.s.sites[w.site]
        sel = selector(site)
        if not self.conn.nodes_with(sel):
            raise FleetError(f"sites[{w.site}]: no live Ray node has the labels {sel}; start one with "
                             f"`ray start --labels {','.join(f'{k}={v}' for k, v in sel.items())}`")
        workdir = str(self.workdir) if self.conn.cluster is not None else None
        w.actor = self.actor.options(label_selector=sel, num_cpus=1, max_restarts=-1, max_task_retries=0,
                                     name=None).remote(self.command(w), ADDRESS.pattern, files=self.files,
                                                       workdir=workdir)

    def start(self, only: list[Worker] | None = None) -> None:
        """Start the actors of ``only`` (default: the first servers of every site) and wait for their addresses."""
        todo = only if only is not None else first_servers(self.s, self.workers)
        for w in todo:
            self.spawn(w)
        errors = []
        for w in todo:
            try:
                self._saw(w, self.ray.get(w.actor.where.remote(), timeout=START_TIMEOUT_S), quiet=True)
            except Exception as e:  # noqa: BLE001 (Ray's errors carry the actor's own message)
                errors.append(f"sites[{w.site}] worker {w.index}: the server did not start on Ray: {_short(e)}")
        if errors:
            self.stop()
            raise FleetError("; ".join(errors))
        self._record()

    def follow(self, replicas: list[Any]) -> None:
        """Start following the actors (and scaling) for the gateway's ``replicas`` (its SiteReplica list)."""
        self.replicas = replicas
        self._thread = threading.Thread(target=self._loop, name="ray-sites", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        actors = [w.actor for w in self.workers if w.actor is not None]
        up = [w.actor for w in self.workers if w.actor is not None and w.address]  # the others: killed at once
        refs = [a.stop.remote() for a in up]
        if refs:  # a graceful stop of each server, 20 s at most in all
            self.ray.wait(refs, num_returns=len(refs), timeout=20)
        for a in actors:
            self.ray.kill(a, no_restart=True)
        for w in self.workers:
            w.actor = None
        self.conn.close()

    # -- faults ----------------------------------------------------------------------------------
    def kill_site(self, site: str) -> list[Worker]:
        """Kill the actors of ``site`` (their servers die with them); Ray restarts them."""
        if site not in self.s.sites:
            raise FleetError(f"unknown site {site!r}")
        killed = [w for w in self.workers if w.site == site and w.actor is not None]
        for w in killed:
            self.ray.kill(w.actor, no_restart=False)
        return killed

    def restart_site(self, site: str) -> None:
        """Nothing to do: Ray restarts a killed site's actors itself (``follow`` sees them back)."""

    def describe(self, w: Worker) -> str:
        return f" on Ray node {w.node[:12]}" if w.node else ""

    # -- following the actors -------------------------------------------------------------------
    def _saw(self, w: Worker, info: dict, quiet: bool = False) -> None:
        if info["pid"] == w.ray_pid and w.address:
            return
        restarted = w.ray_pid is not None and info["pid"] != w.ray_pid
        w.address, w.ray_pid, w.node = info["address"], info["pid"], info["node"]
        labels = {k: info["labels"].get(k) for k in (*LABELS, SITE_LABEL) if k in info["labels"]}
        self._event("restarted" if restarted else "started", w, address=w.address, node=w.node, labels=labels)
        if not quiet:
            print(f"  {w.site:12s} worker {w.index}: {'restarted by Ray' if restarted else 'started'} at "
                  f"http://{w.address}{self.describe(w)} {labels}", flush=True)

    def _event(self, kind: str, w: Worker, **more: Any) -> None:
        self.events.append({"t": round(time.monotonic() - self.t0, 3), "event": kind, "site": w.site,
                            "worker": w.index, **more})

    def _loop(self) -> None:
        next_scale = time.monotonic() + self.scale_every_s
        while not self._stop.is_set():
            self._poll(0.5)
            if time.monotonic() >= next_scale:
                next_scale = time.monotonic() + self.scale_every_s
                try:
                    self.scale()
                except Exception as e:  # noqa: BLE001 (a failed scaling step is retried at the next tick)
                    print(f"fleet: scaling failed: {_short(e)}", flush=True)

    def _poll(self, timeout: float) -> None:
        """Ask every actor where it is; a server whose actor is down loses its address (the router skips it)."""
        ray = self.ray
        by_index = {w.index: w for w in self.workers if w.actor is not None}
        for i, w in by_index.items():
            if i not in self._asked:
                self._asked[i] = w.actor.where.remote()
        if not self._asked:
            self._stop.wait(timeout)
            return
        refs = list(self._asked.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for i, ref in list(self._asked.items()):
            if ref not in ready:
                continue
            del self._asked[i]
            w = by_index.get(i)
            if w is None:
                continue
            try:
                self._saw(w, ray.get(ref))
            except Exception as e:  # noqa: BLE001 (RayActorError, ActorUnavailableError: down or restarting)
                if w.address:
                    w.address = ""
                    self._event("down", w, reason=_short(e))
                    print(f"  {w.site:12s} worker {w.index}: down ({_short(e)[:80]}); Ray restarts it", flush=True)
                self._stop.wait(0.2)

    # -- scaling ----------------------------------------------------------------------------------
    def scale(self) -> None:
        """One scaling decision per scaled site (see the module docstring)."""
        reps = {r.index: r for r in self.replicas}
        now = time.monotonic()
        for site in (x for x in self.s.sites.values() if scaled(x)):
            slots = [w for w in self.workers if w.site == site.name]
            up = [w for w in slots if w.actor is not None]
            load = sum(max(reps[w.index].live, reps[w.index].remote_live) for w in up if w.index in reps)
            want = min(site.max_workers, max(site.min_workers, math.ceil(load / site.target_ongoing_requests)))
            if want > len(up):
                self._low_since.pop(site.name, None)
                w = next(w for w in slots if w.actor is None)
                self._copy_speed(w, up, reps)
                self.spawn(w)
                self._event("scaled_up", w, load=load, servers=len(up) + 1)
                self._record()
            elif want < len(up):
                since = self._low_since.setdefault(site.name, now)
                if now - since >= self.down_delay_s:
                    self._low_since.pop(site.name, None)
                    self._event("scaled_down", up[-1], load=load, servers=len(up) - 1)
                    self._retire(up[-1], reps.get(up[-1].index))
                    self._record()
            else:
                self._low_since.pop(site.name, None)

    def _copy_speed(self, w: Worker, up: list[Worker], reps: dict[int, Any]) -> None:
        """A new server's prefill and decode times for the router: its site's first server's, measured at start."""
        rep, twin = reps.get(w.index), next((reps[u.index] for u in up if u.index in reps), None)
        if rep is not None and twin is not None:
            rep.tok_s, rep.decode_s = twin.tok_s, twin.decode_s

    def _retire(self, w: Worker, rep: Any) -> None:
        """Out of the router's view first, then stopped once the gateway has no request on it (10 s at most)."""
        actor, w.address = w.actor, ""
        deadline = time.monotonic() + 10
        while rep is not None and rep.live > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        w.actor, w.ray_pid, w.node = None, None, ""
        self._asked.pop(w.index, None)
        try:
            self.ray.get(actor.stop.remote(), timeout=15)
        except Exception:  # noqa: BLE001 (dead already)
            pass
        self.ray.kill(actor, no_restart=True)

    def _record(self) -> None:
        t = round(time.monotonic() - self.t0, 3)
        for name in self.s.sites:
            self.history.append((t, name, sum(w.actor is not None for w in self.workers if w.site == name)))

    def servers_up(self, site: str) -> int:
        return sum(w.actor is not None for w in self.workers if w.site == site)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return next((line for line in reversed(text) if "Error" in line or "did not start" in line), text[-1] if text
                else type(e).__name__)[:300]
