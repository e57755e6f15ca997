"""Probes of the HTTP door, against a real ``python -m serve`` process on SmolLM2.

Each probe is one of the hostile or careless inputs that once got a 500, a traceback or a stall:
JSON nested 100,000 deep, a lone UTF-16 surrogate in the text, a body cut off by a client that
leaves, an unknown path or method, a 4 MB prompt, a busy port, SIGTERM while clients stall. Then
hypothesis throws random JSON bodies at both generation endpoints. The server must answer every
one with a status below 500 and an OpenAI error body (or a completion), keep answering a normal
request, and its log must hold no traceback, start to end.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
HEADERS = {"content-type": "application/json"}


class Server:
    """``python -m serve`` on a free port; its stderr (the log, at INFO) goes to a file."""

    def __init__(self, log: Path) -> None:
        self.log_path = log
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop())
        cmd = [sys.executable, "-m", "serve", "--model", "smollm2", "--port", "0", "--num-blocks", "32",
               "--shutdown-grace", "1", "--log-level", "info"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=ENV, cwd=ROOT)
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        assert ready, "the server did not start within 120 s"
        self.banner = self.proc.stdout.readline()
        assert "serving smollm2" in self.banner, self.banner + log.read_text()
        self.health_at_banner = _get_status(self.url + "/health")  # at once: no retry, no sleep
        self.port = int(self.url.rsplit(":", 1)[1])

    @property
    def url(self) -> str:
        return self.banner.split(" on ")[1].split()[0].removesuffix("/v1")

    def post(self, path: str, content: bytes | str, timeout: float = 60) -> httpx.Response:
        return httpx.post(self.url + path, content=content, headers=HEADERS, timeout=timeout)

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _get_status(url: str) -> int:
    try:
        return httpx.get(url, timeout=10).status_code
    except httpx.HTTPError as e:
        return -1 if isinstance(e, httpx.ConnectError) else -2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = Server(tmp_path_factory.mktemp("probe_http") / "server.log")
    yield s
    s.stop()


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_still_serves(server: Server) -> None:
    r = server.post("/v1/completions", '{"model":"smollm2","prompt":"Hello","max_tokens":2}')
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_the_banner_comes_after_the_socket_listens(server):
    assert server.health_at_banner == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_json_nested_100k_deep_gets_400(server, path):
    assert "nested" in assert_openai_error(server.post(path, "[" * 100_000), 400)["message"]
    field = '{"model":"smollm2","prompt":' + "[" * 100_000 + "]" * 100_000 + "}"
    assert "nested" in assert_openai_error(server.post(path, field), 400)["message"]


def test_a_lone_surrogate_gets_400_naming_the_field(server):
    r = server.post("/v1/completions", '{"model":"smollm2","prompt":"a\\ud800"}')
    assert "surrogate" in assert_openai_error(r, 400, "prompt")["message"]
    r = server.post("/v1/chat/completions", '{"model":"smollm2","messages":[{"role":"user","content":"a\\udfff"}]}')
    assert_openai_error(r, 400, "messages[0].content")
    r = server.post("/v1/completions", '{"model":"smollm2","prompt":"a","stop":"\\udc00"}')
    assert_openai_error(r, 400, "stop")
    ok = server.post("/v1/completions", '{"model":"smollm2","prompt":"\\ud83d\\ude00","max_tokens":1}')  # a pair
    assert ok.status_code == 200, ok.text


def test_unknown_paths_and_wrong_methods_get_openai_error_bodies(server):
    assert_openai_error(server.post("/v1/nothing", "{}"), 404)
    assert_openai_error(httpx.get(server.url + "/v1/completions"), 405)
    assert_openai_error(httpx.delete(server.url + "/health"), 405)


def test_clients_that_leave_mid_body_get_one_info_line_each(server):
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\"")
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    while server.log_text().count("went away after sending") < 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log_text()
    assert log.count("went away after sending 8 bytes") == 20, log[-2000:]
    assert "Traceback" not in log and "ClientDisconnect" not in log
    assert_still_serves(server)


def test_a_4mb_prompt_is_refused_without_tokenizing_it(server):
    r = server.post("/v1/completions", '{"model":"smollm2","prompt":"' + "hello world " * 340_000 + '"}')
    err = assert_openai_error(r, 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"], err
    words = "hello world " * 6000  # 72 kB: tokenized (on a thread), then counted exactly
    r = server.post("/v1/completions", '{"model":"smollm2","prompt":"' + words + '"}')
    err = assert_openai_error(r, 400, "prompt")
    assert err["message"].startswith("prompt: the prompt has ") and "at least" not in err["message"], err


def test_a_busy_port_is_reported_before_the_model_loads(server):
    cmd = [sys.executable, "-m", "serve", "--model", str(ROOT / "no-such-model"), "--port", str(server.port)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"cannot listen on 127.0.0.1:{server.port}" in out.stderr, out.stderr


KEYS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
        "stream_options", "ignore_eos", "n", "logprobs", "max_completion_tokens", "user"]
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
           | st.text(max_size=12) | st.sampled_from(["smollm2", "user", "assistant", "\ud800", "text"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(KEYS + ["role", "content", "type", "text"]), inner,
                                        max_size=4), max_leaves=12)
bodies = st.dictionaries(st.sampled_from(KEYS), values, max_size=8).map(lambda d: {"model": "smollm2", **d}) | values


def _dumps(body: object) -> str:
    import json

    return json.dumps(body)  # NaN and Infinity as JSON spells them in JavaScript; surrogates escaped


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, chat=st.booleans())
def test_random_json_bodies_never_get_a_500(server, body, chat):
    if isinstance(body, dict) and body.get("max_tokens") is None and "max_completion_tokens" not in body:
        body["max_tokens"] = 2  # keep valid requests short
    r = server.post("/v1/chat/completions" if chat else "/v1/completions", _dumps(body))
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code != 200:
        assert_openai_error(r, r.status_code)


def test_after_the_fuzzing_a_normal_request_works_and_the_log_is_clean(server):
    assert_still_serves(server)
    log = server.log_text()
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.slow  # waits out uvicorn's graceful-shutdown timeout (grace + 5 s)
def test_sigterm_with_stalled_clients_exits_0_without_tracebacks(server):
    stalled = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    for s in stalled:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
    time.sleep(0.3)
    server.proc.terminate()
    assert server.proc.wait(timeout=30) == 0
    for s in stalled:
        s.close()
    log = server.log_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert log.count("cancelled by the server's shutdown") == 3, log[-3000:]
