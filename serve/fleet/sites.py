"""The fleet's server processes: one ``python -m serve`` per worker of every local site.

``plan_workers(scenario)`` says which servers each site runs (model served, name clients send, where);
``Sites`` starts the local ones in parallel, waits until each prints its address, and can kill and
restart a site (the failure experiments do that). A site with ``address`` set is remote: nothing is
started, the gateway reaches its servers over HTTP.

A disaggregated site (replicas with ``role = "prefill"`` / ``"decode"``) runs one disaggregated endpoint
per model: ``python -m serve --prefill-workers P --decode-workers D`` with P and D the counts of that
model's prefill and decode replicas, so the site's P:D is the scenario's. From the gateway it is one
server (the router sees one colocated replica: the endpoint hands prompts to its decode workers itself);
its worker processes belong to the server's process group, so killing the site kills them too.
``colocate`` runs such a site the old way instead, one colocated server per replica.

A pipelined site (``pipeline = ["H100", "L4"]``: a stage per GPU type, in order) runs each of its
servers as ``python -m serve --pipeline CHAIN``: stage processes on this host, one CPU stage per GPU
named, each declared slower than the fastest by the ratio of their per-layer times in the placement
model (``pipeline_chain``), so that ``best_split`` (``reference/cluster/placement.py``, which the
pipeline's split comes from) gives a slower GPU's stage fewer layers, as it would the real chain.
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
from typing import Any

from reference.cluster.pipeline import ChainGpu, chain_problem
from reference.cluster.scenario import Scenario, Site
from reference.engine.cost import StepShape

ADDRESS = re.compile(r" on http://([^/\s]+)/v1")
START_TIMEOUT_S = 120.0
CONTEXT = 128  # context of the decode micro-batch stage speeds are compared at (fast.pipeline's)
MAX_SLOWDOWN = 100.0  # the most a CPU stage may be declared slower (fast.pipeline's limit)


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
    prefill_workers: int = 0  # a disaggregated endpoint: its prefill and decode worker processes (P:D)
    decode_workers: int = 0
    actor: Any = None  # the Ray actor that runs this server (serve/fleet/ray_sites.py), or None
    ray_pid: int | None = None  # that server's process id, as its actor reports it
    node: str = ""  # the Ray node it runs on
    pipeline: str = ""  # a pipelined server: its --pipeline chain (pipeline_chain)

    @property
    def disaggregated(self) -> bool:
        return self.decode_workers > 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self.ray_pid


def site_workers(site: Site) -> list[str]:
    """The scenario model each server of ``site`` stands for, in order (see the module docstring)."""
    models = [r.model for r in site.replicas for _ in range(r.count)]
    n = len(site.address) or site.max_workers or site.workers or len(models)
    if not models:
        return []
    return [models[i % len(models)] for i in range(n)]


def plan_workers(s: Scenario, colocate: bool = False) -> list[Worker]:
    """Every worker of the fleet, site by site in file order. A disaggregated site (prefill/decode
    replicas) is one disaggregated endpoint per model (see the module docstring), or, with ``colocate``,
    one colocated server per replica. A remote disaggregated site's ``address`` entries are its
    endpoints, as they were started there."""
    workers: list[Worker] = []
    for site in s.sites.values():
        split = [r for r in site.replicas if r.role != "colocated"]
        chain = pipeline_chain(s, site) if site.pipeline else ""
        if not split or colocate:
            for i, model in enumerate(site_workers(site)):
                address = site.address[i] if site.address else ""
                workers.append(Worker(len(workers), site.name, model, site.serve_model, address,
                                      pipeline=chain))
            continue
        if chain:
            raise FleetError(f"sites[{site.name}]: pipeline with prefill/decode replicas: a "
                             "disaggregated endpoint does not run pipeline stages (give one or the "
                             "other, or --colocate)")
        endpoints = disaggregated_endpoints(site)
        if site.address:
            for i, address in enumerate(site.address):
                model, p, d = endpoints[i % len(endpoints)]
                workers.append(Worker(len(workers), site.name, model, site.serve_model, address,
                                      prefill_workers=p, decode_workers=d))
            continue
        for model in (r.model for r in site.replicas if r.role == "colocated" for _ in range(r.count)):
            workers.append(Worker(len(workers), site.name, model, site.serve_model))
        for model, p, d in endpoints:
            workers.append(Worker(len(workers), site.name, model, site.serve_model, prefill_workers=p,
                                  decode_workers=d))
    if not workers:
        raise FleetError("the scenario has no replicas to serve")
    return workers


def pipeline_chain(s: Scenario, site: Site) -> str:
    """The ``--pipeline`` chain of ``site``'s servers: one CPU stage per GPU type of
    ``site.pipeline``, each declared slower than the fastest by the ratio of their per-layer times
    (the placement model, ``reference.cluster.pipeline.chain_problem``, on a decode micro-batch of
    the site's first model), e.g. ``["H100", "L4"]`` -> ``"cpu:1,cpu:1x12.8"``."""
    spec = s.models[site.replicas[0].model] if site.replicas else next(iter(s.models.values()))
    b = max(1, -(-s.max_num_seqs // 2))  # a full batch of decodes in 2 micro-batches (fast.pipeline)
    problem = chain_problem(spec, [ChainGpu(s.gpu_types[g]) for g in site.pipeline],
                            StepShape((1,) * b, (CONTEXT,) * b, b))
    times = [problem.layer_time[k][0] for k in range(len(site.pipeline))]
    stages = []
    for gpu, t in zip(site.pipeline, times, strict=True):
        slowdown = t / min(times)
        if slowdown > MAX_SLOWDOWN:
            raise FleetError(f"sites[{site.name}].pipeline: a {gpu} stage is {slowdown:.0f}x "
                             "slower than the fastest; a CPU stage can be declared at most "
                             f"{MAX_SLOWDOWN:g}x slower")
        stages.append("cpu:1" if slowdown < 1.005 else f"cpu:1x{slowdown:.3g}")
    return ",".join(stages)


def disaggregated_endpoints(site: Site) -> list[tuple[str, int, int]]:
    """(model, P, D) of every disaggregated endpoint of ``site``: one per model of its prefill/decode
    replicas, P and D their counts. A model with prefill but no decode replicas (or the other way round),
    or a ``workers`` count for the site, is refused: the endpoint's shape is the replicas'."""
    counts: dict[str, list[int]] = {}
    for r in site.replicas:
        if r.role in ("prefill", "decode"):
            counts.setdefault(r.model, [0, 0])[r.role == "decode"] += r.count
    for model, (p, d) in counts.items():
        if not p or not d:
            raise FleetError(f"sites[{site.name}]: model {model} has {p} prefill and {d} decode replicas; a "
                             "disaggregated endpoint needs both (or give --colocate)")
    if site.workers and not site.address:
        raise FleetError(f"sites[{site.name}]: workers = {site.workers} with prefill/decode replicas: a "
                         "disaggregated site runs one endpoint per model, P:D from its replicas; leave workers "
                         "out (or give --colocate)")
    return [(model, p, d) for model, (p, d) in counts.items()]


def server_command(s: Scenario, w: Worker, model: str, host: str, keys_file: Path | str | None,
                   engine_args: list[str]) -> list[str]:
    """The ``python -m serve`` command line of worker ``w``, loading ``model``, listening on ``host``."""
    cmd = [sys.executable, "-m", "serve", "--model", model, "--served-model-name", w.model, "--host", host,
           "--port", "0", "--block-size", str(s.block_size), "--max-num-seqs", str(s.max_num_seqs),
           "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--policy", s.policy, "--shutdown-grace", "0"]
    if w.disaggregated:  # the endpoint's workers run the reference runner
        cmd += ["--engine", "reference", "--prefill-workers", str(w.prefill_workers),
                "--decode-workers", str(w.decode_workers)]
    if w.pipeline:  # stage processes of the fast engine, split by best_split over the chain
        cmd += ["--pipeline", w.pipeline]
    cmd += engine_args
    return cmd + (["--api-keys", str(keys_file)] if keys_file else [])


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
        return server_command(self.s, w, model, "127.0.0.1", self.keys_file, self.engine_args)

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
