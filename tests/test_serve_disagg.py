"""The disaggregated endpoint, as a user runs it: ``python -m serve --prefill-workers 1 --decode-workers 1``
(real processes: the server and its worker processes), driven by the official ``openai`` client on SmolLM2.

Greedy chat streamed through the 1:1 disaggregated endpoint gets exactly the text (and token count) of the
colocated endpoint, with fp32 and bf16 on the wire; /metrics shows the workers, their KV bytes and handoffs,
and every block free again once the streams are done. The fault cases are in test_serve_disagg_faults.py.
"""

from __future__ import annotations

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

from tests.prom import total, vllm_values

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write one short sentence about cats.",
             "What is 2 + 2?"]
MAX_TOKENS = 16
NEW_QUESTION = "Tell me about the history of the bicycle, from the first designs to the modern racing bike."


class Server:
    """``python -m serve ...`` on a free loopback port; its stdout is drained on a thread."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 180.0,
                 launcher: list[str] | None = None) -> None:
        cmd = [*(launcher or [sys.executable]), "-m", "serve", "--port", "0", "--num-blocks", "64", *args]
        full_env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                        **(env or {}))
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def drain() -> None:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                self.lines.append(line)
                if "serving" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout) or self.proc.poll() is not None:
            self.close()
            raise AssertionError("server did not start:\n" + "".join(self.lines))
        found = re.search(r"(http://\S+)/v1", "".join(self.lines))
        assert found, self.lines
        self.base = found.group(1)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> str:
        return httpx.get(self.base + "/metrics", timeout=30).text

    def close(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError("server did not stop within 60 s of SIGTERM") from None


def stream_chat(server: Server, question: str, max_tokens: int = MAX_TOKENS,
                on_text=None) -> tuple[str, int | None, str | None]:
    """(text, completion tokens from usage, error message of an error event or None)."""
    text, tokens, error = [], None, None
    try:
        stream = server.client().chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                if on_text is not None and text[-1]:
                    on_text()
    except openai.APIError as e:  # an error event in the stream
        error = str(e)
    return "".join(text), tokens, error


def all_streams(server: Server, questions: list[str], max_tokens: int = MAX_TOKENS) -> list[tuple]:
    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(lambda q: stream_chat(server, q, max_tokens), questions))


def gauges(text: str, name: str) -> dict[tuple[str, str], float]:
    """{(node, role): value} of one per-worker metric."""
    out = {}
    for m in re.finditer(rf'^{name}{{node="(\d+)",role="(\w+)",pid="(\d+)"}} (\S+)$', text, re.M):
        out[(m.group(1), m.group(2))] = float(m.group(4))
    return out


def wait_idle(server: Server, workers: int, timeout: float = 60.0) -> str:
    """Poll /metrics until ``workers`` workers are up and every one has all its KV blocks free."""
    end = time.monotonic() + timeout
    while True:
        text = server.metrics()
        free = gauges(text, "unfire_disagg_worker_kv_blocks_free")
        total = gauges(text, "unfire_disagg_worker_kv_blocks_total")
        if len(total) == workers and free == total and "unfire_running_sequences 0" in text:
            return text
        assert time.monotonic() < end, f"not idle after {timeout} s: free {free} of {total}"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def colocated_answers():
    server = Server()
    try:
        return all_streams(server, QUESTIONS)
    finally:
        assert server.close() == 0


@pytest.mark.parametrize("wire", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_greedy_chat_through_disaggregated_endpoint_equals_colocated(colocated_answers, wire):
    server = Server("--prefill-workers", "1", "--decode-workers", "1", "--kv-wire", wire)
    try:
        got = all_streams(server, QUESTIONS)
        assert got == colocated_answers
        assert all(err is None and n for _, n, err in got)
        text = wait_idle(server, 2)
        vllm = vllm_values(text)  # the vLLM-named series routers read, as a colocated server exports them
        assert total(vllm, "vllm:generation_tokens_total", model_name="smollm2") == sum(n for _, n, _ in got)
        assert total(vllm, "vllm:time_to_first_token_seconds_count", model_name="smollm2") == len(QUESTIONS)
        assert total(vllm, "vllm:kv_cache_usage_perc") == 0 and total(vllm, "vllm:num_requests_running") == 0
        sent = gauges(text, "unfire_disagg_worker_kv_bytes_sent_total")
        received = gauges(text, "unfire_disagg_worker_kv_bytes_received_total")
        handoffs = gauges(text, "unfire_disagg_worker_handoffs_total")
        assert sum(sent.values()) == sum(received.values()) > 0
        assert sum(v for (_, role), v in handoffs.items() if role == "decode") == len(QUESTIONS)
        # a prompt seen before: the decode worker still holds its full blocks, so they are not sent again
        deltas, before = [], sum(sent.values())
        for _ in range(2):
            assert stream_chat(server, NEW_QUESTION)[2] is None
            after = sum(gauges(wait_idle(server, 2), "unfire_disagg_worker_kv_bytes_sent_total").values())
            deltas.append(after - before)
            before = after
        assert 0 < deltas[1] < deltas[0]
        sampled = [server.client().chat.completions.create(  # sampling goes through too (same seed, same text)
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0.7,
            seed=11, extra_body={"ignore_eos": True}) for _ in range(2)]
        assert sampled[0].choices[0].message.content == sampled[1].choices[0].message.content
        assert sampled[0].usage.completion_tokens == 6
        assert httpx.get(server.base + "/health", timeout=10).status_code == 200
    finally:
        assert server.close() == 0  # SIGTERM drains and stops the workers
        assert "stopped" in "".join(server.lines)


def test_bad_disaggregation_arguments_are_named():
    run = subprocess.run([sys.executable, "-m", "serve", "--prefill-workers", "1"], cwd=REPO, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert run.returncode == 2 and "--decode-workers >= 1" in run.stderr
    env = {k: v for k, v in os.environ.items() if k != "UNFIRE_DISAGG_SECRET"}
    run = subprocess.run([sys.executable, "-m", "serve", "--workers", "127.0.0.1:9"], cwd=REPO, capture_output=True,
                         text=True, env=dict(env, PYTHONPATH=str(REPO)), timeout=60)
    assert run.returncode == 2 and "UNFIRE_DISAGG_SECRET" in run.stderr
    run = subprocess.run([sys.executable, "-m", "serve", "--workers", "nohost"], cwd=REPO, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(REPO), UNFIRE_DISAGG_SECRET="00" * 32),
                         timeout=60)
    assert run.returncode == 2 and "not HOST:PORT" in run.stderr


class ListeningWorker:
    """``python -m reference.disagg worker --listen 127.0.0.1:PORT``: a worker as another host runs it."""

    def __init__(self, role: str, secret: str, port: int = 0) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", UNFIRE_DISAGG_SECRET=secret)
        self.proc = subprocess.Popen([sys.executable, "-m", "reference.disagg", "worker", "--role", role, "--model",
                                      "smollm2", "--listen", f"127.0.0.1:{port}", "--options", "num_blocks=64"],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        found = re.search(r"listening on (\S+)", line)
        assert found, line
        self.address = found.group(1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.mark.slow
def test_workers_on_other_hosts_authenticated_and_rejoining():
    secret = os.urandom(32).hex()
    prefill, decode = ListeningWorker("prefill", secret), ListeningWorker("decode", secret)
    server = None
    try:
        server = Server("--workers", f"{prefill.address},{decode.address}", env={"UNFIRE_DISAGG_SECRET": secret})
        first = stream_chat(server, QUESTIONS[0])
        assert first[2] is None and first[1]
        wait_idle(server, 2)
        decode.kill()  # the host's decode worker dies, and is started again on the same port
        decode = ListeningWorker("decode", secret, port=int(decode.address.rpartition(":")[2]))
        end = time.monotonic() + 60
        while len(gauges(server.metrics(), "unfire_disagg_worker_up")) < 2:  # the server reconnects to it
            assert time.monotonic() < end, "the restarted remote worker did not rejoin"
            time.sleep(0.25)
        assert stream_chat(server, QUESTIONS[0]) == first
    finally:
        if server is not None:
            assert server.close() == 0
        prefill.kill()
        decode.kill()


def test_worker_addresses_are_parsed_or_refused_by_name():
    from reference.disagg.pool import parse_workers

    assert parse_workers("10.0.0.2:7001, [::1]:7002,") == [("10.0.0.2", 7001), ("::1", 7002)]
    for bad in ("host", "host:", ":7001", "host:99999", "host:x"):
        with pytest.raises(ValueError, match="not HOST:PORT"):
            parse_workers(bad)


@pytest.mark.slow
def test_sigterm_drains_streams_in_flight_and_stops_the_workers():
    server = Server("--prefill-workers", "1", "--decode-workers", "1", "--shutdown-grace", "60")
    pids = [int(p) for p in re.findall(r'^unfire_disagg_worker_up{node="\d+",role="\w+",pid="(\d+)"} 1$',
                                       server.metrics(), re.M)]
    assert len(pids) == 2
    first = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream_chat, server, q, MAX_TOKENS, first.set) for q in QUESTIONS]
        assert first.wait(120)
        server.proc.send_signal(signal.SIGTERM)  # in flight: they may finish within the grace
        got = [f.result(timeout=180) for f in futures]
    assert server.close() == 0 and "stopped" in "".join(server.lines)
    assert all(err is None and n for _, n, err in got)
    for pid in pids:  # the workers said BYE and were reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
