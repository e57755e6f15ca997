"""Probes of the HTTP doors: a real ``python -m serve`` process on SmolLM2, and the fleet gateway
(``python -m serve fleet``) in front of a one-site fleet of the tiny model. Both read requests through
``serve.door``, and every probe runs against both.

Each probe is one of the hostile or careless inputs that once got a 500, a traceback or a stall:
JSON nested 100,000 deep, a lone UTF-16 surrogate in the text, a body cut off by a client that
leaves, a body shorter than its Content-Length, a client that sends its body a byte at a time, an
unknown path or method, a 4 MB prompt, a busy port, SIGTERM while clients stall. Then hypothesis
throws random JSON bodies at both generation endpoints. The door must answer every one with a
status below 500 and an OpenAI error body (or a completion), keep answering a normal request, and
its log must hold no traceback, start to end. Its /metrics must carry the vLLM-named series, moved
by a request, and the generated tokens per tenant.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.prom import total, vllm_values

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
HEADERS = {"content-type": "application/json"}
BODY_TIMEOUT_S = 8  # above the shutdown's wait (grace 1 s + 5 s): SIGTERM finds the stalled clients
DOOR_ARGS = ["--port", "0", "--shutdown-grace", "1", "--log-level", "info",
             "--body-timeout", str(BODY_TIMEOUT_S)]
FLEET = """
[simulation]
block_size = 16
max_num_batched_tokens = 256
max_num_seqs = 8
[[gpu_types]]
name = "L4"
memory_gb = 24
peak_tflops = 121
bandwidth_tbps = 0.3
[[models]]
name = "small-1b"
layers = 16
hidden = 2048
intermediate = 8192
heads = 32
kv_heads = 8
head_dim = 64
vocab = 128256
[[sites]]
name = "edge"
tier = "edge"
jurisdiction = "EU"
gpus = { L4 = 1 }
replicas = [{ model = "small-1b", gpu = "L4" }]
serve_model = "tiny"
[[traffic]]
name = "probe"
origins = ["edge"]
rate_per_s = 1
models = ["small-1b"]
allowed = ["EU"]
"""


class Server:
    """A door on a free port: ``python -m serve`` (``kind="server"``) or the gateway of ``python -m serve
    fleet`` over a one-site tiny fleet (``kind="gateway"``); its stderr (the log, at INFO) goes to a file."""

    def __init__(self, log: Path, kind: str = "server") -> None:
        self.kind, self.log_path = kind, log
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop())
        if kind == "server":
            self.model, self.headers = "smollm2", HEADERS
            self.cmd = [sys.executable, "-m", "serve", "--model", "smollm2", "--num-blocks", "32"]
        else:
            self.model, self.headers = "auto", {**HEADERS, "authorization": "Bearer probe"}
            scenario = log.parent / "fleet.toml"
            scenario.write_text(FLEET)
            self.cmd = [sys.executable, "-m", "serve", "fleet", str(scenario), "--workdir", str(log.parent / "work"),
                        "--num-blocks", "32"]
        # a session of its own: stop() ends the gateway's site servers with it
        self.proc = subprocess.Popen(self.cmd + DOOR_ARGS, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=ENV, cwd=ROOT, start_new_session=True)
        lines: queue.Queue = queue.Queue()  # stdout read on a thread (select would miss buffered lines)
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout] + [lines.put("")],
                         daemon=True).start()
        self.banner = ""
        while " on http://" not in self.banner or (kind == "gateway" and "gateway on" not in self.banner):
            try:
                self.banner = lines.get(timeout=180)
            except queue.Empty:
                raise AssertionError("the door did not start within 180 s:\n" + log.read_text()[-2000:]) from None
            assert self.banner, "the door exited:\n" + log.read_text()[-2000:]
        self.health_at_banner = _get_status(self.url + "/health")  # at once: no retry, no sleep
        self.port = int(self.url.rsplit(":", 1)[1])

    @property
    def url(self) -> str:
        return self.banner.split(" on ")[1].split()[0].removesuffix("/v1")

    def post(self, path: str, content: bytes | str, timeout: float = 60) -> httpx.Response:
        return httpx.post(self.url + path, content=content, headers=self.headers, timeout=timeout)

    def raw_headers(self, length: int) -> bytes:
        auth = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items() if k == "authorization")
        return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
                f"Content-Length: {length}\r\n\r\n").encode()

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        """SIGTERM (the gateway stops its sites), then SIGKILL to the whole session: no server outlives the test
        (a bare kill of the gateway left its site server running)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def _get_status(url: str) -> int:
    try:
        return httpx.get(url, timeout=10).status_code
    except httpx.HTTPError as e:
        return -1 if isinstance(e, httpx.ConnectError) else -2


@pytest.fixture(scope="module", params=["server", "gateway"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    s = Server(tmp_path_factory.mktemp(f"probe_{request.param}") / "door.log", request.param)
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
    body = f'{{"model":"{server.model}","prompt":"Hello","max_tokens":2,"ignore_eos":true}}'
    r = server.post("/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_the_banner_comes_after_the_socket_listens(server):
    assert server.health_at_banner == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_json_nested_100k_deep_gets_400(server, path):
    assert "nested" in assert_openai_error(server.post(path, "[" * 100_000), 400)["message"]
    field = f'{{"model":"{server.model}","prompt":' + "[" * 100_000 + "]" * 100_000 + "}"
    assert "nested" in assert_openai_error(server.post(path, field), 400)["message"]


def test_a_lone_surrogate_gets_400_naming_the_field(server):
    m = f'"model":"{server.model}"'
    r = server.post("/v1/completions", '{' + m + ',"prompt":"a\\ud800"}')
    assert "surrogate" in assert_openai_error(r, 400, "prompt")["message"]
    r = server.post("/v1/chat/completions", '{' + m + ',"messages":[{"role":"user","content":"a\\udfff"}]}')
    assert_openai_error(r, 400, "messages[0].content")
    r = server.post("/v1/completions", '{' + m + ',"prompt":"a","stop":"\\udc00"}')
    assert_openai_error(r, 400, "stop")
    ok = server.post("/v1/completions", '{' + m + ',"prompt":"\\ud83d\\ude00","max_tokens":1}')  # a pair
    assert ok.status_code == 200, ok.text


def test_unknown_paths_and_wrong_methods_get_openai_error_bodies(server):
    assert_openai_error(server.post("/v1/nothing", "{}"), 404)
    assert_openai_error(httpx.get(server.url + "/v1/completions"), 405)
    assert_openai_error(httpx.delete(server.url + "/health"), 405)


def test_clients_that_leave_mid_body_get_one_info_line_each(server):
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(server.raw_headers(100) + b'{"model"')
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    while server.log_text().count("went away after sending") < 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log_text()
    assert log.count("went away after sending 8 bytes") == 20, log[-2000:]
    assert "Traceback" not in log and "ClientDisconnect" not in log
    assert_still_serves(server)


def _read_answer(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            part = sock.recv(4096)
            if not part:
                break
            data += part
    except TimeoutError:
        pass
    return data


def test_a_body_shorter_than_its_content_length_gets_408(server):
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(server.raw_headers(100) + f'{{"model":"{server.model}","prompt":"Hi"}}'.encode())
        answer = _read_answer(s, BODY_TIMEOUT_S + 10)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b'"request_timeout"' in answer and time.monotonic() - started < BODY_TIMEOUT_S + 5
    assert_still_serves(server)


def test_a_client_sending_a_byte_at_a_time_gets_408_in_time(server):
    body = f'{{"model":"{server.model}","prompt":"' + "x" * 200 + '"}'
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(server.raw_headers(len(body)))
        for c in body.encode():
            try:
                s.sendall(bytes([c]))
            except OSError:  # the door answered and closed: no more bytes taken
                break
            if time.monotonic() - started > BODY_TIMEOUT_S + 1:
                break
            time.sleep(0.05)
        answer = _read_answer(s, 10)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert time.monotonic() - started < BODY_TIMEOUT_S + 5
    assert "Traceback" not in server.log_text()


def test_a_4mb_prompt_is_refused_without_tokenizing_it(server):
    m = f'"model":"{server.model}"'
    r = server.post("/v1/completions", '{' + m + ',"prompt":"' + "hello world " * 340_000 + '"}')
    err = assert_openai_error(r, 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"], err
    words = "hello world " * 6000  # 72 kB: tokenized (on a thread), then counted exactly
    r = server.post("/v1/completions", '{' + m + ',"prompt":"' + words + '"}')
    err = assert_openai_error(r, 400, "prompt")
    assert err["message"].startswith("prompt: the prompt has ") and "at least" not in err["message"], err


def test_a_busy_port_is_reported_before_the_model_loads(server):
    cmd = [sys.executable, "-m", "serve", "--model", str(ROOT / "no-such-model"), "--port", str(server.port)]
    if server.kind == "gateway":  # before any site is started
        cmd = [*server.cmd, "--port", str(server.port)]
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
    if isinstance(body, dict) and body.get("model") == "smollm2":
        body["model"] = server.model
    r = server.post("/v1/chat/completions" if chat else "/v1/completions", _dumps(body))
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code != 200:
        assert_openai_error(r, r.status_code)


def test_metrics_carry_vllm_series_that_move_and_tokens_per_tenant(server):
    page = httpx.get(server.url + "/metrics", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    served = "small-1b" if server.kind == "gateway" else "smollm2"
    before = vllm_values(page.text)
    tenant = "probe" if server.kind == "gateway" else "default"
    for stream, usage in ((False, None), (True, False), (True, True)):
        body = {"model": server.model, "prompt": "Hello there", "max_tokens": 3, "ignore_eos": True,
                "stream": stream}
        if usage:
            body["stream_options"] = {"include_usage": True}
        r = server.post("/v1/completions", _dumps(body))
        assert r.status_code == 200, r.text
        if stream:  # the gateway asks its server for the usage chunk; a client gets it if it asks
            assert ('"completion_tokens": 3' in r.text) == usage, r.text
            assert ('"usage"' in r.text) == usage and r.text.rstrip().endswith("data: [DONE]")
    text = httpx.get(server.url + "/metrics", timeout=10).text
    after = vllm_values(text)

    def moved(sample: str) -> float:
        return total(after, sample, model_name=served) - total(before, sample, model_name=served)

    assert moved("vllm:generation_tokens_total") == 9 and moved("vllm:prompt_tokens_total") >= 3
    assert moved("vllm:time_to_first_token_seconds_count") == 3
    assert moved("vllm:e2e_request_latency_seconds_count") == 3
    assert moved("vllm:inter_token_latency_seconds_count") >= 4  # the streamed ones' gaps, at least
    assert moved("vllm:request_success_total") == 3
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    for gauge in gauges:
        series = [dict(labels) for name, labels in after if name == gauge]
        assert series and all(s["model_name"] == served for s in series), (gauge, series)
        if server.kind == "gateway":  # one series per server, labelled with its site
            assert [s["site"] for s in series] == ["edge"], series
    tokens = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("unfire_generation_tokens_total{")}
    assert tokens.get(f'unfire_generation_tokens_total{{tenant="{tenant}"}}', 0) >= 9, tokens


def test_after_the_fuzzing_a_normal_request_works_and_the_log_is_clean(server):
    assert_still_serves(server)
    log = server.log_text()
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.slow  # waits out uvicorn's graceful-shutdown timeout (grace + 5 s)
def test_sigterm_with_stalled_clients_exits_0_without_tracebacks(server):
    stalled = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    for s in stalled:
        s.sendall(server.raw_headers(50) + b"{")
    time.sleep(0.3)
    server.proc.terminate()
    assert server.proc.wait(timeout=30) == 0
    for s in stalled:
        s.close()
    log = server.log_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert log.count("cancelled by the server's shutdown") == 3, log[-3000:]
