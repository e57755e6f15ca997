"""Checkpoints with features the Llama forward does not compute are refused, not run (issue 13, item 9).

Small random models made with transformers' own config classes, saved as safetensors: the q/k/v
biases of the Qwen2 family and Llama's ``attention_bias`` are implemented and agree with
transformers; ``mlp_bias``, another activation, a sliding window shorter than the context, an
unknown model type and any tensor the loader would not read give a ``ConfigError`` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reference.model.config import ConfigError
from reference.model.llama import Chunk, LlamaModel
from reference.model.safetensors_io import SafetensorsFile, write_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
TOKENS = [3, 17, 42, 5, 60, 8, 23, 1, 11]


def save(tmp: Path, config: object) -> Path:
    """A random model of ``config``, every parameter (biases and norms included) random, saved."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(tmp, safe_serialization=True)
    return tmp


def hf_logits(folder: Path) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].numpy()


@pytest.mark.parametrize("kind", ["qwen2", "llama_attention_bias"])
def test_projection_biases_agree_with_transformers(tmp_path: Path, kind: str) -> None:
    if kind == "qwen2":
        config = transformers.Qwen2Config(**SMALL, use_sliding_window=False, sliding_window=4096)
    else:
        config = transformers.LlamaConfig(**SMALL, attention_bias=True)
    folder = save(tmp_path, config)
    want = hf_logits(folder)
    model = LlamaModel.load(folder)
    assert model.weights.layers[0].bq is not None and (model.weights.layers[0].bo is None) == (kind == "qwen2")
    got = model.forward_contiguous(TOKENS)
    cache = model.new_cache(num_blocks=4, block_size=4)
    paged = model.forward([Chunk(TOKENS, 0, [0, 1, 2])], cache)[0]
    scale = np.abs(want).max()
    assert np.abs(got - want).max() / scale < 1e-4
    assert np.abs(paged - want[-1]).max() / scale < 1e-4
    # and the biases matter here: without them the logits are far off (what loading did before)
    for layer in model.weights.layers:
        layer.bq = layer.bk = layer.bv = layer.bo = None
    assert np.abs(model.forward_contiguous(TOKENS) - want).max() / scale > 1e-2


@pytest.mark.parametrize(("make", "words"), [
    (lambda: transformers.LlamaConfig(**SMALL, mlp_bias=True), "mlp_bias is not supported"),
    (lambda: transformers.LlamaConfig(**SMALL, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda: transformers.MistralConfig(**SMALL, sliding_window=16), "sliding_window=16 is shorter than the context"),
    (lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16), "sliding_window=16"),
])
def test_unsupported_features_are_refused_by_name(tmp_path: Path, make: object, words: str) -> None:
    folder = save(tmp_path, make())
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(ConfigError, match=words):
        LlamaModel.load(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_unknown_model_type_and_unused_tensors_are_refused(tmp_path: Path) -> None:
    folder = save(tmp_path, transformers.MistralConfig(**SMALL, sliding_window=None))
    LlamaModel.load(folder)  # a Mistral without a window is a Llama
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "gemma", "architectures": ["X"]}))
    with pytest.raises(ConfigError, match="model_type 'gemma' is not Llama-style"):
        LlamaModel.load(folder)
    (folder / "config.json").write_text(json.dumps(config))
    with SafetensorsFile(folder / "model.safetensors") as f:
        tensors = {n: np.array(f[n]) for n in f}
        dtypes = {n: f.info(n).dtype for n in f}
    extra = {"model.layers.1.mlp.down_proj.bias": np.zeros(32, np.float32),
             "model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)}
    write_safetensors(folder / "model.safetensors", tensors | extra, dtypes=dtypes)
    with pytest.raises(ConfigError, match=r"does not use: \['model.layers.0.self_attn.q_norm.weight', "
                                          r"'model.layers.1.mlp.down_proj.bias'\]"):
        LlamaModel.load(folder)
