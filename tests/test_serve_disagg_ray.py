"""The disaggregated endpoint's workers on Ray: ``python -m serve --prefill-workers 1 --decode-workers 2
--ray local`` (serve/disagg_ray.py), on the fleet's tiny model, real processes throughout.

Checked: each worker runs on a node with its role's label (as Ray reports it); greedy answers are the
colocated engine's (the KV went over the project's frames); a decode worker killed during 8 streams is
restarted by Ray and rejoins at its new address while its streams migrate (each ends whole, none hangs);
a killed prefill worker's prompts are computed by the decode workers and Ray brings it back. Without
Ray, or without workers to place, ``--ray`` says what is missing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.test_serve_disagg import Server  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = [f"Write a sentence about the number {n}." for n in range(8)]
MAX_TOKENS = 16
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install -e '.[ray]')")


def complete(base: str, model: str, prompt: str, stream: bool = False, on_token=None,  # noqa: ANN001
             max_tokens: int = MAX_TOKENS) -> tuple[list[str], str | None]:
    """(pieces of text, error message or None) of one greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        return [r.json()["choices"][0]["text"]], None
    pieces, error = [], None
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=240) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if '"error"' in line:
                    error = line
                elif '"text"' in line:
                    pieces.append(re.search(r'"text":\s*"((?:[^"\\]|\\.)*)"', line).group(1))
                    if on_token is not None:
                        on_token()
    return pieces, error


def test_ray_needs_workers_to_place_and_says_how_to_install(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "serve", "--ray", "local"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2 and "--prefill-workers >= 1" in r.stderr
    code = ("import sys; sys.modules['ray'] = None\nfrom serve.__main__ import main\nsys.exit(main(["
            "'--model', 'smollm2', '--engine', 'reference', '--prefill-workers', '1', '--decode-workers', '1', "
            "'--ray', 'local', '--port', '0']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "--ray needs Ray" in r.stderr and "pip install -e '.[ray]'" in r.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from serve.fleet.tiny import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def server(tiny):
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    s = Server("--model", tiny, "--engine", "reference", "--prefill-workers", "1", "--decode-workers", "2",
               "--ray", "local", "--worker-lease", "10", "--max-num-seqs", "8")
    try:
        yield s
    finally:
        assert s.close() == 0


def workers(s: Server) -> dict[str, list[int]]:
    rows = re.findall(r'^unfire_disagg_worker_up\{node="\d+",role="(\w+)",pid="(\d+)"\} 1$', s.metrics(), re.M)
    out: dict[str, list[int]] = {"prefill": [], "decode": []}
    for role, pid in rows:
        out[role].append(int(pid))
    return out


def wait_workers(s: Server, prefill: int, decode: int, timeout: float = 120.0) -> dict[str, list[int]]:
    end = time.monotonic() + timeout
    while True:
        w = workers(s)
        if len(w["prefill"]) == prefill and len(w["decode"]) == decode:
            return w
        assert time.monotonic() < end, f"workers {w} after {timeout} s"
        time.sleep(0.25)


def events(s: Server) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r'^unfire_disagg_events_total\{event="(\w+)"\} (\d+)$', s.metrics(),
                                             re.M)}


def streams_with_fault(s: Server, model: str, fault) -> list[tuple[list[str], str | None]]:  # noqa: ANN001
    # the fault comes once every stream has 3 tokens: each is then decoding on a decode worker (the first
    # token comes from the prefill worker), so the victim holds streams that must migrate
    decoding, lock, counts = threading.Event(), threading.Lock(), [0] * len(QUESTIONS)

    def counter(i: int):  # noqa: ANN202
        def on_token() -> None:
            with lock:
                counts[i] += 1
                if min(counts) >= 3:
                    decoding.set()
        return on_token

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        futures = [pool.submit(complete, s.base, model, q, True, counter(i), 200) for i, q in enumerate(QUESTIONS)]
        assert decoding.wait(240)
        fault()
        return [f.result(timeout=240) for f in futures]


@needs_ray
def test_workers_are_placed_by_their_roles_labels_and_answer_as_the_colocated_engine(server, tiny) -> None:
    placed = [line for line in server.lines if " worker at " in line and "on Ray node" in line]
    assert len(placed) == 3
    for line in placed:
        role = line.split()[0]
        assert f"'disagg-role': '{role}'" in line  # the labels of the node Ray put it on
    got = [complete(server.base, tiny, q)[0] for q in QUESTIONS[:3]]
    colocated = Server("--model", tiny, "--engine", "reference")
    try:
        want = [complete(colocated.base, tiny, q)[0] for q in QUESTIONS[:3]]
    finally:
        assert colocated.close() == 0
    assert got == want


@needs_ray
def test_a_killed_decode_worker_is_restarted_by_ray_and_its_streams_migrate(server, tiny) -> None:
    before_pids = wait_workers(server, 1, 2)
    before = events(server)
    victim = before_pids["decode"][0]
    done = streams_with_fault(server, tiny, lambda: os.kill(victim, signal.SIGKILL))
    for _, error in done:  # whole (migrated or untouched), or a clear error event; none hangs
        assert error is None or "disaggregated workers" in error
    assert sum(error is None for _, error in done) >= len(done) - 1
    after_pids = wait_workers(server, 1, 2)
    assert victim not in after_pids["decode"]  # a new process: Ray restarted the actor, the endpoint reconnected
    after = events(server)
    assert after["decode_workers_lost"] == before.get("decode_workers_lost", 0) + 1
    assert after["worker_restarts"] >= before.get("worker_restarts", 0) + 1
    assert after.get("requests_migrated", 0) > before.get("requests_migrated", 0)  # went on elsewhere
    assert complete(server.base, tiny, QUESTIONS[0])[1] is None


@needs_ray
def test_a_killed_prefill_worker_is_restarted_by_ray(server, tiny) -> None:
    victim = wait_workers(server, 1, 2)["prefill"][0]
    done = streams_with_fault(server, tiny, lambda: os.kill(victim, signal.SIGKILL))
    assert all(error is None for _, error in done)  # the decode workers compute the prompts themselves
    after = wait_workers(server, 1, 2)
    assert after["prefill"] != [victim]
    assert events(server)["prefill_workers_lost"] >= 1
