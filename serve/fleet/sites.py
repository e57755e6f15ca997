"""The fleet's server processes: one ``python -m serve`` per worker of every local site.

``plan_workers(scenario)`` says which servers each site runs (model served, name clients send, where);
``Sites`` starts the local ones in parallel, waits until each prints its address, and can kill and
restart a site (the failure experiments do that). A site with ``address`` set is remote: nothing is
started, the gateway reaches its servers over HTTP.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from reference.cluster.scenario import Scenario, Site

ADDRESS = re.compile(r" on http://([^/\s]+)/v1")
START_TIMEOUT_S = 120.0


class FleetError(RuntimeError):
    """The fleet cannot start or run as asked; the message names the site and the reason."""


@dataclass
class Worker:
    """One server of a site: the router sees it as one replica."""

    index: int
    site: str
    model: str  # the scenario's model name (what the router and the client call it)
    serve_model: str  # what the server loads
    address: str = ""  # host:port, known once started (or given, for a remote site)
    proc: subprocess.Popen | None = None


def site_workers(site: Site) -> list[str]:
    """The scenario model each server of ``site`` stands for, in order (see the module docstring)."""
    models = [r.model for r in site.replicas for _ in range(r.count)]
    n = len(site.address) or site.workers or len(models)
    if not models:
        return []
    return [models[i % len(models)] for i in range(n)]


def plan_workers(s: Scenario, colocate: bool = False) -> list[Worker]:
    """Every worker of the fleet, site by site in file order. Disaggregated sites (prefill/decode
    replicas) are refused unless ``colocate``: then each serves prompts and decoding itself."""
    workers: list[Worker] = []
    for site in s.sites.values():
        roles = {r.role for r in site.replicas}
        if roles - {"colocated"} and not colocate:
            raise FleetError(f"sites[{site.name}]: prefill/decode replicas (a disaggregated site) are not served by "
                             "the fleet yet; give --colocate to run each of its workers colocated")
        for i, model in enumerate(site_workers(site)):
            address = site.address[i] if site.address else ""
            workers.append(Worker(len(workers), site.name, model, site.serve_model, address))
    if not workers:
        raise FleetError("the scenario has no replicas to serve")
    return workers


class Sites:
    """The local server processes of a fleet."""

    def __init__(self, s: Scenario, workers: list[Worker], workdir: Path, keys_file: Path | None,
                 engine_args: list[str]) -> None:
        self.s, self.workers, self.workdir = s, workers, workdir
        self.keys_file, self.engine_args = keys_file, engine_args
        self.logs: dict[int, Path] = {}

    def command(self, w: Worker) -> list[str]:
        model = w.serve_model
        if model == "tiny":
            from serve.fleet.tiny import write_tiny_checkpoint

            model = str(write_tiny_checkpoint(self.workdir / "tiny"))
        cmd = [sys.executable, "-m", "serve", "--model", model, "--served-model-name", w.model, "--host", "127.0.0.1",
               "--port", "0", "--block-size", str(self.s.block_size), "--max-num-seqs", str(self.s.max_num_seqs),
               "--max-num-batched-tokens", str(self.s.max_num_batched_tokens), "--policy", self.s.policy,
               "--shutdown-grace", "0", *self.engine_args]
        return cmd + (["--api-keys", str(self.keys_file)] if self.keys_file else [])

    def start(self, only: list[Worker] | None = None) -> None:
        """Start the local workers (all, or ``only``) in parallel; returns once every one serves."""
        todo = [w for w in (only or self.workers) if not w.address or w.proc is not None]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        for w in todo:
            log = self.workdir / f"worker{w.index}-{w.site}.log"
            self.logs[w.index] = log
            w.proc = subprocess.Popen(self.command(w), stdout=subprocess.PIPE, stderr=log.open("ab"), text=True,
                                      env=env, start_new_session=True)
        errors: list[str] = []
        threads = [threading.Thread(target=self._await, args=(w, errors)) for w in todo]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop()
            raise FleetError("; ".join(errors))

    def _await(self, w: Worker, errors: list[str]) -> None:
        assert w.proc is not None and w.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = w.proc.stdout.readline()
            if not line:
                break
            m = ADDRESS.search(line)
            if m:
                w.address = m.group(1)
                threading.Thread(target=_drain, args=(w.proc.stdout,), daemon=True).start()
                return
        tail = self.logs[w.index].read_text(errors="replace")[-400:] if w.index in self.logs else ""
        errors.append(f"sites[{w.site}] worker {w.index}: the server did not start: {tail.strip() or 'no output'}")

    def kill_site(self, site: str) -> list[Worker]:
        """Kill every local worker of ``site`` at once (SIGKILL: no drain); returns them."""
        if site not in self.s.sites:
            raise FleetError(f"unknown site {site!r}")
        killed = [w for w in self.workers if w.site == site and w.proc is not None]
        for w in killed:
            _kill(w.proc)
        return killed

    def restart_site(self, site: str) -> None:
        """Start the killed workers of ``site`` again (new ports)."""
        workers = [w for w in self.workers if w.site == site and w.proc is not None]
        for w in workers:
            w.address = ""
        self.start(workers)

    def stop(self) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.terminate()
        for w in self.workers:
            if w.proc is not None:
                try:
                    w.proc.wait(10)
                except subprocess.TimeoutExpired:
                    _kill(w.proc)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def _drain(stream: object) -> None:
    for _ in stream:  # type: ignore[attr-defined]
        pass
