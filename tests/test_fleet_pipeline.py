"""A pipelined fleet site: ``pipeline = [GPU, GPU, ...]`` in a site of the scenario runs each of its
servers as ``python -m serve --pipeline CHAIN`` (stage processes, split by ``best_split``), started
by ``python -m serve fleet``. Checked on real processes: through the gateway, greedy answers of the
pipelined site equal a colocated site's (the same tiny weights), streamed and not; the chain follows
the placement model (a slower GPU's stage is declared slower, and the split gives it fewer layers);
bad pipelines are named.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from reference.cluster.scenario import ScenarioError, scenario_from_dict
from serve.fleet.sites import FleetError, pipeline_chain, plan_workers

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent
SCENARIO = """
[simulation]
block_size = 16
max_num_batched_tokens = 256
max_num_seqs = 8
[[gpu_types]]
name = "L4"
memory_gb = 24
peak_tflops = 121
bandwidth_tbps = 0.3
[[gpu_types]]
name = "H100"
memory_gb = 80
peak_tflops = 989
bandwidth_tbps = 3.35
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
name = "colocated"
tier = "edge"
jurisdiction = "A"
gpus = { L4 = 1 }
replicas = [{ model = "small-1b", gpu = "L4" }]
[[sites]]
name = "piped"
tier = "edge"
jurisdiction = "B"
gpus = { L4 = 2 }
replicas = [{ model = "small-1b", gpu = "L4" }]
pipeline = ["L4", "L4"]
[[traffic]]
name = "a"
origins = ["colocated"]
rate_per_s = 1
models = ["small-1b"]
allowed = ["A"]
[[traffic]]
name = "b"
origins = ["piped"]
rate_per_s = 1
models = ["small-1b"]
allowed = ["B"]
"""
PROMPTS = ["Where is Paris?", "Once upon a time", "The three primary colours are"]


def scenario_data() -> dict:
    import tomllib

    return tomllib.loads(SCENARIO)


def test_the_chain_follows_the_placement_and_best_split_gives_the_slow_stage_fewer_layers() -> None:
    from fast.pipeline.chain import parse_chain, plan
    from reference.model.config import LlamaConfig

    data = scenario_data()
    data["sites"][1].update(gpus={"H100": 1, "L4": 1}, pipeline=["H100", "L4"])
    s = scenario_from_dict(data)
    chain = pipeline_chain(s, s.sites["piped"])
    fast_node, slow_node = parse_chain(chain)
    # decode micro-batches are bandwidth-bound: the L4 stage is slower by the bandwidth ratio
    assert fast_node.slowdown == 1
    assert slow_node.slowdown == pytest.approx((3.35 * 0.8) / (0.3 * 0.8), rel=0.01)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=30,
                         num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         rope_theta=1e4, max_position=2048, tie_embeddings=True)
    layers = plan(config, [fast_node, slow_node], calibration=(1e-3, 1e-3)).split.layers
    assert layers[0] > layers[1] >= 1 and sum(layers) == 30
    assert [w.pipeline for w in plan_workers(s)] == ["", chain]


def test_bad_pipelines_are_named() -> None:
    for bad, needle in [(["L4"], "2 to 16"), ("L4", "pipeline: expected a"),
                        (["H100", "L4"], "'H100' is not a GPU type of the site")]:
        data = scenario_data()
        data["sites"][1]["pipeline"] = bad
        with pytest.raises(ScenarioError, match=needle):
            scenario_from_dict(data)
    data = scenario_data()
    data["sites"][1]["replicas"] = [{"model": "small-1b", "gpu": "L4", "role": "prefill"},
                                    {"model": "small-1b", "gpu": "L4", "role": "decode"}]
    with pytest.raises(FleetError, match="pipeline with prefill/decode replicas"):
        plan_workers(scenario_from_dict(data))
    assert plan_workers(scenario_from_dict(data), colocate=True)[1].pipeline == "cpu:1,cpu:1"


def answers(url: str, tenant: str) -> list[tuple[str, int]]:
    c = openai.OpenAI(base_url=url + "/v1", api_key=tenant, max_retries=0, timeout=120)
    out = []
    for prompt in PROMPTS:
        r = c.completions.create(model="auto", prompt=prompt, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
        out.append((r.choices[0].text, r.usage.completion_tokens))
        chunks = c.completions.create(model="auto", prompt=prompt, max_tokens=12, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        out.append(("".join(ch.choices[0].text for ch in chunks if ch.choices), -1))
    return out


def test_a_pipelined_site_answers_as_a_colocated_one_through_the_gateway(tmp_path: Path) -> None:
    scenario = tmp_path / "fleet.toml"
    scenario.write_text(SCENARIO)
    trace = tmp_path / "trace.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "serve", "fleet", str(scenario), "--port", "0",
           "--workdir", str(tmp_path / "w"), "--num-blocks", "64", "--trace", str(trace)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    lines: list[str] = []
    started = threading.Event()

    def drain() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "gateway on" in line:
                started.set()
        started.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert started.wait(300) and proc.poll() is None, "".join(lines)
        out = "".join(lines)
        assert re.search(r"piped .*pipeline cpu:1,cpu:1\) at http://", out), out
        url = "http://" + re.search(r"gateway on http://(\S+)/v1", out).group(1)
        colocated, piped = answers(url, "a"), answers(url, "b")
        assert piped == colocated and all(text for text, _ in colocated)
        assert all(n == 12 for _, n in colocated if n >= 0)
        servers = httpx.get(url + "/fleet", timeout=10).json()["servers"]
        assert [(s["site"], s["pipeline"]) for s in servers] == [("colocated", None),
                                                                  ("piped", "cpu:1,cpu:1")]
        records = [json.loads(line) for line in trace.read_text().splitlines()]
        sites = {(r["tenant"], r["prefill_site"]) for r in records}
        assert sites == {("a", "colocated"), ("b", "piped")}
        assert all(r["outcome"] == "done" for r in records) and len(records) == 4 * len(PROMPTS)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(60) == 0, "".join(lines)[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
