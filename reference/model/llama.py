"""The Llama forward pass in NumPy (float32), over a paged KV cache.

One call of ``LlamaModel.forward`` runs one engine step: a batch of ``Chunk``s, each a run of new
tokens of one sequence (a whole prompt, a piece of a prompt, or the single latest token of a
decoding sequence). All tokens of the step go through the matrix multiplications together; only
attention is per sequence, because each reads its own keys and values through its own block table.

Per layer (pre-norm residual blocks):
    h = RMSNorm(x);  q, k, v = h Wq, h Wk, h Wv;  rotate q, k (RoPE);  store k, v in the cache
    x = x + Attention(q, cached K, cached V) Wo            (causal, grouped-query)
    h = RMSNorm(x);  x = x + (silu(h Wgate) * (h Wup)) Wdown   (SwiGLU)
then a final RMSNorm and the output head (the embedding matrix itself when tied).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reference.kv.cache import KVCache
from reference.model.config import LlamaConfig
from reference.model.loader import LlamaWeights, load_llama
from reference.model.rope import apply_rope, inverse_frequencies, rope_tables
from reference.model.weights import WeightSource


@dataclass
class Chunk:
    """New tokens of one sequence for one step."""

    tokens: Sequence[int]  # token ids to run
    start: int  # how many tokens of this sequence are already in the cache (first new position)
    block_table: Sequence[int]  # the sequence's blocks, covering positions [0, start + len(tokens))
    # return logits of the last token (False for a prompt piece that is not the last)
    wants_logits: bool = True
    # return logits of every token, [len(tokens), vocab] (a request wants its prompt's logprobs)
    all_logits: bool = False


def logit_rows(chunks: Sequence[Chunk]) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Which rows of a step's tokens need logits: the row indices, and per chunk that gets any
    (chunk index, first, end) into them. A chunk with ``all_logits`` gets all its rows."""
    rows: list[np.ndarray] = []
    spans, offset, got = [], 0, 0
    for j, ch in enumerate(chunks):
        n = len(ch.tokens)
        if ch.all_logits or ch.wants_logits:
            mine = np.arange(offset, offset + n) if ch.all_logits else np.array([offset + n - 1])
            rows.append(mine)
            spans.append((j, got, got + len(mine)))
            got += len(mine)
        offset += n
    return (np.concatenate(rows) if rows else np.zeros(0, np.int64)), spans


def split_logits(logits: np.ndarray, chunks: Sequence[Chunk],
                 spans: list[tuple[int, int, int]]) -> list[np.ndarray | None]:
    """Per chunk: its last row's logits [vocab], all its rows' [n, vocab] (``all_logits``), or
    None."""
    out: list[np.ndarray | None] = [None] * len(chunks)
    for j, a, b in spans:
        out[j] = logits[a:b] if chunks[j].all_logits else logits[a]
    return out


def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``x @ w.T``, plus the bias where the checkpoint has one (Qwen2's q/k/v projections)."""
    y = x @ w.T
    return y if bias is None else y + bias


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, per row."""
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(variance + np.float32(eps))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for very negative x; x/inf = -0 is right
    with np.errstate(over="ignore"):
        return x / (np.float32(1) + np.exp(-x))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Causal grouped-query attention of one sequence.

    q: [n, heads, d] for positions start .. start+n-1; k, v: [start+n, kv_heads, d] (all positions).
    Query head h uses key/value head h // (heads / kv_heads), as Hugging Face's ``repeat_kv`` does.
    """
    n, heads, d = q.shape
    length, kv_heads, _ = k.shape
    group = heads // kv_heads
    qg = q.reshape(n, kv_heads, group, d).transpose(1, 2, 0, 3)  # [kv, group, n, d]
    # [kv, group, n, length]
    scores = qg @ k.transpose(1, 2, 0)[:, None] * np.float32(1 / np.sqrt(d))
    query_pos = start + np.arange(n)[:, None]
    scores = np.where(np.arange(length)[None, :] <= query_pos, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out = weights @ v.transpose(1, 0, 2)[:, None]  # [kv, group, n, d]
    return out.transpose(2, 0, 1, 3).reshape(n, heads, d)


class LlamaModel:
    def __init__(self, config: LlamaConfig, weights: LlamaWeights):
        self.config = config
        self.weights = weights
        self.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling,
                                            weights.rope_freq_factors)

    @classmethod
    def load(cls, source: str | Path | WeightSource = "smollm2") -> LlamaModel:
        """Load a checkpoint: a packaged name (default ``smollm2``), a path, or an open
        WeightSource."""
        return cls(*load_llama(source))

    def make_runner(self, num_blocks: int, block_size: int = 16,
                    kv_dtype: str = "float32") -> NumpyRunner:
        """The engine's data plane for this model: a ``NumpyRunner`` owning a new KV cache."""
        return NumpyRunner(self, num_blocks, block_size, kv_dtype)

    def new_cache(self, num_blocks: int, block_size: int = 16, dtype: str = "float32") -> KVCache:
        c = self.config
        return KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype)

    def forward(self, chunks: Sequence[Chunk], cache: KVCache,
                on_layer: Callable[[int], None] | None = None) -> list[np.ndarray | None]:
        """Run one step; returns, per chunk, the float32 logits of its last token (None if not
        asked).

        ``on_layer(i)``, if given, is called right after layer i's K/V of this step are in the cache
        (a prefill worker sends them from there while the next layer computes).
        """
        x = self.run_layers(self.embed(chunks), chunks, cache, on_layer)
        rows, spans = logit_rows(chunks)
        return split_logits(self.head(x[rows]), chunks, spans)

    def embed(self, chunks: Sequence[Chunk]) -> np.ndarray:
        """The residual stream's start: the embedding rows of every chunk's tokens, [tokens,
        hidden]."""
        return self.weights.embedding[
            np.concatenate([np.asarray(ch.tokens, dtype=np.int64) for ch in chunks])
        ]

    def run_layers(self, x: np.ndarray, chunks: Sequence[Chunk], cache: KVCache,
                   on_layer: Callable[[int], None] | None = None) -> np.ndarray:
        """Every layer over the residual stream x of the chunks' tokens (a pipeline stage runs only
        its own layers: ``reference/model/stage.py``); writes their K/V into the cache and returns
        the new x."""
        c, w = self.config, self.weights
        sizes = [len(ch.tokens) for ch in chunks]
        positions = np.concatenate([np.arange(ch.start, ch.start + n) for ch,
                                    n in zip(chunks, sizes, strict=True)])
        slots = np.concatenate([cache.slots(ch.block_table, ch.start, n) for ch,
                                n in zip(chunks, sizes, strict=True)])
        cos, sin = rope_tables(positions, self.inv_freq)
        for i, layer in enumerate(w.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            q = apply_rope(linear(h, layer.wq, layer.bq).reshape(-1, c.num_heads, c.head_dim), cos,
                           sin)
            k = apply_rope(linear(h, layer.wk, layer.bk).reshape(-1, c.num_kv_heads, c.head_dim),
                           cos, sin)
            v = linear(h, layer.wv, layer.bv).reshape(-1, c.num_kv_heads, c.head_dim)
            cache.write(i, slots, k, v)
            if on_layer is not None:
                on_layer(i)
            out = np.empty_like(q)
            offset = 0
            for ch, n in zip(chunks, sizes, strict=True):
                keys, values = cache.read(i, ch.block_table, ch.start + n)
                out[offset:offset + n] = attention(q[offset:offset + n], keys, values, ch.start)
                offset += n
            x = x + linear(out.reshape(len(positions), -1), layer.wo, layer.bo)
            x = x + self._mlp(rms_norm(x, layer.mlp_norm, c.rms_norm_eps), i)
        return x

    def logits(self, x: np.ndarray, chunks: Sequence[Chunk]) -> np.ndarray:
        """Final norm and output head on the last token of each chunk that wants logits: [wanted,
        vocab]."""
        last = np.cumsum([len(ch.tokens) for ch in chunks]) - 1
        wanted = [j for j, ch in enumerate(chunks) if ch.wants_logits]
        if not wanted:
            return np.zeros((0, self.config.vocab_size), np.float32)
        return self.head(x[last[wanted]])

    def head(self, x: np.ndarray) -> np.ndarray:
        """Final norm and output head on the rows x: [rows, vocab]."""
        if not len(x):
            return np.zeros((0, self.config.vocab_size), np.float32)
        final = rms_norm(x, self.weights.final_norm, self.config.rms_norm_eps)
        return final @ self.weights.lm_head.T

    def _mlp(self, h: np.ndarray, i: int) -> np.ndarray:
        layer = self.weights.layers[i]
        return (silu(h @ layer.w_gate.T) * (h @ layer.w_up.T)) @ layer.w_down.T

    def forward_contiguous(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits [len(tokens), vocab] of one sequence with plain contiguous K/V (no cache, no
        paging).

        The textbook version, used to check the paged path.
        """
        c, w = self.config, self.weights
        ids = np.asarray(tokens, dtype=np.int64)
        cos, sin = rope_tables(np.arange(len(ids)), self.inv_freq)
        x = w.embedding[ids]
        for i, layer in enumerate(w.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            q = apply_rope(linear(h, layer.wq, layer.bq).reshape(-1, c.num_heads, c.head_dim), cos,
                           sin)
            k = apply_rope(linear(h, layer.wk, layer.bk).reshape(-1, c.num_kv_heads, c.head_dim),
                           cos, sin)
            v = linear(h, layer.wv, layer.bv).reshape(-1, c.num_kv_heads, c.head_dim)
            x = x + linear(attention(q, k, v, 0).reshape(len(ids), -1), layer.wo, layer.bo)
            x = x + self._mlp(rms_norm(x, layer.mlp_norm, c.rms_norm_eps), i)
        return rms_norm(x, w.final_norm, c.rms_norm_eps) @ w.lm_head.T


class NumpyRunner:
    """The reference runner: ``LlamaModel.forward`` over a NumPy ``KVCache``."""

    all_logits = True  # honours Chunk.all_logits (prompt logprobs)

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16,
                 kv_dtype: str = "float32"):
        self.model, self.config = model, model.config
        self.cache: KVCache = model.new_cache(num_blocks, block_size, kv_dtype)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.cache.copy_block(src, dst)

    def forward(self, chunks: Sequence[Chunk],
                on_layer: Callable[[int], None] | None = None) -> list[np.ndarray | None]:
        """``on_layer(i)``: called once layer i's K/V of this step are in the cache (the
        disaggregated prefill worker sends them then)."""
        return self.model.forward(chunks, self.cache, on_layer=on_layer)
