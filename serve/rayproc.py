"""A program run by a Ray actor: what ``--ray ADDRESS`` places on a cluster (the fleet's servers, the
disaggregated endpoint's workers).

``ProcessHost`` is the body of such an actor: it starts one program of ours (``python -m serve``, a
disaggregated worker) on the node Ray placed it on, waits until the program prints its address, and
lives exactly as long as the program: the program dies with the actor (``PR_SET_PDEATHSIG``), and the
actor exits when the program does, so Ray restarts the pair (``max_restarts``) on a node whose labels
match the actor's ``label_selector``. ``connect`` joins a running cluster, or starts ``local`` one
(``ray.cluster_utils.Cluster``) with labelled nodes. Ray is an optional extra: ``need_ray`` says how to
install it.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

INSTALL = "pip install -e '.[ray]' (Ray 2.60 or newer)"
START_TIMEOUT_S = 120.0


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached or started; the message says what to do."""


def need_ray(flag: str = "--ray") -> Any:
    """The ``ray`` module, or RayUnavailable naming how to install it."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable(f"{flag} needs Ray, which is not installed: {INSTALL}") from None
    return ray


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the actor's process dies (Linux), so no server outlives it."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ProcessHost:
    """One program of ours, run on the actor's node. ``cmd`` may hold ``{host}`` (the node's IP address),
    ``{dir}`` (a folder of its own on the node) and ``{tiny}`` (the fleet's tiny checkpoint, written there);
    ``files`` are written into ``{dir}`` (mode 0600) first; ``stdin`` is written to the program's stdin;
    the first line of its stdout that ``pattern`` matches gives its address (group 1)."""

    def __init__(self, cmd: list[str], pattern: str, *, files: dict[str, str] | None = None,
                 stdin: str | None = None, workdir: str | None = None, env: dict[str, str] | None = None) -> None:
        import ray

        ctx = ray.get_runtime_context()
        self.node, self.labels = ctx.get_node_id(), dict(ctx.get_node_labels())
        base = workdir if workdir and Path(workdir).is_dir() else None  # the driver's folder, on its own machine
        self.dir = Path(tempfile.mkdtemp(prefix="unfire-ray-", dir=base))
        for name, text in (files or {}).items():
            path = self.dir / name
            path.write_text(text)
            path.chmod(0o600)
        host = ray.util.get_node_ip_address()
        values = {"host": host, "dir": str(self.dir)}
        if any("{tiny}" in c for c in cmd):
            from serve.fleet.tiny import write_tiny_checkpoint

            values["tiny"] = str(write_tiny_checkpoint(self.dir / "tiny"))
        self.cmd = [c.format(**values) if "{" in c else c for c in cmd]
        self.log = self.dir / "log"
        full_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log.open("ab"), text=True, env=full_env,
                                     preexec_fn=die_with_parent, start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            if stdin:
                self.proc.stdin.write(stdin)
            self.proc.stdin.close()
        except OSError:
            pass
        self.address = self._await(re.compile(pattern))
        self.stopping = False
        threading.Thread(target=self._drain_and_follow, daemon=True).start()

    def _await(self, pattern: re.Pattern) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = pattern.search(line)
            if m:
                return m.group(1)
        self.proc.kill()
        tail = self.log.read_text(errors="replace")[-400:].strip()
        raise RuntimeError(f"{' '.join(self.cmd[:4])} did not start on node {self.node[:12]}: {tail or 'no output'}")

    def _drain_and_follow(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass
        self.proc.wait()
        if not self.stopping:  # the program died: so does the actor, and Ray restarts both
            os._exit(1)

    def where(self) -> dict[str, Any]:
        """Its address, the program's process id, the node it runs on and that node's labels."""
        return {"address": self.address, "pid": self.proc.pid, "node": self.node, "labels": self.labels}

    def stop(self, grace_s: float = 10.0) -> int | None:
        """Stop the program (SIGTERM, then SIGKILL after ``grace_s``); its exit status."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def actor_class(ray: Any) -> Any:
    return ray.remote(ProcessHost)


class Connection:
    """The driver's hold on a cluster: the one it joined, or the ``local`` one it started (then stopped with it)."""

    def __init__(self, address: str, nodes: list[tuple[dict[str, str], int]]) -> None:
        """``nodes``: (labels, CPUs) of every node a ``local`` cluster starts (besides a head with no CPU)."""
        ray = need_ray()
        self.ray, self.cluster, self.address = ray, None, address
        self.nodes: list[tuple[dict[str, str], Any]] = []  # a local cluster's nodes: (labels, ray's Node)
        try:
            if address == "local":
                from ray.cluster_utils import Cluster

                self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
                for labels, cpus in nodes:
                    self.add_node(labels, cpus)
                address = self.cluster.address
            ray.init(address=address, log_to_driver=False, logging_level="warning", ignore_reinit_error=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            self.close()
            raise RayUnavailable(f"--ray {self.address}: cannot reach or start the Ray cluster: {e}") from None

    def add_node(self, labels: dict[str, str], cpus: int) -> Any:
        """A node of the local cluster (tests remove them: ``self.cluster.remove_node``)."""
        assert self.cluster is not None, "only a local cluster takes nodes"
        node = self.cluster.add_node(num_cpus=cpus, labels=labels)
        self.nodes.append((labels, node))
        return node

    def remove_node(self, node: Any) -> None:
        """Take a node of the local cluster away at once (its raylet and everything on it killed)."""
        assert self.cluster is not None
        self.nodes = [(labels, n) for labels, n in self.nodes if n is not node]
        self.cluster.remove_node(node, allow_graceful=False)

    def nodes_with(self, selector: dict[str, str]) -> list[str]:
        """The live nodes whose labels are exactly ``selector``'s values (plain values only)."""
        return [n["NodeID"] for n in self.ray.nodes()
                if n["Alive"] and all(n.get("Labels", {}).get(k) == v for k, v in selector.items())]

    def close(self) -> None:
        if self.ray.is_initialized():
            self.ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
