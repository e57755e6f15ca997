"""The NumPy Llama: paged attention equals contiguous attention; tiny HF checkpoints agree with transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from reference.kv.cache import KVCache, KVCacheError
from reference.model.config import ConfigError, config_from_gguf, config_from_hf
from reference.model.llama import Chunk, LlamaModel
from reference.model.loader import unpermute_gguf_rows
from reference.model.rope import inverse_frequencies
from tests.smollm import smollm2_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def tiny_hf_checkpoint(folder, tie: bool, rope: dict | None, seed: int = 0):
    """A random tiny Llama saved by transformers itself (config.json + model.safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=5000.0, tie_word_embeddings=tie, rms_norm_eps=1e-5)
    if rope is not None:
        cfg.rope_parameters = dict(rope, rope_theta=5000.0)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # non-trivial norms, so a mixed-up norm weight would show
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("tie,rope", [(True, None), (False, LLAMA3_ROPE)])
def test_tiny_hf_checkpoint_matches_transformers(tmp_path, tie, rope):
    hf = tiny_hf_checkpoint(tmp_path, tie, rope)
    ours = LlamaModel.load(tmp_path)
    assert ours.config.tie_embeddings == tie
    assert (ours.config.rope_scaling or {}).get("type") == (rope or {}).get("rope_type")
    ids = np.random.default_rng(0).integers(0, 97, size=150)  # past original_max_position: scaling matters
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None])).logits[0].numpy()
    got = ours.forward_contiguous(ids)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


def test_llama3_inverse_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, max_position_embeddings=131072)
    cfg.rope_parameters = dict(LLAMA3_ROPE, original_max_position_embeddings=8192, rope_theta=500000.0)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position": 8192}
    ours = inverse_frequencies(128, 500000.0, scaling)
    assert np.allclose(ours, ref.numpy(), rtol=1e-6)


def test_unpermute_inverts_the_llama_cpp_permutation():
    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py, LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    assert np.array_equal(unpermute_gguf_rows(llama_cpp_permute(w, 6), 6), w)


def test_bad_configs_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="architecture"):
        config_from_gguf({"general.architecture": "gpt2"})
    with pytest.raises(ConfigError, match="embedding_length"):
        config_from_gguf({"general.architecture": "llama"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        config_from_hf(tmp_path)


def test_checkpoint_with_wrong_shapes_is_rejected(tmp_path):
    tiny_hf_checkpoint(tmp_path, True, None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 81
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="shape"):
        LlamaModel.load(tmp_path)


def test_smollm2_config_from_gguf():
    c = smollm2_model().config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.tie_embeddings and c.rope_theta == 100000.0 and c.vocab_size == 49152


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8"])
def test_paged_chunked_batched_forward_equals_contiguous(kv_dtype):
    """Two sequences, scattered non-contiguous blocks, prompts in chunks, then decodes in one batch."""
    model = smollm2_model()
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 49152, size=23).tolist(), rng.integers(0, 49152, size=9).tolist()
    ref_a, ref_b = model.forward_contiguous(a), model.forward_contiguous(b)
    cache = model.new_cache(num_blocks=16, block_size=4, dtype=kv_dtype)
    table_a, table_b = [11, 2, 7, 0, 14, 5, 9], [3, 15, 1]
    model.forward([Chunk(a[:10], 0, table_a, wants_logits=False), Chunk(b[:8], 0, table_b, wants_logits=False)], cache)
    out = model.forward([Chunk(a[10:22], 10, table_a), Chunk(b[8:], 8, table_b)], cache)
    out2 = model.forward([Chunk(a[22:], 22, table_a)], cache)
    tol = 1e-4 if kv_dtype == "float32" else 0.1  # fp8: a bound on the relative logit error, see below
    for got, ref in [(out[0], ref_a[21]), (out[1], ref_b[8]), (out2[0], ref_a[22])]:
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel < tol, rel
        if kv_dtype == "fp8":  # fp8 K/V keeps the decision on these inputs
            assert np.argmax(got) == np.argmax(ref)


def test_kv_cache_rejects_bad_tables():
    cache = KVCache(1, 4, 2, 1, 4)
    with pytest.raises(KVCacheError, match="needs block"):
        cache.slots([0], 0, 3)
    with pytest.raises(KVCacheError, match="outside"):
        cache.slots([0, 9], 0, 3)
    with pytest.raises(KVCacheError, match="dtype"):
        KVCache(1, 4, 2, 1, 4, dtype="int4")


def test_float32_cache_round_trips_exactly():
    cache = KVCache(2, 6, 3, 2, 4)
    x = np.random.default_rng(0).standard_normal((7, 2, 4)).astype(np.float32)
    table = [5, 0, 3]
    cache.write(1, cache.slots(table, 0, 7), x, -x)
    k, v = cache.read(1, table, 7)
    assert np.array_equal(k, x) and np.array_equal(v, -x)
    cache.copy_block(0, 4)
    assert np.array_equal(cache.read(1, [5, 4, 3], 7)[0], x)
