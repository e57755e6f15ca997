"""The disaggregated endpoint on the fast engine's runner, as a user runs it: ``python -m serve --model M
--prefill-workers 1 --decode-workers 1`` (real processes: the server and its ``python -m fast.disagg.worker``
processes), driven by the official ``openai`` client, on the tiny Hugging Face checkpoint and on its Unweight
container (``python -m reference.codec compress``) served with ``--compressed``.

Streaming greedy chat through the 1:1 endpoint gets exactly the tokens of the colocated fast endpoint, with
fp32 and bf16 on the wire, plain and compressed weights alike, and every handoff continues from the KV it was
sent (no recompute). Tenants (``--api-keys``) keep their own prefix caches on the workers. SmolLM2 goes the
same way in ``test_serve_disagg.py`` (its workers are fast ones too, by default).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")

from tests.test_serve_disagg import REPO, Server, gauges, wait_idle  # noqa: E402
from tests.tiny_checkpoint import tiny_checkpoint_and_container  # noqa: E402

QUESTIONS = ["Hello, tiny model!", "Say something.", "What is 2 + 2?"]
MAX_TOKENS = 12
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return tiny_checkpoint_and_container(tmp_path_factory.mktemp("fastdisagg"), ENV)


def serve(model: Path, *args: str) -> Server:
    return Server("--model", str(model), "--served-model-name", "smollm2", "--engine", "fast", *args)


def chat(server: Server, question: str, key: str = "none") -> tuple[str, int | None]:
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0, timeout=120)
    text, tokens = [], None
    for chunk in client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                                max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
    return "".join(text), tokens


@pytest.fixture(scope="module")
def colocated(models) -> list[tuple[str, int | None]]:
    """The colocated fast endpoint's answers on the checkpoint (its container answers alike, colocated:
    ``test_compressed_model.py``)."""
    server = serve(models["plain"])
    try:
        answers = [chat(server, q) for q in QUESTIONS]
    finally:
        assert server.close() == 0
    assert all(n == MAX_TOKENS for _, n in answers)
    return answers


@pytest.mark.parametrize("weights,wire", [
    pytest.param("plain", "fp32", marks=pytest.mark.slow), pytest.param("plain", "bf16", marks=pytest.mark.slow),
    pytest.param("compressed", "fp32", marks=pytest.mark.slow), ("compressed", "bf16")])
def test_disaggregated_fast_workers_stream_the_colocated_tokens(models, colocated, weights, wire):
    extra = ("--compressed",) if weights == "compressed" else ()
    server = serve(models[weights], *extra, "--prefill-workers", "1", "--decode-workers", "1", "--kv-wire", wire)
    try:
        assert "on the fast runner" in "".join(server.lines)
        assert [chat(server, q) for q in QUESTIONS] == colocated
        text = wait_idle(server, 2)
        handoffs = gauges(text, "unfire_disagg_worker_handoffs_total")
        recomputes = gauges(text, "unfire_disagg_worker_recomputes_total")
        assert sum(v for (_, role), v in handoffs.items() if role == "decode") == len(QUESTIONS)
        assert sum(recomputes.values()) == 0  # every stream continued from the KV the prefill worker sent
        assert sum(gauges(text, "unfire_disagg_worker_kv_bytes_received_total").values()) > 0
    finally:
        assert server.close() == 0


@pytest.mark.slow
def test_tenants_keep_their_own_prefix_caches_on_the_workers(models, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys]\n"sk-a" = { tenant = "acme", plan = "paid" }\n"sk-b" = { tenant = "bob", plan = "free" }\n')
    server = serve(models["plain"], "--api-keys", str(keys), "--prefill-workers", "1", "--decode-workers", "1")
    question = "Tell me about the history of the bicycle, from the first designs to the modern racing bike."
    try:
        sent = []
        for key in ("sk-a", "sk-a", "sk-b"):
            before = sum(gauges(wait_idle(server, 2), "unfire_disagg_worker_kv_bytes_sent_total").values())
            chat(server, question, key)
            after = sum(gauges(wait_idle(server, 2), "unfire_disagg_worker_kv_bytes_sent_total").values())
            sent.append(after - before)
        # acme again: its blocks are cached on the decode worker, not sent; bob: another salt, no hit
        assert 0 < sent[1] < sent[0] and sent[2] == sent[0], sent
    finally:
        assert server.close() == 0


def test_compressed_workers_need_the_fast_runner():
    run = subprocess.run([sys.executable, "-m", "serve", "--port", "0", "--engine", "reference", "--compressed",
                          "--prefill-workers", "1", "--decode-workers", "1"], capture_output=True, text=True, env=ENV,
                         timeout=60)
    assert run.returncode == 2 and "--compressed qkv,o,gate_up,down needs the fast engine" in run.stderr


def test_reference_worker_command_points_to_the_fast_one():
    run = subprocess.run([sys.executable, "-m", "reference.disagg", "worker", "--role", "decode", "--model", "tiny",
                          "--engine", "fast", "--listen", "127.0.0.1:0"], capture_output=True, text=True, env=ENV,
                         timeout=60)
    assert run.returncode == 2 and "python -m fast.disagg.worker" in run.stderr


@pytest.mark.slow
def test_fast_workers_started_by_hand_serve_a_container(models, colocated):
    secret = os.urandom(32).hex()
    env = dict(ENV, UNFIRE_DISAGG_SECRET=secret)
    procs, addresses = [], []
    server = None
    try:
        for role in ("prefill", "decode"):
            proc = subprocess.Popen([sys.executable, "-m", "fast.disagg.worker", "--role", role, "--model",
                                     str(models["compressed"]), "--compressed", "--listen", "127.0.0.1:0",
                                     "--options", "num_blocks=64"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    text=True)
            procs.append(proc)
            line = proc.stdout.readline()  # type: ignore[union-attr]
            found = re.search(r"listening on (\S+)", line)
            assert found, line
            addresses.append(found.group(1))
        server = Server("--model", str(models["compressed"]), "--served-model-name", "smollm2", "--workers",
                        ",".join(addresses), env={"UNFIRE_DISAGG_SECRET": secret})
        assert [chat(server, q) for q in QUESTIONS] == colocated
        assert sum(gauges(wait_idle(server, 2), "unfire_disagg_worker_recomputes_total").values()) == 0
    finally:
        if server is not None:
            assert server.close() == 0
        for proc in procs:
            proc.kill()
            proc.wait(10)
