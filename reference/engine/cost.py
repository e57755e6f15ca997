"""What one engine step costs: FLOPs, bytes moved, and a step-time model fitted to measured steps.

FLOPs count the multiply-adds of the step (2 per multiply-add): the q/k/v/o projections and the
SwiGLU MLP for every token, attention scores and weighted sums for every (query, attended key)
pair, and the output head for every sequence that samples. Bytes are what must cross the memory
bus at least once (an ideal on-chip cache): every weight matrix once per step, the embedding rows
of the step's tokens, the output head if any sequence samples, each sequence's cached K/V once per
layer, and the new K/V written. Activations are left out (they fit on chip for these batch sizes).
Arithmetic intensity = FLOPs / bytes; a step is compute-bound on a device when its intensity is
above the device's ridge point, peak FLOP/s / peak bytes/s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reference.model.config import LlamaConfig


@dataclass(frozen=True)
class StepShape:
    """The shape of one step: per scheduled sequence, its new tokens and its context after the step."""

    new_tokens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_sampled: int

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens)

    def attention_pairs(self) -> int:
        """(query, key) pairs of causal attention: a new token at position p attends to p + 1 keys."""
        total = 0
        for n, ctx in zip(self.new_tokens, self.context_lens, strict=True):
            start = ctx - n
            total += n * start + n * (n + 1) // 2
        return total


def layer_weight_params(c: LlamaConfig) -> int:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size


@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes of a step of one model, as linear functions of the shape's four sums.

    FLOPs = per token (every layer's projections and MLP) + per attention pair (QK^T and PV in every
    layer) + per sampled sequence (the output head). Bytes = every weight once + per token (its
    embedding row and the K/V it writes) + the output head if anything samples + per cached token
    attended to (its K/V read in every layer). Build it once per model (``of``) and call it per step.
    """

    flops_per_token: int
    flops_per_pair: int
    flops_per_sample: int
    bytes_fixed: float
    bytes_per_token: float
    bytes_if_sampled: float
    bytes_per_cached_token: float

    @classmethod
    def of(cls, c: LlamaConfig, weight_bytes: float = 2, kv_bytes: float = 2) -> StepCost:
        """Weights and K/V stored at ``weight_bytes`` / ``kv_bytes`` per element."""
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        per_token = 2 * c.hidden_size * (2 * q + 2 * kv) + 2 * 3 * c.hidden_size * c.intermediate_size
        kv_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * kv_bytes  # K and V, all layers
        return cls(flops_per_token=c.num_layers * per_token, flops_per_pair=c.num_layers * 4 * q,
                   flops_per_sample=2 * c.hidden_size * c.vocab_size,
                   bytes_fixed=c.num_layers * layer_weight_params(c) * weight_bytes,
                   bytes_per_token=c.hidden_size * weight_bytes + kv_per_token,
                   bytes_if_sampled=c.vocab_size * c.hidden_size * weight_bytes, bytes_per_cached_token=kv_per_token)

    def flops(self, s: StepShape) -> float:
        return self.flops_of(s.num_tokens, s.attention_pairs(), s.num_sampled)

    def bytes(self, s: StepShape) -> float:
        return self.bytes_of(s.num_tokens, s.num_sampled, sum(s.context_lens) - s.num_tokens)

    def flops_of(self, tokens: int, pairs: int, sampled: int) -> float:
        """FLOPs from the sums: new tokens, attention pairs, sampled sequences."""
        return float(self.flops_per_token * tokens + self.flops_per_pair * pairs + self.flops_per_sample * sampled)

    def bytes_of(self, tokens: int, sampled: int, cached: int) -> float:
        """Bytes from the sums: new tokens, sampled sequences, cached tokens attended to (context - new)."""
        return float(self.bytes_fixed + self.bytes_per_token * tokens + (self.bytes_if_sampled if sampled else 0)
                     + self.bytes_per_cached_token * cached)


def step_flops(c: LlamaConfig, s: StepShape) -> float:
    return StepCost.of(c).flops(s)


def step_bytes(c: LlamaConfig, s: StepShape, weight_bytes: float = 2, kv_bytes: float = 2) -> float:
    """Bytes moved, with weights and K/V stored at ``weight_bytes`` / ``kv_bytes`` per element."""
    return StepCost.of(c, weight_bytes, kv_bytes).bytes(s)


def intensity(c: LlamaConfig, s: StepShape, weight_bytes: float = 2, kv_bytes: float = 2) -> float:
    return step_flops(c, s) / step_bytes(c, s, weight_bytes, kv_bytes)


@dataclass(frozen=True)
class StepTimeModel:
    """seconds = base + per_token * tokens + per_pair * attention pairs + per_sample * sampled sequences
    + multi_token if the step computes more than one token.

    ``multi_token`` is what the NumPy engine shows on a CPU: a step of one token multiplies vectors by
    the weight matrices (BLAS matrix-vector kernels), a step of two or more multiplies matrices, whose
    kernels pay a fixed extra cost at these small sizes (measured: one decode ~45 ms, two ~100 ms for
    SmolLM2 on one core). On a GPU it fits to about 0.
    """

    base: float
    per_token: float
    per_pair: float
    per_sample: float
    multi_token: float = 0.0

    def __call__(self, s: StepShape) -> float:
        return self.seconds_of(s.num_tokens, s.attention_pairs(), s.num_sampled, sum(s.context_lens) - s.num_tokens)

    def seconds_of(self, tokens: int, pairs: int, sampled: int, cached: int = 0) -> float:
        """Seconds from the shape's sums (``cached`` is not in this model; taken for the common signature)."""
        seconds = self.base + self.per_token * tokens + self.per_pair * pairs + self.per_sample * sampled
        return seconds + self.multi_token if tokens > 1 else seconds

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], seconds: Sequence[float]) -> StepTimeModel:
        """Least squares on measured steps; a coefficient that comes out negative is dropped (set 0).
        ``multi_token`` is fitted only when the steps include both one-token and larger steps (otherwise it
        cannot be told apart from ``base``)."""
        features = np.array([[1.0, s.num_tokens, s.attention_pairs(), s.num_sampled, float(s.num_tokens > 1)]
                             for s in shapes])
        y = np.asarray(seconds, dtype=np.float64)
        keep = [0, 1, 2, 3, 4] if 0 < features[:, 4].sum() < len(features) else [0, 1, 2, 3]
        while True:
            coef, *_ = np.linalg.lstsq(features[:, keep], y, rcond=None)
            if (coef >= 0).all() or len(keep) == 1:
                break
            keep.pop(int(np.argmin(coef)))
        full = np.zeros(5)
        full[keep] = np.maximum(coef, 0)
        return cls(*(float(x) for x in full))
