"""Pipeline faults at the endpoint, with real processes: ``python -m serve --pipeline 2`` on the tiny
checkpoint, four concurrent streams (greedy and seeded sampling), and a stage process SIGKILLed, then
another SIGSTOPped (hung: found at ``--pipeline-step-timeout``), each right after the streams' first
tokens. The stages are restarted and every request recomputed from its prompt plus the tokens already
streamed (``fast/pipeline/restart.py``): each stream ends normally with exactly the text and token count
of the same requests on the same server before any fault (no token twice, none missing).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")

from tests.test_serve_disagg import Server  # noqa: E402
from tests.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

QUESTIONS = ["Hello, tiny model!", "Say something.", "What is 2 + 2?", "Name three colours."]
MAX_TOKENS = 120


def stage_pids(server: Server) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(server.proc.pid)], capture_output=True,
                         text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "fast.pipeline.stage" in line]


def streams(server: Server, on_first=None) -> list[tuple[str, int | None, str | None]]:
    """The four answers, streamed at once (odd ones sampled with a seed); ``on_first()`` after the first
    text arrives on any stream."""
    first = threading.Event()
    fired = threading.Lock()

    def one(i: int) -> tuple[str, int | None, str | None]:
        sampling = {"temperature": 0.8, "seed": 7 + i} if i % 2 else {"temperature": 0}
        text, tokens, error = [], None, None
        try:
            for chunk in server.client().chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": QUESTIONS[i]}], max_tokens=MAX_TOKENS,
                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                    **sampling):
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                    if on_first is not None and not first.is_set() and fired.acquire(blocking=False):
                        on_first()
                        first.set()
        except openai.APIError as e:
            error = str(e)
        return "".join(text), tokens, error

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(one, range(len(QUESTIONS))))


def test_a_killed_and_a_hung_stage_are_restarted_and_the_streams_go_on(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "ckpt")
    server = Server("--model", str(folder), "--served-model-name", "smollm2", "--pipeline", "2",
                    "--num-blocks", "256", "--pipeline-step-timeout", "3")
    try:
        want = streams(server)
        assert all(error is None and tokens == MAX_TOKENS for _, tokens, error in want), want
        killed = stage_pids(server)
        assert len(killed) == 1
        assert streams(server, lambda: os.kill(killed[0], signal.SIGKILL)) == want
        hung = stage_pids(server)
        assert len(hung) == 1 and hung != killed  # a new stage process
        assert streams(server, lambda: os.kill(hung[0], signal.SIGSTOP)) == want
        assert len(stage_pids(server)) == 1 and stage_pids(server) != hung
        assert httpx.get(server.base + "/health", timeout=10).status_code == 200
        assert "unfire_pipeline_restarts_total 2" in httpx.get(server.base + "/metrics", timeout=10).text
    finally:
        assert server.close() == 0
    assert not stage_pids(server)
