"""Models a worker can be started with, by a short name that every process resolves the same way.

``smollm2`` (the packaged checkpoint), ``tiny`` or ``tiny:SEED`` (a small random Llama, built from
the seed: the same weights in every process, loads instantly; tests and the fault matrix use it), or
a path to any checkpoint ``LlamaModel.load`` reads.
"""

from __future__ import annotations

import functools

import numpy as np

from reference.disagg.wire import model_digest
from reference.model.config import LlamaConfig
from reference.model.llama import LlamaModel
from reference.model.loader import LayerWeights, LlamaWeights


def tiny_llama(seed: int = 0, *, vocab_size: int = 128, hidden: int = 32, layers: int = 3,
               heads: int = 4, kv_heads: int = 2, max_position: int = 2048) -> LlamaModel:
    """A random Llama small enough to run hundreds of steps a second; deterministic in ``seed``."""
    head_dim, inter = hidden // heads, 2 * hidden
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter,
                      num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position=max_position, tie_embeddings=True,
                      eos_token_ids=(0,))
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.2 * rng.standard_normal(hidden)).astype(np.float32)

    blocks = [LayerWeights(norm(), mat(heads * head_dim, hidden), mat(kv_heads * head_dim, hidden),
                           mat(kv_heads * head_dim, hidden), mat(hidden, heads * head_dim), norm(),
                           mat(inter, hidden), mat(inter, hidden),
                           mat(hidden, inter)) for _ in range(layers)]
    embedding = (rng.standard_normal((vocab_size, hidden))).astype(np.float32)
    return LlamaModel(cfg, LlamaWeights(embedding, blocks, norm(), embedding))


@functools.cache
def load_model(spec: str) -> LlamaModel:
    if spec == "tiny" or spec.startswith("tiny:"):
        _, _, seed = spec.partition(":")
        if seed and not seed.isdigit():
            raise ValueError(f"model spec {spec!r}: the seed after 'tiny:' must be a non-negative "
                             "integer")
        return tiny_llama(int(seed or 0))
    return LlamaModel.load(spec)


@functools.cache
def digest_of(spec: str) -> str:
    m = load_model(spec)
    return model_digest(m.config, m.weights)
