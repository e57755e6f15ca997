"""Probes of the worker-protocol door: a real coordinator port with real worker processes (tiny model).

A peer that holds the secret but sends a malformed HELLO or HEARTBEAT is dropped (logged, counted) and
the batch goes on; a peer without the secret can make the coordinator read no more than a handshake;
idle and surplus connections are closed; the secret is not in any worker's environment. Hypothesis
sends random frames (signed and unsigned, random kinds, lengths and payloads) at the port; after
them every legitimate request still finishes with the tokens a colocated engine computes. The batch
command always writes a complete output file and says what it wrote.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference.disagg.__main__ import run_colocated
from reference.disagg.batch import run_requests
from reference.disagg.frames import HEADER, MAGIC, MAX_PAYLOAD, VERSION, Kind, encode_frame
from reference.disagg.pool import SECRET_ENV, ProcessPool, WorkerOptions
from reference.disagg.transport import HANDSHAKE_PAYLOAD

ROOT = Path(__file__).resolve().parent.parent
OPTS = WorkerOptions(num_blocks=64, handshake_timeout=0.5, handshake_retries=2, stream_timeout=3.0)
REQUESTS = [{"id": f"r{i}", "prompt_token_ids": [(7 * i + j) % 120 + 1 for j in range(5 + i)], "max_tokens": 4}
            for i in range(3)]
GOOD_LAYOUT = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8, "block_size": 16, "wire": "fp32",
               "scale_rule": "none"}


def hello_body(node: int, **changes: object) -> dict:
    body = {"role": "decode", "node": node, "model_digest": "x" * 64, "layout": GOOD_LAYOUT, "num_blocks": 64,
            "pid": 1, "vocab_size": 128, "max_context": 1024, "eos_token_ids": [0]}
    return {**body, **changes}


def frame(kind: Kind, payload: bytes, secret: bytes, src: int = 900, seq: int = 0, stream: int = 0) -> bytes:
    return encode_frame(kind=kind, src=src, stream=stream, seq=seq, payload=payload, secret=secret)


def send(port: int, data: bytes, linger: float = 0.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(data)
    if linger:
        time.sleep(linger)
    return s


def pump_until(pool: ProcessPool, cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out; counters {pool.coordinator.counters}"
        pool.pump()


def closed_by_peer(s: socket.socket, timeout: float = 10.0) -> bool:
    """True if the coordinator closes ``s`` within ``timeout`` (whatever it sent before is read and dropped)."""
    s.settimeout(timeout)
    try:
        while s.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [r["output_token_ids"] for r in run_colocated("tiny", REQUESTS)]


@pytest.fixture(scope="module")
def pool():
    with ProcessPool("tiny", 1, 1, opts=OPTS) as c:
        yield c


def assert_batch_right(pool: ProcessPool, expected: list[list[int]], tag: str) -> None:
    reqs = [{**r, "id": f"{tag}-{r['id']}"} for r in REQUESTS]
    results = run_requests(pool, reqs, timeout=60)
    assert [r["error"] for r in results] == [None] * len(reqs), results
    assert [r["output_token_ids"] for r in results] == expected


def test_a_signed_malformed_hello_drops_the_peer_and_the_batch_goes_on(pool, expected, caplog):
    caplog.set_level(logging.WARNING, logger="reference.disagg")
    before = pool.coordinator.counters.get("peers_dropped", 0)
    s = send(pool.port, frame(Kind.HELLO, json.dumps(hello_body(900, layout="flat")).encode(), pool.secret))
    pump_until(pool, lambda: pool.coordinator.counters.get("peers_dropped", 0) > before)
    assert closed_by_peer(s)
    assert 900 not in pool.coordinator.workers
    assert any("HELLO frame breaks the schema" in r.getMessage() for r in caplog.records)
    assert_batch_right(pool, expected, "hello")


def test_a_signed_malformed_heartbeat_drops_that_worker_and_its_requests_go_on(pool, expected, caplog):
    caplog.set_level(logging.WARNING, logger="reference.disagg")
    coord = pool.coordinator
    impostor = hello_body(901, num_blocks=10**6)  # the most free blocks: the router picks it
    s = send(pool.port, frame(Kind.HELLO, json.dumps(impostor).encode(), pool.secret, src=901))
    pump_until(pool, lambda: 901 in coord.workers)
    # the impostor is a live decode worker now: route a request to it (fewest in-flight tokens), then break it
    coord.submit("hb-victim", REQUESTS[0]["prompt_token_ids"], 4)
    victim = coord.requests["hb-victim"]
    assert victim.decode == 901
    s.sendall(frame(Kind.HEARTBEAT, b'{"free_blocks": "many"}', pool.secret, src=901, seq=1))
    pump_until(pool, lambda: not coord.workers[901].alive)
    assert closed_by_peer(s)
    assert any("HEARTBEAT frame breaks the schema" in r.getMessage() for r in caplog.records)
    pump_until(pool, lambda: victim.result is not None, timeout=60)
    assert victim.result["error"] is None and victim.result["output_token_ids"] == expected[0]
    assert_batch_right(pool, expected, "heartbeat")


def test_an_unauthenticated_peer_cannot_make_the_coordinator_buffer_a_big_frame(pool):
    header = HEADER.pack(MAGIC, VERSION, int(Kind.HELLO), 902, 0, 0, MAX_PAYLOAD, 0)
    s = send(pool.port, header + b"\0" * 1000)
    assert closed_by_peer(s)  # closed on the header alone, 64 MiB never awaited
    small = HEADER.pack(MAGIC, VERSION, int(Kind.HELLO), 902, 0, 0, HANDSHAKE_PAYLOAD + 1, 0)
    assert closed_by_peer(send(pool.port, small))


def test_idle_and_surplus_connections_are_closed_and_forgotten(pool, caplog):
    caplog.set_level(logging.WARNING, logger="reference.disagg")
    coord = pool.coordinator
    coord.hello_timeout = 1.0
    try:
        idle = [socket.create_connection(("127.0.0.1", pool.port)) for _ in range(coord.max_pending_links + 8)]
        pump_until(pool, lambda: coord.counters.get("links_refused", 0) >= 8)
        assert coord.pending_links() <= coord.max_pending_links
        pump_until(pool, lambda: coord.pending_links() == 0)
        assert all(closed_by_peer(s) for s in idle)
        # forgotten: every link left belongs to a live worker (no idle, refused or dropped one lingers)
        pump_until(pool, lambda: all(getattr(link.peer, "alive", False) for link in coord.links.values()))
        assert any("no HELLO within" in r.getMessage() for r in caplog.records)
        assert any("refusing a connection" in r.getMessage() for r in caplog.records)
    finally:
        coord.hello_timeout = 10.0


def test_the_secret_is_not_in_any_workers_environment(pool):
    if not Path("/proc/self/environ").exists():
        pytest.skip("no /proc here")
    for proc in pool.procs.values():
        if proc.poll() is None:
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
            assert SECRET_ENV.encode() not in environ and pool.secret.hex().encode() not in environ


kinds = st.sampled_from([int(k) for k in Kind] + [0, 13, 255])
payloads = (st.binary(max_size=200)
            | st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=3),
                           max_leaves=8).map(lambda v: json.dumps(v).encode()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=kinds, payload=payloads, signed=st.booleans(), src=st.integers(0, 65535), seq=st.integers(0, 2**32 - 1),
       declared=st.none() | st.integers(0, 2**32 - 1), cut=st.none() | st.integers(0, 300), stream=st.integers(0, 9))
def test_random_frames_at_the_port_never_break_the_coordinator(pool, kind, payload, signed, src, seq, declared,
                                                                cut, stream):
    secret = pool.secret if signed else b"not the secret at all, 32 bytes"
    if kind in {int(k) for k in Kind}:
        data = frame(Kind(kind), payload, secret, src=src, seq=seq, stream=stream)
    else:
        data = HEADER.pack(MAGIC, VERSION, kind, src, stream, seq, len(payload), 0) + payload + b"\0" * 32
    if declared is not None:
        data = data[:24] + declared.to_bytes(4, "little") + data[28:]
    if cut is not None:
        data = data[:cut]
    with send(pool.port, data):
        for _ in range(3):
            pool.pump()
    real = [w for w in pool.coordinator.workers.values() if w.alive and w.node in pool.procs]
    assert {w.role for w in real} == {"prefill", "decode"}, pool.coordinator.counters


def test_after_the_random_frames_legitimate_requests_get_the_right_tokens(pool, expected):
    pump_until(pool, lambda: pool.coordinator.live("decode") and pool.coordinator.live("prefill"))
    assert_batch_right(pool, expected, "after-fuzz")


def test_batch_command_writes_every_line_and_says_what_it_wrote(tmp_path, expected):
    prompts = tmp_path / "in.jsonl"
    lines = [json.dumps(r) for r in REQUESTS] + [json.dumps({"id": "oov", "prompt_token_ids": [5000], "max_tokens": 2}),
                                                 "[" * 100_000]
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "reference.disagg", "run", "--model", "tiny", "--prompts", str(prompts), "--out",
           str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(results) == 5 and [r["output_token_ids"] for r in results[:3]] == expected
    assert "[0, 128)" in results[3]["error"] and "nested more than" in results[4]["error"]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"wrote 5 results to {out}: 3 finished, 2 failed") and "'oov'" in last, proc.stdout
