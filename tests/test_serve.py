"""The real server on a free port, driven by the official ``openai`` client, on SmolLM2.

The server runs with uvicorn on a thread of this process, so that the tests can look at the engine's
block manager (on the engine's own thread, between steps) after a client disconnects. SIGTERM is
tested on a real subprocess.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from reference.engine import Engine, SamplingParams  # noqa: E402
from reference.kv import check_block_manager  # noqa: E402
from serve.app import create_app  # noqa: E402
from serve.engine_thread import EngineThread  # noqa: E402
from serve.keys import KeyTable  # noqa: E402
from tests.smollm import smollm2_model, smollm2_tokenizer  # noqa: E402

KEY, OTHER_KEY = "sk-test-acme", "sk-test-bob"
KEYS = {"keys": {KEY: {"tenant": "acme", "plan": "paid"}, OTHER_KEY: {"tenant": "bob", "plan": "free"}}}
ENGINE_OPTS = dict(num_blocks=64, block_size=16, max_num_seqs=32, max_num_batched_tokens=256)
QUESTION = "What is the capital of France?"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Served:
    def __init__(self) -> None:
        keys = KeyTable.from_dict(KEYS)
        engine = Engine(smollm2_model(), smollm2_tokenizer(), policy="sjf+wfq", tenants=keys.tenants, **ENGINE_OPTS)
        self.worker = EngineThread(engine)
        self.worker.start()
        self.app = create_app(self.worker, smollm2_tokenizer(), model_name="smollm2", keys=keys, max_pending=64)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def on_engine(self, fn):
        return self.worker.call(fn).result(timeout=30)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.worker.stop()


@pytest.fixture(scope="module")
def served():
    s = Served()
    yield s
    s.close()


def generate(prompts: list, max_tokens: int) -> list[str]:
    """The engine's own answer, in-process, with no server in between."""
    engine = Engine(smollm2_model(), smollm2_tokenizer(), **ENGINE_OPTS)
    return [o.text for o in engine.generate(prompts, SamplingParams(max_tokens=max_tokens))]


def chat_prompt(q: str) -> str:
    return smollm2_tokenizer().apply_chat_template([{"role": "user", "content": q}])


def test_greedy_chat_equals_engine_generate_streamed_and_not(served):
    expected = generate([chat_prompt(QUESTION), "Once upon a time"], 12)
    client = served.client()
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == expected[0] and "Paris" in expected[0]
    assert whole.choices[0].finish_reason == "stop" and whole.usage.completion_tokens > 0
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected[0] and len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    plain = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12)
    assert plain.choices[0].text == expected[1] and plain.choices[0].finish_reason == "length"
    pieces = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == expected[1]


def test_32_concurrent_streams_all_complete(served):
    questions = [f"What is {i} plus {i + 1}?" for i in range(32)]
    client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)

    async def one(q: str) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}],
                                                      max_tokens=4, stream=True,
                                                      stream_options={"include_usage": True})
        text, reason, usage = [], None, None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return "".join(text), reason, usage.completion_tokens

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(q) for q in questions))
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    assert len(results) == 32
    for text, reason, tokens in results:
        assert text and (reason, tokens) == ("length", 4) or (reason == "stop" and 1 <= tokens <= 4)
    assert results[0][0] == generate([chat_prompt(questions[0])], 4)[0]  # batched 32-wide, still the same text


def test_wrong_or_missing_key_gets_401(served):
    with pytest.raises(openai.AuthenticationError) as e:
        served.client("sk-wrong").chat.completions.create(model="smollm2", max_tokens=2,
                                                          messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.post(served.url + "/v1/completions", json={"model": "smollm2", "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(served.url + "/v1/models").status_code == 401
    assert [m.id for m in served.client(OTHER_KEY).models.list().data] == ["smollm2"]


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 0), ("max_tokens", 0), ("n", 0),
                                          ("seed", -5), ("stop", ["a", "b", "c", "d", "e"])])
def test_invalid_parameters_get_400_naming_the_field(served, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                                **{field: value})
    assert e.value.status_code == 400 and e.value.param == field and field in str(e.value)


def test_too_long_prompt_unknown_model_bad_json(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client().completions.create(model="smollm2", prompt="word " * 1100, max_tokens=2)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt" and "1024" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        served.client().completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    r = httpx.post(served.url + "/v1/chat/completions", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/completions", content=b" " * (4 << 20) + b"{}", headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_stop_strings_and_seeded_sampling(served):
    client = served.client()
    messages = [{"role": "user", "content": QUESTION}]
    out = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, stop=["Paris"])
    assert out.choices[0].message.content == "The capital of France is " and out.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, stop=" Paris",
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "The capital of France is"
    sampled = [client.completions.create(model="smollm2", prompt="My favourite food", max_tokens=6,
                                         temperature=0.9, seed=11).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_tenants_do_not_share_prefix_cache_blocks(served):
    """Each key's tenant salts its prefix cache: the same prompt hits only the same tenant's blocks."""
    prompt = "You are a careful assistant who answers every question in one short sentence. " * 3
    hits = []
    for key in (KEY, OTHER_KEY, KEY):
        before = served.on_engine(lambda e: e.block_manager.num_hit_tokens)
        served.client(key).completions.create(model="smollm2", prompt=prompt, max_tokens=1)
        hits.append(served.on_engine(lambda e: e.block_manager.num_hit_tokens) - before)
    assert hits[1] == 0 and hits[2] >= 32, hits  # bob misses acme's blocks; acme hits its own


def test_queue_full_gets_503_with_retry_after(served):
    state = served.app.state.serve
    state.max_pending = 0
    try:
        r = httpx.post(served.url + "/v1/completions", json={"model": "smollm2", "prompt": "hi"}, headers=AUTH)
    finally:
        state.max_pending = 64
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"


def _engine_idle_and_audited(served) -> None:
    def audit(engine):
        if engine.has_unfinished():
            return False
        check_block_manager(engine.block_manager, [])  # every ref count 0: no block left allocated
        return True

    deadline = time.monotonic() + 20
    while not served.on_engine(audit):
        assert time.monotonic() < deadline, "the aborted request is still running"
        time.sleep(0.05)
    assert served.worker.stats.kv_blocks_used == 0 and served.worker.stats.running == 0


def test_disconnect_mid_stream_frees_every_block(served):
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, headers=AUTH) as r:
        # Read three events through one iterator that stays referenced: breaking out of a ``for`` over
        # ``r.iter_lines()`` would drop the generator, and closing it closes httpx's connection, i.e. the
        # client would already have left (the server then aborts the request, as it should).
        lines, got = r.iter_lines(), []
        while len(got) < 3:
            line = next(lines)
            if line.startswith("data:"):
                got.append(json.loads(line[5:]))
        # the request holds blocks while it streams (polled: under load a step may have preempted it, which
        # frees its blocks until it is scheduled again)
        deadline = time.monotonic() + 10
        while (used := served.on_engine(lambda e: sum(1 for c in e.block_manager.ref_count if c > 0))) == 0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert used > 0
    _engine_idle_and_audited(served)  # leaving the block closed the connection mid-stream
    # a whole (non-streamed) completion whose client leaves while it runs is aborted too
    payload = json.dumps({**body, "stream": False}).encode()
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + 20
        while not served.on_engine(lambda e: e.has_unfinished()):  # wait until the engine runs it
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)
    _engine_idle_and_audited(served)


def test_metrics_report_latency_queue_blocks_and_tenant_tokens(served):
    served.client(OTHER_KEY).completions.create(model="smollm2", prompt="Hello", max_tokens=3)
    values = {}
    for line in httpx.get(served.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["unfire_time_to_first_token_seconds_count"] >= 1
    assert values['unfire_inter_token_latency_seconds_bucket{le="+Inf"}'] >= 2
    assert values['unfire_generation_tokens_total{tenant="bob"}'] >= 3
    assert values['unfire_prompt_tokens_total{tenant="bob"}'] >= 1
    assert values["unfire_kv_blocks_total"] == 64 and values["unfire_kv_blocks_used"] == 0
    for name in ("unfire_queue_depth", "unfire_running_sequences", "unfire_prefix_cache_hit_rate"):
        assert name in values
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}


@pytest.fixture(scope="module", autouse=True)
def server_process():
    """A real server process for the SIGTERM test, started first so that it loads while the others run."""
    cmd = [sys.executable, "-m", "serve", "--model", "smollm2", "--engine", "reference", "--port", "0",
           "--num-blocks", "32", "--shutdown-grace", "1", "--log-level", "error",
           "--max-prefill-tokens-with-decodes", "16",  # the step cap, taken by a real server process
           "--burst-gather-ms", "6000", "--burst-gather-gap-ms", "2000"]  # and the burst gathering
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_sigterm_drains_and_exits_cleanly(server_process):
    """SIGTERM while a long stream runs: the stream ends with an error event, the process exits 0
    soon after the grace period, and nothing is left listening."""
    proc = server_process
    ready, _, _ = select.select([proc.stdout], [], [], 90)
    assert ready, "the server did not start within 90 s"
    line = proc.stdout.readline()
    assert "serving smollm2" in line, line + proc.stderr.read()
    url = line.split(" on ")[1].split()[0]
    # --burst-gather-ms: a request 0.3 s after another (within the 2 s gap) joins the idle engine's first step
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(httpx.post, url + "/completions", json={"model": "smollm2", "prompt": "Hi",
                                                                     "max_tokens": 2}, timeout=60)
        time.sleep(0.3)
        second = httpx.post(url + "/completions", json={"model": "smollm2", "prompt": "Yo", "max_tokens": 2},
                            timeout=60)
        assert first.result().status_code == 200 and second.status_code == 200
    metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
    assert "unfire_burst_gathered_requests_total 1" in metrics, metrics
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 800, "ignore_eos": True,
            "stream": True}
    events, sent = [], None
    with httpx.stream("POST", url + "/completions", json=body, timeout=30) as r:
        for text in r.iter_lines():
            if text.startswith("data:"):
                events.append(text[5:].strip())
            if len(events) == 2 and sent is None:
                proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
    took = time.monotonic() - sent
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    assert took < 10, f"the stream took {took:.1f} s to end after SIGTERM (grace 1 s)"
    assert proc.wait(timeout=15) == 0
    err = proc.stderr.read()
    assert "Traceback" not in err, err
    with pytest.raises(httpx.ConnectError):
        httpx.get(url.removesuffix("/v1") + "/health")


def test_load_generator_measures_our_server(served):
    from serve.bench import BenchConfig, run_bench

    prompts = ["Tell me about cats.", "What is rain?", "Name three colours."]
    cfg = BenchConfig(url=served.url, api_key=KEY, num_prompts=3, burst=True, max_tokens=3, ignore_eos=True,
                      slo_ttft_ms=60_000, slo_tpot_ms=60_000)
    result = asyncio.run(run_bench(cfg, prompts))
    s = result["summary"]
    assert (s["completed"], s["failed"], s["output_tokens"]) == (3, 0, 9)
    assert result["config"]["model"] == "smollm2" and result["config"]["api_key"] is None
    assert s["goodput_rps"] == s["request_throughput_rps"] > 0 and s["ttft_ms"]["p50"] > 0
    assert len(result["requests"][0]["itl"]) == 2 and s["itl_ms"]["p99"] >= s["itl_ms"]["p50"] > 0
    bad = asyncio.run(run_bench(BenchConfig(url=served.url, api_key="sk-wrong", model="smollm2", max_tokens=2),
                                prompts[:1]))
    assert bad["summary"]["failed"] == 1 and "HTTP 401" in bad["summary"]["errors"][0]
