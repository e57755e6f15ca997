"""The disaggregated endpoint's workers on Ray: ``python -m serve --prefill-workers P --decode-workers D
--ray ADDRESS`` (see serve/fleet/README.md).

Each worker is a Ray actor (``serve.rayproc.ProcessHost``) running ``python -m reference.disagg worker
--listen NODE_IP:0`` (or the fast runner's worker), placed by its ``label_selector``: prefill workers on
nodes whose labels match ``--ray-prefill-labels`` (default ``disagg-role=prefill``), decode workers on
``--ray-decode-labels`` (default ``disagg-role=decode``; values may use Ray's ``in(a,b)``/``!a``). The
endpoint reaches them as it reaches workers on other hosts (``--workers``): over the project's own
frames (reference/disagg/PROTOCOL.md, authenticated with a secret each worker reads from its stdin),
KV included. A killed worker (its process, or its node) is restarted by Ray; ``RayPool`` asks the
actors where they are and reconnects to a restarted worker at its new address, while the coordinator
migrates the requests of a lost decode worker and lets a decode worker compute a lost prefill
worker's prompts, as it always does. ``local`` starts a cluster here with one node per role.
"""

from __future__ import annotations

import argparse
import secrets
import time
from dataclasses import asdict
from typing import Any

from reference.disagg.pool import ProcessPool
from serve.rayproc import Connection, RayUnavailable, actor_class

LISTENING = r"listening on (\S+:\d+)"
ROLE_LABEL = "disagg-role"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregated workers on Ray (see serve/disagg_ray.py)")
    g.add_argument("--ray", metavar="ADDRESS", help="place the --prefill-workers/--decode-workers as Ray actors: "
                                                    "a running cluster's address, or `local` (pip install -e '.[ray]')")
    g.add_argument("--ray-prefill-labels", default=f"{ROLE_LABEL}=prefill", metavar="K=V,...",
                   help=f"node labels a prefill worker needs (default {ROLE_LABEL}=prefill)")
    g.add_argument("--ray-decode-labels", default=f"{ROLE_LABEL}=decode", metavar="K=V,...",
                   help=f"node labels a decode worker needs (default {ROLE_LABEL}=decode)")


def parse_labels(text: str, flag: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{flag}: {item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    if not out:
        raise ValueError(f"{flag}: no labels given")
    return out


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.ray:
        return
    if args.workers or getattr(args, "dist_workers", None) is not None:
        p.error("--ray starts the workers itself; it does not combine with --workers or --dist-workers")
    if args.prefill_workers < 1 or args.decode_workers < 1:
        p.error("--ray places a disaggregated endpoint's workers: give --prefill-workers >= 1 and "
                "--decode-workers >= 1")
    try:
        parse_labels(args.ray_prefill_labels, "--ray-prefill-labels")
        parse_labels(args.ray_decode_labels, "--ray-decode-labels")
    except ValueError as e:
        p.error(str(e))


class RayPool(ProcessPool):
    """``ProcessPool`` over workers that Ray runs: remote workers whose addresses follow their actors."""

    def __init__(self, model_spec: str, conn: Connection, actors: list[tuple[str, Any]],
                 addresses: list[tuple[str, int]], **kwargs: Any) -> None:
        self.conn, self.ray = conn, conn.ray
        self.actors = actors  # (role, actor handle)
        self.current = list(addresses)
        self.moved: dict[tuple[str, int], tuple[str, int]] = {}  # an old address -> where its actor is now
        self.events: list[dict] = []
        self._asked: dict[int, Any] = {}
        self._next_refresh = 0.0
        super().__init__(model_spec, 0, 0, remote=addresses, **kwargs)

    def housekeeping(self) -> None:
        if time.monotonic() >= self._next_refresh:
            self._next_refresh = time.monotonic() + 0.25
            self._refresh()
        super().housekeeping()

    def _refresh(self) -> None:
        """Ask the actors where they are (without waiting); a restarted one has a new address."""
        for i, (_, actor) in enumerate(self.actors):
            if i not in self._asked:
                self._asked[i] = actor.where.remote()
        refs = list(self._asked.values())
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        for i, ref in list(self._asked.items()):
            if ref not in ready:
                continue
            del self._asked[i]
            try:
                info = self.ray.get(ref)
            except Exception:  # noqa: BLE001 (the actor is down or restarting: asked again later)
                continue
            host, _, port = info["address"].rpartition(":")
            new, old = (host, int(port)), self.current[i]
            if new != old:
                self.current[i] = new
                self.moved[old] = new
                self.restarts += 1  # by Ray (/metrics: worker_restarts)
                if old in self.reconnect:
                    self.reconnect[new] = self.reconnect.pop(old)
                self.events.append({"t": time.monotonic(), "event": "restarted", "role": self.actors[i][0],
                                    "address": info["address"], "node": info["node"], "pid": info["pid"]})

    def _connect(self, addr: tuple[str, int]) -> bool:
        while addr in self.moved:  # a worker Ray restarted elsewhere: its new address
            self.reconnect.pop(addr, None)
            addr = self.moved[addr]
        return super()._connect(addr)

    def _lost(self, w: Any) -> None:
        super()._lost(w)  # a remote worker: reconnect to its address, or to where its actor is now
        for old, new in self.moved.items():
            if old in self.reconnect:
                self.reconnect.setdefault(new, self.reconnect.pop(old))

    def close(self) -> None:
        try:
            super().close()
        finally:
            try:
                self.ray.get([a.stop.remote() for _, a in self.actors], timeout=20)
            except Exception:  # noqa: BLE001 (dead already: killed below)
                pass
            for _, actor in self.actors:
                self.ray.kill(actor, no_restart=True)
            self.conn.close()


def start(args: argparse.Namespace, worker_command: list[str], opts: Any, secret: bytes | None,
          lease_s: float) -> RayPool:
    """Start the workers as Ray actors and the pool that reaches them. Raises ValueError."""
    prefill = parse_labels(args.ray_prefill_labels, "--ray-prefill-labels")
    decode = parse_labels(args.ray_decode_labels, "--ray-decode-labels")
    plain = {k: v for k, v in {**prefill, **decode}.items() if "(" not in v and not v.startswith("!")}
    nodes = [({k: v for k, v in prefill.items() if k in plain}, args.prefill_workers),
             ({k: v for k, v in decode.items() if k in plain}, args.decode_workers)]
    try:
        conn = Connection(args.ray, nodes)
    except RayUnavailable as e:
        raise ValueError(str(e)) from None
    secret = secret or secrets.token_bytes(32)
    Actor = actor_class(conn.ray)
    actors = []
    try:
        for role, n, labels in (("prefill", args.prefill_workers, prefill), ("decode", args.decode_workers, decode)):
            cmd = [*worker_command, "--secret-stdin", "--role", role, "--listen", "{host}:0", "--model", args.model,
                   "--kv-wire", opts.wire, "--options",
                   ",".join(f"{k}={v}" for k, v in asdict(opts).items() if k != "wire")]
            for _ in range(n):
                actors.append((role, Actor.options(label_selector=labels, num_cpus=1, max_restarts=-1,
                                                   max_task_retries=0).remote(cmd, LISTENING,
                                                                              stdin=secret.hex() + "\n")))
        infos = conn.ray.get([a.where.remote() for _, a in actors], timeout=300)
    except Exception as e:  # noqa: BLE001 (Ray's errors: an actor that did not start, a timeout)
        for _, a in actors:
            conn.ray.kill(a, no_restart=True)
        conn.close()
        raise ValueError(f"--ray: the workers did not start on Ray: {str(e).strip().splitlines()[-1][:300]}") from None
    addresses = [(i["address"].rpartition(":")[0], int(i["address"].rpartition(":")[2])) for i in infos]
    for (role, _), info in zip(actors, infos, strict=True):
        print(f"  {role} worker at {info['address']} on Ray node {info['node'][:12]} {info['labels']}", flush=True)
    return RayPool(args.model, conn, actors, addresses, secret=secret, opts=opts, restart=True,
                      deadline=lambda p, o: 120.0 + 0.5 * o, ready_timeout=300.0, lease_s=lease_s)
