"""Request migration and worker leases in the batch machinery (``run_requests`` over a pool), the same
coordinator that ``python -m serve --prefill-workers P --decode-workers D`` runs: a decode worker killed or
gone silent mid-request -> the request goes on on a live decode worker from its prompt plus the tokens
already streamed, and the output is the colocated engine's, with no token twice or missing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from reference.disagg.batch import ProcessFaults, run_requests
from reference.disagg.frames import Kind
from reference.disagg.models import load_model
from reference.disagg.pool import FAST_FAULTS, InProcessPool, ProcessPool, WorkerOptions
from reference.engine.engine import Engine
from reference.engine.params import SamplingParams

OPTS = WorkerOptions(num_blocks=128, block_size=8, **FAST_FAULTS)
ROOT = Path(__file__).resolve().parents[1]


def workload(n: int, seed: int, max_tokens: int = 12) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"r{i}", "prompt_token_ids": rng.integers(1, 128, size=int(rng.integers(3, 40))).tolist(),
             "max_tokens": max_tokens} for i in range(n)]


def colocated(requests: list[dict]) -> list[list[int]]:
    engine = Engine(load_model("tiny"), num_blocks=128, block_size=8)
    return [engine.generate([r["prompt_token_ids"]], SamplingParams(max_tokens=r["max_tokens"]))[0].output_token_ids
            for r in requests]


def check_migrated(pool, requests: list[dict], results: list[dict]) -> None:
    """Outputs equal the colocated engine's, and some request's second attempt began past tokens already
    streamed (its prompt was the client's prompt plus those tokens)."""
    assert [r["output_token_ids"] for r in results] == colocated(requests)
    assert all(r["error"] is None and r["finish_reason"] == "length" for r in results)
    coord = pool.coordinator
    assert coord.counters.get("requests_migrated", 0) >= 1
    moved = [q for q in coord.requests.values() if q.attempts == 2]
    assert moved
    assert max(q.offset for q in moved) >= 2
    assert coord.counters.get("late_finish", 0) == 0


def test_a_killed_decode_workers_requests_migrate_in_process():
    requests = workload(5, seed=7)
    with InProcessPool("tiny", 1, 2, opts=OPTS) as pool:
        ProcessFaults(pool, ["kill-decode"], 0, len(requests))
        results = run_requests(pool, requests)
        check_migrated(pool, requests, results)
        assert pool.coordinator.counters["decode_workers_lost"] == 1 and pool.restarts == 1


def test_sampled_requests_give_the_colocated_tokens_over_a_migration():
    """temperature 0.8 with a seed per request: the first token from the prefill worker, the rest from the
    decode worker, then from another after a kill; the tokens are the colocated engine's for those seeds."""
    requests = workload(5, seed=9)
    for i, r in enumerate(requests):
        r["sampling"] = {"temperature": 0.8, "top_k": 0, "top_p": 0.95, "seed": 1000 + i}
    engine = Engine(load_model("tiny"), num_blocks=128, block_size=8)
    want = [engine.generate([r["prompt_token_ids"]], SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95,
                                                                   seed=1000 + i))[0].output_token_ids
            for i, r in enumerate(requests)]
    greedy = colocated(requests)
    assert want != greedy  # the draws matter on this workload
    with InProcessPool("tiny", 1, 2, opts=OPTS) as cluster:
        ProcessFaults(cluster, ["kill-decode"], 0, len(requests))
        results = run_requests(cluster, requests)
        assert [r["output_token_ids"] for r in results] == want
        assert cluster.coordinator.counters.get("requests_migrated", 0) >= 1


def test_a_silent_decode_worker_loses_its_lease_and_its_requests_migrate():
    """A decode worker that stops reading and sending (here: no longer stepped) is lost when its lease ends."""
    requests = workload(5, seed=8)
    with InProcessPool("tiny", 1, 2, opts=OPTS, lease_s=0.5) as pool:
        frozen: dict[int, object] = {}

        def freeze(req, frame) -> None:
            if not frozen and frame.kind is Kind.TOKEN and len(req.tokens) >= 2 and req.decode in pool.workers:
                frozen[req.decode] = pool.workers.pop(req.decode)  # alive, link open, silent

        pool.coordinator.on_stream_frame = freeze
        results = run_requests(pool, requests, timeout=60)
        assert frozen and pool.coordinator.counters["worker_leases_expired"] == 1
        check_migrated(pool, requests, results)


def test_a_stopped_decode_worker_process_loses_its_lease_is_killed_and_its_requests_migrate():
    """Real processes: SIGSTOP the decode worker of the only decode slot mid-stream; its lease (2 s) ends, it
    is killed and restarted, and its requests go on on the new one. The requests are long (200 tokens): the
    signal lands a few milliseconds after the coordinator reads the second token, and with 12 tokens the worker
    could already have sent every last one by then (nothing would be left to migrate)."""
    requests = workload(4, seed=9, max_tokens=200)
    with ProcessPool("tiny", 1, 1, opts=OPTS, lease_s=2.0, deadline=lambda p, o: 30.0) as pool:
        stopped: list = []

        def stop(req, frame) -> None:
            if not stopped and frame.kind is Kind.TOKEN and len(req.tokens) >= 2:
                stopped.append(pool.procs[req.decode])
                os.kill(stopped[0].pid, signal.SIGSTOP)

        pool.coordinator.on_stream_frame = stop
        results = run_requests(pool, requests, timeout=60)
        assert stopped and min(len(r["output_token_ids"]) for r in results) == 200
        assert stopped[0].poll() is not None  # killed when its lease ended, and reaped
        assert pool.coordinator.counters["worker_leases_expired"] == 1 and pool.restarts == 1
        check_migrated(pool, requests, results)
        pool.shutdown()
    assert all(b["free_blocks"] == b["total_blocks"] and b["live_streams"] == 0 for b in pool.byes)


def test_batch_command_migrates_off_a_killed_decode_worker_and_checks_its_lease(tmp_path):
    from tests.test_disagg_processes import run_cli

    lines = [json.dumps(r) for r in workload(3, seed=10)]
    code, disagg, err = run_cli(tmp_path, lines, "--prefill", "1", "--decode", "2", "--inject", "kill-decode",
                                "--worker-lease", "5")
    assert code == 0, err
    assert [r["output_token_ids"] for r in disagg] == colocated(workload(3, seed=10))
    code, _, err = run_cli(tmp_path, lines, "--worker-lease", "0")
    assert code == 2 and "--worker-lease must be > 0" in err


class Listening:
    """``python -m reference.disagg worker --listen 127.0.0.1:PORT`` on the tiny model: a worker on another host."""

    def __init__(self, role: str, secret: bytes, port: int = 0, options: str = "num_blocks=128,block_size=8") -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", UNFIRE_DISAGG_SECRET=secret.hex())
        self.proc = subprocess.Popen([sys.executable, "-m", "reference.disagg", "worker", "--role", role, "--model",
                                      "tiny", "--listen", f"127.0.0.1:{port}", "--options",
                                      options], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        self.port = int(line.rsplit(":", 1)[1])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def test_remote_workers_serve_the_batch_and_a_lost_one_rejoins_even_after_a_link_without_hello():
    """The pool's remote workers (the endpoint's ``--workers``): a batch runs on them; the decode worker's
    host dies; while its port first answers without HELLO (the link is dropped at the HELLO timeout), then
    serves a fresh worker, the pool keeps reconnecting until the new worker rejoins."""
    secret = os.urandom(32)
    requests = workload(3, seed=11)
    prefill, decode = Listening("prefill", secret), Listening("decode", secret)
    try:
        with ProcessPool("tiny", 0, 0, remote=[("127.0.0.1", prefill.port), ("127.0.0.1", decode.port)],
                            secret=secret, opts=OPTS, ready_timeout=60) as pool:
            coord = pool.coordinator
            assert [r["output_token_ids"] for r in run_requests(pool, requests)] == colocated(requests)
            coord.hello_timeout = 1.0
            decode.kill()
            mute = socket.create_server(("127.0.0.1", decode.port))  # accepts (in its backlog), never says HELLO
            try:
                end = time.monotonic() + 30
                while coord.counters.get("links_idle", 0) == 0:
                    assert time.monotonic() < end, "the link without HELLO was not dropped"
                    pool.pump()
            finally:
                mute.close()
            decode = Listening("decode", secret, port=decode.port)
            pool.wait_ready(1, 1, timeout=30)
            assert [r["output_token_ids"] for r in run_requests(pool, [dict(r, id="again-" + r["id"])
                                                                          for r in requests])] == colocated(requests)
    finally:
        prefill.kill()
        decode.kill()


def test_batch_command_runs_on_remote_workers(tmp_path, monkeypatch):
    """The batch door's --workers carrier: ``python -m reference.disagg run --prefill 0 --decode 0 --workers``
    on two listening worker processes gives the colocated tokens; without the secret it is refused."""
    from tests.test_disagg_processes import run_cli

    secret = os.urandom(32)
    requests = workload(3, seed=12)
    lines = [json.dumps(r) for r in requests]
    monkeypatch.delenv("UNFIRE_DISAGG_SECRET", raising=False)
    code, _, err = run_cli(tmp_path, lines, "--prefill", "0", "--decode", "0", "--workers", "127.0.0.1:1")
    assert code == 2 and "shared secret" in err
    prefill, decode = Listening("prefill", secret, options=""), Listening("decode", secret, options="")
    try:
        monkeypatch.setenv("UNFIRE_DISAGG_SECRET", secret.hex())
        code, rows, err = run_cli(tmp_path, lines, "--prefill", "0", "--decode", "0", "--workers",
                                  f"127.0.0.1:{prefill.port},127.0.0.1:{decode.port}")
        assert code == 0, err
        assert [r["output_token_ids"] for r in rows] == colocated(requests)
    finally:
        prefill.kill()
        decode.kill()
