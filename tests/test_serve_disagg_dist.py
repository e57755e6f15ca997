"""The disaggregated endpoint under torchrun (``serve/disagg_dist.py``): three real processes on localhost,
rank 0 the OpenAI-compatible server, rank 1 a prefill worker, rank 2 a decode worker, linked by
torch.distributed (gloo) instead of TCP sockets. Greedy chat streamed with the ``openai`` client gets exactly
the colocated endpoint's text and token counts; /metrics shows both ranks' handoffs and every block free
afterwards; SIGTERM to torchrun stops every rank. A decode rank killed (SIGKILL) during 8 streams: every stream
ends in time, whole or with an error event, and torchrun's teardown of the group leaves no rank behind."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest

pytest.importorskip("torch.distributed")
from tests.test_serve_disagg import QUESTIONS, Server, all_streams, gauges, wait_idle  # noqa: E402
from tests.test_serve_disagg_faults import BOUND_S, pid_of, run_streams  # noqa: E402

SECRET = {"UNFIRE_DISAGG_SECRET": "5e" * 32}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port())]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_torchrun_endpoint_streams_the_colocated_tokens():
    colocated = Server("--engine", "reference")  # the torchrun ranks run the reference runner
    try:
        want = all_streams(colocated, QUESTIONS)
    finally:
        assert colocated.close() == 0
    server = Server("--dist-workers", "1", launcher=torchrun(3), env=SECRET, timeout=300)
    try:
        assert "1 prefill + 1 decode workers" in "".join(server.lines)
        got = all_streams(server, QUESTIONS)
        assert got == want
        assert all(err is None and n for _, n, err in got)
        text = wait_idle(server, 2)
        handoffs = gauges(text, "unfire_disagg_worker_handoffs_total")
        assert handoffs[("1", "prefill")] >= len(QUESTIONS) and handoffs[("2", "decode")] >= len(QUESTIONS)
        assert gauges(text, "unfire_disagg_worker_kv_bytes_received_total")[("2", "decode")] > 0
        pids = [int(line.split('pid="')[1].split('"')[0]) for line in text.splitlines()
                if line.startswith("unfire_disagg_worker_up{")]
        assert len(pids) == 2
    finally:
        server.close()
    assert any(line.strip() == "stopped" for line in server.lines), "".join(server.lines)
    end = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "a worker rank outlived the server"


def worker_pids(server: Server) -> list[int]:
    return [int(line.split('pid="')[1].split('"')[0]) for line in server.metrics().splitlines()
            if line.startswith("unfire_disagg_worker_up{")]


@pytest.mark.slow
def test_a_dead_decode_rank_ends_every_stream_and_the_group():
    server = Server("--dist-workers", "1", "--max-num-seqs", "8", launcher=torchrun(3), env=SECRET, timeout=300)
    try:
        pids = worker_pids(server)
        got, seconds = run_streams(server, lambda: os.kill(pid_of(server, "decode"), signal.SIGKILL))
        assert max(seconds) < BOUND_S
        assert all(error is not None or tokens for _, tokens, error in got)
        errors = [error for _, _, error in got if error is not None]
        assert errors, "the killed decode rank held streams: they end with an error event"
        code = server.proc.wait(120)  # torchrun stops the rest of the group by itself
        assert code != 0
    finally:
        server.close()
    assert any(line.strip() == "stopped" for line in server.lines), "".join(server.lines)
    assert not any(alive(p) for p in pids), "a rank outlived the group"


@pytest.mark.parametrize("argv, env, message", [
    (["--dist-workers", "1"], {}, "runs under torchrun"),
    (["--dist-workers", "2"], {"RANK": "0", "WORLD_SIZE": "3"}, "1 <= P <= WORLD_SIZE - 2"),
    (["--dist-workers", "1"], {"RANK": "0", "WORLD_SIZE": "3", "UNFIRE_DISAGG_SECRET": "xyz"}, "shared secret"),
    (["--dist-workers", "1", "--prefill-workers", "1", "--decode-workers", "1"], {"RANK": "0", "WORLD_SIZE": "3"},
     "does not combine"),
])
def test_bad_dist_arguments_are_named(monkeypatch, capsys, argv, env, message):
    from serve.__main__ import parse_args

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("UNFIRE_DISAGG_SECRET", "ab" * 32)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
