"""The ``tiny`` model of a fleet: a small Llama with seeded random weights and SmolLM2's tokenizer.

A fleet of several sites on one CPU cannot run SmolLM2 at every site and stay quick, so a site may
serve ``tiny`` instead: 2 layers, hidden 64, GQA 4/2, written once as a Hugging Face checkpoint folder
(``config.json``, ``model.safetensors``, ``tokenizer.json``) that ``python -m serve --model FOLDER``
loads like any other. Its answers are noise, but it takes real steps through the real engine, with
the tokenizer (and so the token counts) of SmolLM2.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from reference.model.safetensors_io import write_safetensors
from reference.model.tokenizer import load_tokenizer

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
          "tie_word_embeddings": True, "hidden_act": "silu"}


def write_tiny_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint into ``folder`` (once: an existing complete one is kept); returns it."""
    folder = Path(folder)
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer("smollm2")
    config = dict(CONFIG, vocab_size=tok.vocab_size, eos_token_id=list(tok.eos_token_ids))
    rng = np.random.default_rng(seed)
    h, inter, q, kv = config["hidden_size"], config["intermediate_size"], 4 * 16, 2 * 16

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    tensors = {"model.embed_tokens.weight": 3 * w(tok.vocab_size, h), "model.norm.weight": np.ones(h, np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": np.ones(h, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(h, np.float32),
                    p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                    p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                    p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                    p + "mlp.down_proj.weight": w(h, inter)}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    tok.backend.save(str(folder / "tokenizer.json"))
    write_safetensors(folder / "model.safetensors", tensors)
    # written last: its presence marks the folder complete
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template}))
    return folder
