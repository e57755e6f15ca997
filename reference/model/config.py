"""Hyper-parameters of a Llama-style decoder, read from GGUF metadata or a Hugging Face config.json.

Both sources describe the same things under different names; ``LlamaConfig`` is the one spelling
the rest of the code uses. Nothing read from a file is trusted: missing or nonsensical values raise
``ConfigError`` naming the file and the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference import jsonsafe
from reference.model.errors import WeightError


class ConfigError(WeightError):
    """A checkpoint's hyper-parameters are missing, malformed or unsupported."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int  # the context length the checkpoint was trained for
    tie_embeddings: bool
    # rope scaling: None, or {"type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position"} or {"type": "linear", "factor"}
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of "
                              f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} "
                              "must be > 0")

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads


def _need(meta: dict[str, Any], key: str, where: str) -> Any:
    if key not in meta:
        raise ConfigError(f"{where}: missing field {key!r}")
    return meta[key]


def config_from_gguf(meta: dict[str, Any], where: str = "gguf",
                     has_output: bool = False) -> LlamaConfig:
    """From GGUF key/value metadata (``GGUFFile.metadata()``); ``has_output``: an untied head
    exists."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"{where}: architecture {arch!r} is not supported (only 'llama')")

    def get(k: str) -> Any:
        return _need(meta, f"llama.{k}", where)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get("llama.vocab_size", len(tokens) if isinstance(tokens, list) else 0))
    scaling = None
    kind = meta.get("llama.rope.scaling.type")
    if kind == "linear":
        scaling = {"type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    elif kind not in (None, "none"):
        raise ConfigError(f"{where}: rope scaling type {kind!r} is not supported")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        max_position=int(get("context_length")),
        tie_embeddings=not has_output,
        rope_scaling=scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def config_from_hf(path: str | Path) -> LlamaConfig:
    """From a Hugging Face ``config.json`` (a file, or the checkpoint folder holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config ({e})") from None
    return config_from_hf_text(text, str(path))


def config_from_hf_text(text: str, where: str) -> LlamaConfig:
    """From the text of a Hugging Face ``config.json`` (``where`` names it in errors)."""
    try:
        cfg = jsonsafe.loads(text, what="config.json")
    except jsonsafe.JsonError as e:
        raise ConfigError(f"{where}: cannot read config ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    if cfg.get("model_type", "llama") not in ("llama", "mistral",
                                              "qwen2") and "LlamaForCausalLM" not in cfg.get(
            "architectures", []):
        raise ConfigError(f"{where}: model_type {cfg.get('model_type')!r} is not Llama-style")
    refuse_unsupported(cfg, where)
    hidden, heads = (
        int(_need(cfg, "hidden_size", where)),
        int(_need(cfg, "num_attention_heads", where)),
    )
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "llama3":
        scaling = {"type": "llama3", "factor": float(rope["factor"]),
                   "low_freq_factor": float(rope["low_freq_factor"]),
                   "high_freq_factor": float(rope["high_freq_factor"]),
                   "original_max_position": int(rope["original_max_position_embeddings"])}
    elif kind == "linear":
        scaling = {"type": "linear", "factor": float(rope["factor"])}
    elif kind == "default":
        scaling = None
    else:
        raise ConfigError(f"{where}: rope scaling {kind!r} is not supported (default, linear, "
                          "llama3)")
    eos = cfg.get("eos_token_id")
    eos_ids = (
        tuple(int(e) for e in eos)
        if isinstance(eos, list)
        else (() if eos is None else (int(eos),))
    )
    bos = cfg.get("bos_token_id")
    return LlamaConfig(
        vocab_size=int(_need(cfg, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(_need(cfg, "intermediate_size", where)),
        num_layers=int(_need(cfg, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )


def refuse_unsupported(cfg: dict[str, Any], where: str) -> None:
    """Refuse a config asking for what the Llama forward does not compute: loading it would give
    wrong logits without a word. (q/k/v/o biases are implemented: the loader takes them when
    present.)"""
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (the MLP computes SiLU "
                          "only)")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias is not supported (the MLP has no biases)")
    window = cfg.get("sliding_window")
    in_use = cfg.get("use_sliding_window", True) if cfg.get("model_type") == "qwen2" else True
    max_position = cfg.get("max_position_embeddings", 2048)
    if window is not None and in_use and (not isinstance(window, int) or window < max_position):
        raise ConfigError(f"{where}: sliding_window={window!r} is shorter than the context of "
                          f"{max_position} "
                          "tokens: sliding-window attention is not supported (every token attends "
                          "to all before it)")


# Llama-3.1-8B, for shape-only calculations (experiment E3) when the checkpoint itself is absent.
LLAMA_3_1_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position=131072,
    tie_embeddings=False,
    rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position": 8192},
    bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
)
