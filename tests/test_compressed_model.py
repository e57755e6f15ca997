"""Compressed checkpoints as models: a container written by ``python -m reference.codec compress`` loads
and serves as the checkpoint it came from (FORMAT.md section 6.2).

The tiny Hugging Face checkpoint (``tests/tiny_checkpoint.py``) runs every path in seconds, up to a real
``python -m serve --model FILE`` process driven by the ``openai`` client, plain and compressed; the
packaged SmolLM2 GGUF goes the same way in the slow test at the end.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reference.bf16 import bf16_to_float32, float32_to_bf16
from reference.codec import CodecError, Container, compress_checkpoint
from reference.model.carried import MODEL_KEY, ContainerFile
from reference.model.config import ConfigError
from reference.model.errors import WeightError
from reference.model.loader import load_llama
from reference.model.safetensors_io import SafetensorsFile, write_safetensors
from reference.model.tokenizer import load_tokenizer
from reference.model.weights import open_weights
from tests.tiny_checkpoint import write_tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
MESSAGES = [{"role": "user", "content": "Hello, tiny model!"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny checkpoint and its containers in both modes, written by the reference CLI."""
    root = tmp_path_factory.mktemp("tiny")
    folder = write_tiny_checkpoint(root / "ckpt")
    out = {"folder": folder}
    for mode in ("unweight", "rans"):
        out[mode] = root / f"tiny.{mode}.safetensors"
        cmd = [sys.executable, "-m", "reference.codec", "compress", str(folder), str(out[mode]), "--mode", mode,
               "--min-elements", "1024"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
        assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("mode", ["unweight", "rans"])
def test_container_loads_as_the_checkpoint_it_came_from(tiny, mode):
    cfg0, w0 = load_llama(tiny["folder"])
    cfg, w = load_llama(tiny[mode])
    assert cfg == cfg0
    for a, b in [(w.embedding, w0.embedding), (w.final_norm, w0.final_norm)] + [
            (getattr(x, f), getattr(y, f)) for x, y in zip(w.layers, w0.layers, strict=True)
            for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "attn_norm", "mlp_norm")]:
        assert np.array_equal(a, b)
    tok0, tok = load_tokenizer(tiny["folder"]), load_tokenizer(tiny[mode])
    assert tok.encode_chat(MESSAGES) == tok0.encode_chat(MESSAGES)
    assert (tok.eos_token_ids, tok.chat_template) == (tok0.eos_token_ids, tok0.chat_template)
    src = open_weights(tiny[mode])
    assert isinstance(src.files[0], ContainerFile) and src.dtype("model.layers.0.self_attn.q_proj.weight") == "BF16"
    with Container(tiny[mode]) as c:
        assert c.is_compressed("model.layers.0.self_attn.o_proj.weight")
        assert not c.is_compressed("model.norm.weight")


def test_greedy_tokens_of_the_reference_engine_equal(tiny):
    from reference.engine import Engine, SamplingParams
    from reference.model.llama import LlamaModel

    tok = load_tokenizer(tiny["folder"])
    prompt = tok.encode_chat(MESSAGES)
    runs = [Engine(LlamaModel.load(src), num_blocks=32).generate([prompt], SamplingParams(max_tokens=12))[0]
            for src in (tiny["folder"], tiny["unweight"], tiny["rans"])]
    assert runs[0].output_token_ids and all(r.output_token_ids == runs[0].output_token_ids for r in runs)


def _rewrite(src: Path, dst: Path, change) -> None:
    """Copy a container, with ``change(metadata)`` applied to its metadata."""
    f = SafetensorsFile(src)
    arrays = {n: np.array(f[n]) for n in f}
    meta = dict(f.metadata)
    change(meta)
    write_safetensors(dst, arrays, dtypes={n: f.info(n).dtype for n in f}, metadata=meta)
    f.close()


def test_damaged_or_missing_model_entry_is_named(tiny, tmp_path):
    def damage(meta):
        entry = json.loads(meta[MODEL_KEY])
        entry["files"]["config.json"] = entry["files"]["config.json"].replace('"num_hidden_layers": 2',
                                                                              '"num_hidden_layers": 1')
        meta[MODEL_KEY] = json.dumps(entry)

    _rewrite(tiny["unweight"], tmp_path / "damaged.safetensors", damage)
    with pytest.raises(WeightError, match="CRC-32"):
        open_weights(tmp_path / "damaged.safetensors")
    # an older container (no entry) still reads as tensors; the model loaders say what is missing
    _rewrite(tiny["unweight"], tmp_path / "old.safetensors", lambda meta: meta.pop(MODEL_KEY))
    src = open_weights(tmp_path / "old.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert np.array_equal(src.get(name), open_weights(tiny["folder"]).get(name))
    with pytest.raises(ConfigError, match="carries no config"):
        load_llama(tmp_path / "old.safetensors")
    with pytest.raises(ConfigError, match="carries no config"):
        load_tokenizer(tmp_path / "old.safetensors")


def test_compressing_a_container_again_is_refused(tiny, tmp_path):
    with pytest.raises(CodecError, match="already an unweight container"):
        compress_checkpoint(tiny["unweight"], tmp_path / "again.safetensors")


def test_fast_engine_serves_the_container_plain_and_compressed(tiny):
    torch = pytest.importorskip("torch")
    from fast.engine import Engine
    from fast.engine.model import TorchLlama, stored_projections
    from reference.engine import SamplingParams

    prompt = load_tokenizer(tiny["folder"]).encode_chat(MESSAGES)
    sp = SamplingParams(max_tokens=12)
    base = Engine.load(tiny["folder"], threads=1, num_blocks=32).generate([prompt], sp)[0].output_token_ids
    for src in (tiny["unweight"], tiny["rans"]):
        for compressed in (False, True, ("o", "down")):
            engine = Engine.load(src, compressed=compressed, threads=1, num_blocks=32)
            assert engine.generate([prompt], sp)[0].output_token_ids == base, (src.name, compressed)
    # o and down are transcoded from the stored Huffman form: the same palette form as encoding the weight
    stored = stored_projections(open_weights(tiny["unweight"]), 2, ("o", "down"), torch.bfloat16)
    assert sorted(stored) == [(0, "down"), (0, "o"), (1, "down"), (1, "o")]
    encoded = TorchLlama.load(tiny["folder"], compressed=True)
    for (i, proj), lin in stored.items():
        other = getattr(encoded.layers[i], proj).arrays()
        for name, buf in lin.arrays().items():
            assert torch.equal(buf, other[name]), (i, proj, name)
    served = TorchLlama.load(tiny["unweight"], compressed=True).weight_nbytes()
    plain = TorchLlama.load(tiny["unweight"]).weight_nbytes()
    assert served["compressed"] > 0 and served["dense"] < plain["dense"]


def _start_server(model: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serve", "--model", str(model), "--served-model-name", "m", "--port", "0",
           "--num-blocks", "32", "--log-level", "error", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _url(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the server did not start within {timeout} s"
    line = proc.stdout.readline()
    assert " on http://" in line, line + proc.stderr.read()
    return line.split(" on ")[1].split()[0]


def _chat(url: str, n: int) -> list[str]:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    out = []
    for q in ("Hello, tiny model!", "Say something."):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], max_tokens=n,
                                           temperature=0)
        out.append(r.choices[0].message.content)
    return out


def _served_texts(servers: list[tuple[Path, list[str]]], n: int, timeout: float) -> list[list[str]]:
    """Greedy chat texts from one server process per (model, options), all started together."""
    procs = [_start_server(model, *o) for model, o in servers]
    try:
        urls = [_url(p, timeout) for p in procs]
        return [_chat(u, n) for u in urls]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            assert p.wait(timeout=30) == 0
            assert "Traceback" not in p.stderr.read()


def test_server_process_serves_the_container_with_the_checkpoints_tokens(tiny):
    """``python -m serve --model FILE``: the container, plain and compressed, answers as the checkpoint."""
    pytest.importorskip("torch")
    from fast.engine import Engine
    from reference.engine import SamplingParams

    tok = load_tokenizer(tiny["folder"])
    engine = Engine.load(tiny["folder"], threads=1, num_blocks=32)
    expected = [tok.decode(engine.generate([tok.encode_chat([{"role": "user", "content": q}])],
                                           SamplingParams(max_tokens=10))[0].output_token_ids, skip_special=True)
                for q in ("Hello, tiny model!", "Say something.")]
    servers = [(tiny["unweight"], []), (tiny["unweight"], ["--compressed"]), (tiny["rans"], ["--compressed", "o,down"])]
    assert _served_texts(servers, 10, 180) == [expected] * 3


def test_compressed_needs_the_fast_engine():
    from serve.engines import EngineUnavailable, load_engine, parse_compressed

    assert parse_compressed("") == () and parse_compressed("all") == ("qkv", "o", "gate_up", "down")
    assert parse_compressed("o, down") == ("o", "down")
    with pytest.raises(ValueError, match="unknown matrices"):
        parse_compressed("qkv,mlp")
    with pytest.raises(EngineUnavailable, match="needs the fast engine"):
        load_engine("smollm2", "reference", compressed=("o",))


def test_auto_picks_the_fast_engine_when_torch_imports(monkeypatch):
    import importlib.util

    import serve.engines as engines

    pytest.importorskip("torch")
    assert engines.pick_engine("auto") == ("fast", None) and engines.pick_engine("reference") == ("reference", None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    kind, why = engines.pick_engine("auto")
    assert kind == "reference" and "torch" in why


@pytest.mark.slow
def test_smollm2_container_serves_the_ggufs_greedy_tokens(tmp_path):
    """The packaged SmolLM2 GGUF compressed by the reference CLI (``--to-bf16``; its F32 norms are bf16-exact)
    serves, plain and compressed, the tokens of the fast bf16 engine on the GGUF itself."""
    pytest.importorskip("torch")
    from fast.engine import Engine
    from reference.engine import SamplingParams

    out = tmp_path / "smollm2.unweight.safetensors"
    done = subprocess.run([sys.executable, "-m", "reference.codec", "compress", "smollm2", str(out), "--to-bf16"],
                          capture_output=True, text=True, env=ENV, timeout=900)
    assert done.returncode == 0, done.stderr
    tok = load_tokenizer("smollm2")
    engine = Engine.load("smollm2", threads=1, num_blocks=32)
    expected = [tok.decode(engine.generate([tok.encode_chat([{"role": "user", "content": q}])],
                                           SamplingParams(max_tokens=10))[0].output_token_ids, skip_special=True)
                for q in ("Hello, tiny model!", "Say something.")]
    assert _served_texts([(out, []), (out, ["--compressed"])], 10, 300) == [expected, expected]
    # the reference (float32) engine reads the container's weights: the GGUF's rounded to bf16
    down, original = load_llama(out)[1].layers[0].w_down, load_llama("smollm2")[1].layers[0].w_down
    assert np.array_equal(down, bf16_to_float32(float32_to_bf16(original)))


@pytest.mark.slow
def test_bench_compressed_runs_end_to_end(tiny, tmp_path):
    """The benchmark's whole path on the tiny checkpoint: containers, loads, the budget, three engine runs."""
    pytest.importorskip("torch")
    from experiments.unweight.bench_compressed import main

    out = tmp_path / "bench_compressed.json"
    result = main(["--model", str(tiny["folder"]), "--requests", "4", "--max-prompt", "48", "--max-output", "6",
                   "--out", str(out)])
    s, e = result["summary"], result["measured"]["economics"]
    assert json.loads(out.read_text())["summary"] == s and out.with_suffix(".png").is_file()
    assert e["blocks_compressed"] > e["blocks_plain"] and s["resident_weights_ratio"] < 1
    assert e["budget_bytes"] >= e["weights_compressed_bytes"] + e["blocks_compressed"] * e["kv_block_bytes"]
    assert all(v > 0 for v in s["useful_tok_s"].values())


@pytest.mark.slow
def test_bench_compressed_serve_runs_end_to_end(tiny, tmp_path):
    """Plain vs --compressed vs a container through real servers (serve.bench), on the tiny checkpoint: the
    answers are the plain endpoint's (lossless), the table and the figure are written."""
    pytest.importorskip("torch")
    pytest.importorskip("httpx")
    from experiments.unweight.bench_compressed_serve import main, table

    out = tmp_path / "serve_compressed.json"
    assert main(["--model", str(tiny["folder"]), "--min-elements", "1024", "--num-prompts", "2", "--max-tokens", "4",
                 "--request-rate", "20", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["setups"] == ["plain", "compressed", "container"] and out.with_suffix(".png").is_file()
    assert all(r["summary"]["completed"] == 2 and r["cpu_ms_per_output_token"] > 0 for r in result["runs"])
    assert {s: a["identical_answers"] for s, a in result["agreement_with_plain"].items()} == {"compressed": 2,
                                                                                             "container": 2}
    assert result["container"]["bytes"] > 0 and "--compressed" in result["workload"]["setups"]["compressed"]
    assert table(result).count("\n") == 4 and "| container |" in table(result)


def test_bench_compressed_serve_checks_its_arguments(capsys):
    from experiments.unweight.bench_compressed_serve import main

    for bad, needle in [(["--setups", "compressed,plain"], "plain first"), (["--repeats", "0"], "must be > 0"),
                        (["--container", "/nonexistent.safetensors"], "no such file")]:
        with pytest.raises(SystemExit):
            main(bad)
        assert needle in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["reference", "fast", "pipeline"])
def test_loading_opens_the_container_once(tiny, kind, monkeypatch):
    """Model and tokenizer read one opened source: the container's headers and CRCs are checked once (a
    pipeline's stage 0 sends the other stages their weights: they open nothing)."""
    if kind != "reference":
        pytest.importorskip("torch")
    from reference.codec import container_read
    from serve.engines import load_engine

    opened = []
    real = container_read.Container.__init__

    def counting(self, path, **kwargs):
        opened.append(path)
        real(self, path, **kwargs)

    monkeypatch.setattr(container_read.Container, "__init__", counting)
    extra = {"fast": {"threads": 1}, "pipeline": {"pipeline": "2", "dtype": "float32"}}.get(kind, {})
    engine = load_engine(str(tiny["unweight"]), "fast" if kind == "pipeline" else kind, num_blocks=32, **extra)
    try:
        assert engine.tokenizer is not None and len(opened) == 1, opened
    finally:
        getattr(getattr(engine, "runner", None), "close", lambda: None)()  # a pipeline's stage processes
