"""A tiny Hugging Face Llama checkpoint folder on disk: bf16 safetensors, config.json, a byte-level tokenizer.

Random weights (2 layers, hidden 64), a vocabulary of the 256 byte symbols plus three special tokens,
and a ChatML template: everything ``python -m serve --model FOLDER`` needs, written in milliseconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from reference.bf16 import float32_to_bf16
from reference.model.safetensors_io import write_safetensors

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer_json() -> tuple[str, int]:
    """A byte-level BPE without merges (one token per byte) and the specials: (tokenizer.json text, vocab size)."""
    import tokenizers as tk

    alphabet = sorted(tk.pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate([*SPECIALS, *alphabet])}
    t = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    t.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = tk.decoders.ByteLevel()
    t.add_special_tokens([tk.AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return t.to_str(), len(vocab)


def write_tiny_checkpoint(folder: Path, seed: int = 0, layers: int = 2) -> Path:
    """Write the checkpoint into ``folder`` (created); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    text, vocab = tokenizer_json()
    hidden, inter, heads, kv, head_dim = 64, 128, 4, 2, 16
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 1.0) -> np.ndarray:
        return float32_to_bf16((scale * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))

    def norm() -> np.ndarray:
        return float32_to_bf16((1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    tensors = {"model.embed_tokens.weight": w(vocab, hidden, scale=3.0), "model.norm.weight": norm()}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                    p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
                    p + "self_attn.k_proj.weight": w(kv * head_dim, hidden),
                    p + "self_attn.v_proj.weight": w(kv * head_dim, hidden),
                    p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
                    p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                    p + "mlp.down_proj.weight": w(hidden, inter)}
    write_safetensors(folder / "model.safetensors", tensors, dtypes={n: "BF16" for n in tensors})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
              "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(text)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
                                                               "chat_template": TEMPLATE}))
    return folder


def tiny_checkpoint_and_container(root: Path, env: dict[str, str]) -> dict[str, Path]:
    """The checkpoint in ``root / "ckpt"`` and its Unweight container, written by the real CLI
    (``python -m reference.codec compress``): {"plain": folder, "compressed": container}."""
    folder = write_tiny_checkpoint(root / "ckpt")
    container = root / "tiny.unweight.safetensors"
    done = subprocess.run([sys.executable, "-m", "reference.codec", "compress", str(folder), str(container),
                           "--min-elements", "1024"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return {"plain": folder, "compressed": container}
