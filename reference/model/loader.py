"""Load a Llama-style checkpoint (GGUF or Hugging Face safetensors) into float32 NumPy arrays.

Two naming schemes are understood: GGUF (``blk.3.attn_q.weight``) and Hugging Face
(``model.layers.3.self_attn.q_proj.weight``). Matrices keep the (out, in) layout of both formats.

Every tensor of a checkpoint must be used: a tensor the forward does not read (an MLP bias, a
layer of another architecture) means the model would compute something else, so it is refused with
a ``ConfigError`` naming it. The q/k/v (and o) projection biases of the Qwen2 family and of Llama's
``attention_bias`` are read when present.

An Unweight container (``python -m reference.codec compress``) loads like the checkpoint it was
compressed from: its tensors keep their names, and its config travels inside it
(``reference/model/carried.py``).

GGUF quirk: llama.cpp's converter permutes the rows of the q and k projections so that its RoPE can
rotate adjacent pairs. We undo that permutation here, so one RoPE (Hugging Face's, rotating the two
halves of each head) serves every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reference.bf16 import bf16_to_float32
from reference.model.carried import carried_entry, no_model_error
from reference.model.config import (
    ConfigError,
    LlamaConfig,
    config_from_gguf,
    config_from_hf,
    config_from_hf_text,
)
from reference.model.gguf_io import GGUFFile
from reference.model.weights import WeightSource, open_weights


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [hidden]
    wq: np.ndarray  # [heads * head_dim, hidden]
    wk: np.ndarray  # [kv_heads * head_dim, hidden]
    wv: np.ndarray  # [kv_heads * head_dim, hidden]
    wo: np.ndarray  # [hidden, heads * head_dim]
    mlp_norm: np.ndarray  # [hidden]
    w_gate: np.ndarray  # [intermediate, hidden]
    w_up: np.ndarray  # [intermediate, hidden]
    w_down: np.ndarray  # [hidden, intermediate]
    # [heads * head_dim] projection biases (Qwen2, Llama attention_bias), if any
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None  # [kv_heads * head_dim]
    bv: np.ndarray | None = None  # [kv_heads * head_dim]
    bo: np.ndarray | None = None  # [hidden]


@dataclass
class LlamaWeights:
    embedding: np.ndarray  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [hidden]
    lm_head: np.ndarray  # [vocab, hidden]; the embedding itself when tied
    # GGUF ``rope_freqs.weight`` (llama3 scaling), if any
    rope_freq_factors: np.ndarray | None = None


GGUF_NAMES = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
              "wo": "attn_output",
              "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
HF_NAMES = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
            "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
            "mlp_norm": "post_attention_layernorm",
            "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
HF_BIASES = {"bq": "self_attn.q_proj", "bk": "self_attn.k_proj", "bv": "self_attn.v_proj",
             "bo": "self_attn.o_proj"}
# a buffer older checkpoints saved: recomputed from rope_theta
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def unpermute_gguf_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation: per head, rows (0, 2, 4, ..., 1, 3, ...) back in
    order.

    The converter did ``w.reshape(n_heads, 2, d/2, in).swapaxes(1, 2)``: it interleaved the two
    halves of each head. Here we de-interleave them.
    """
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def load_llama(source: str | Path | WeightSource) -> tuple[LlamaConfig, LlamaWeights]:
    """Config and float32 weights of a Llama-style checkpoint (packaged name, path, or open
    source)."""
    src = source if isinstance(source, WeightSource) else open_weights(source)
    names = set(src.names())
    if "token_embd.weight" in names:
        cfg, weights, used = _load_gguf(src, names)
    elif "model.embed_tokens.weight" in names:
        cfg, weights, used = _load_hf(src, names)
    else:
        raise ConfigError(f"{src.label}: not a Llama-style checkpoint (no token_embd / "
                          "model.embed_tokens tensor)")
    unused = sorted(n for n in names - used if not n.endswith(IGNORED_SUFFIXES))
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise ConfigError(f"{src.label}: the checkpoint holds tensors this Llama forward does not "
                          "use: "
                          f"{unused[:5]}{more}; it would compute a different model")
    return cfg, weights


def _float32(src: WeightSource, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor ``name`` as float32, checked against the shape the config implies."""
    if name not in src.names():
        raise ConfigError(f"{src.label}: missing tensor {name!r}")
    a = src.get(name)
    kind = src.dtype(name)
    a = bf16_to_float32(a) if kind == "BF16" else np.asarray(a, dtype=np.float32)
    if tuple(a.shape) != tuple(shape):
        raise ConfigError(f"{src.label}: tensor {name!r} has shape {tuple(a.shape)}, config "
                          f"implies {shape}")
    return np.ascontiguousarray(a)


def _shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv, f = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    return {"attn_norm": (h,), "wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q),
            "mlp_norm": (h,), "w_gate": (f, h), "w_up": (f, h), "w_down": (h, f)}


def _load_gguf(src: WeightSource, names: set[str]) -> tuple[LlamaConfig, LlamaWeights, set[str]]:
    meta, where = gguf_metadata(src)
    cfg = config_from_gguf(meta, where, has_output="output.weight" in names)
    shapes = _shapes(cfg)
    layers = []
    for i in range(cfg.num_layers):
        w = {k: _float32(src, f"blk.{i}.{n}.weight", shapes[k]) for k, n in GGUF_NAMES.items()}
        w["wq"] = unpermute_gguf_rows(w["wq"], cfg.num_heads)
        w["wk"] = unpermute_gguf_rows(w["wk"], cfg.num_kv_heads)
        layers.append(LayerWeights(**w))
    emb = _float32(src, "token_embd.weight", (cfg.vocab_size, cfg.hidden_size))
    head = emb if cfg.tie_embeddings else _float32(src, "output.weight", emb.shape)
    factors = _float32(src, "rope_freqs.weight", (cfg.head_dim // 2,
                                                  )) if "rope_freqs.weight" in names else None
    used = {f"blk.{i}.{n}.weight" for i in range(cfg.num_layers) for n in GGUF_NAMES.values()}
    used |= {"token_embd.weight", "output.weight", "output_norm.weight",
             "rope_freqs.weight"} & names
    return cfg, LlamaWeights(emb, layers, _float32(src, "output_norm.weight", (cfg.hidden_size,)),
                             head, factors), used


def gguf_metadata(src: WeightSource) -> tuple[dict, str]:
    """The GGUF key/value metadata of a source: its GGUF file's, or what a container carries from
    one."""
    gguf = [f for f in src.files if isinstance(f, GGUFFile)]
    if gguf:
        return gguf[0].metadata(), str(gguf[0].path)
    carried = carried_entry(src)
    if carried is not None and carried[0]["kind"] == "gguf":
        return carried[0]["gguf"], carried[1]
    raise no_model_error(src) or ConfigError(f"{src.label}: GGUF tensor names but no GGUF metadata "
                                             "(config)")


def _load_hf(src: WeightSource, names: set[str]) -> tuple[LlamaConfig, LlamaWeights, set[str]]:
    carried = carried_entry(src)
    if carried is not None and carried[0]["kind"] == "hf":
        cfg = config_from_hf_text(carried[0]["files"]["config.json"],
                                  f"{carried[1]} (carried config.json)")
    else:
        folder = Path(src.label)
        folder = folder if folder.is_dir() else folder.parent
        if not (folder / "config.json").is_file():
            raise no_model_error(src) or ConfigError(
                f"{src.label}: a safetensors checkpoint needs its config.json beside the weights")
        cfg = config_from_hf(folder)
    shapes = _shapes(cfg)
    used = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} & names
    layers = []
    for i in range(cfg.num_layers):
        w = {k: _float32(src, f"model.layers.{i}.{n}.weight", shapes[k]) for k,
             n in HF_NAMES.items()}
        biases = {k: f"model.layers.{i}.{n}.bias" for k, n in HF_BIASES.items()}
        w |= {k: _float32(src, name, shapes["w" + k[1:]][:1]) for k,
              name in biases.items() if name in names}
        used |= {f"model.layers.{i}.{n}.weight" for n in HF_NAMES.values()} | (
            set(biases.values()) & names
        )
        layers.append(LayerWeights(**w))
    emb = _float32(src, "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    # tied: transformers ignores a stored lm_head too
    tied = cfg.tie_embeddings or "lm_head.weight" not in names
    head = emb if tied else _float32(src, "lm_head.weight", emb.shape)
    return cfg, LlamaWeights(emb, layers, _float32(src, "model.norm.weight", (cfg.hidden_size,)),
                             head), used
