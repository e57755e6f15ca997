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
    """The shape of one step: per scheduled sequence, its new tokens and its context after the
    step."""

    new_tokens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_sampled: int

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens)

    def attention_pairs(self) -> int:
        """(query, key) pairs of causal attention: a new token at position p attends to p + 1
        keys."""
        total = 0
        for n, ctx in zip(self.new_tokens, self.context_lens, strict=True):
            start = ctx - n
            total += n * start + n * (n + 1) // 2
        return total


def layer_weight_params(c: LlamaConfig) -> int:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return (
        c.hidden_size * (2 * q + 2 * kv)
        + 3 * c.hidden_size * c.intermediate_size
        + 2 * c.hidden_size
    )


@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes of a step of one model, as linear functions of the shape's four sums.

    FLOPs = per token (every layer's projections and MLP) + per attention pair (QK^T and PV in every
    layer) + per sampled sequence (the output head). Bytes = every weight once + per token (its
    embedding row and the K/V it writes) + the output head if anything samples + per cached token
    attended to (its K/V read in every layer). Build it once per model (``of``) and call it per
    step.
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
        per_token = (
            2 * c.hidden_size * (2 * q + 2 * kv) + 2 * 3 * c.hidden_size * c.intermediate_size
        )
        # K and V, all layers
        kv_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * kv_bytes
        return cls(flops_per_token=c.num_layers * per_token, flops_per_pair=c.num_layers * 4 * q,
                   flops_per_sample=2 * c.hidden_size * c.vocab_size,
                   bytes_fixed=c.num_layers * layer_weight_params(c) * weight_bytes,
                   bytes_per_token=c.hidden_size * weight_bytes + kv_per_token,
                   bytes_if_sampled=c.vocab_size * c.hidden_size * weight_bytes,
                   bytes_per_cached_token=kv_per_token)

    def flops(self, s: StepShape) -> float:
        return self.flops_of(s.num_tokens, s.attention_pairs(), s.num_sampled)

    def bytes(self, s: StepShape) -> float:
        return self.bytes_of(s.num_tokens, s.num_sampled, sum(s.context_lens) - s.num_tokens)

    def flops_of(self, tokens: int, pairs: int, sampled: int) -> float:
        """FLOPs from the sums: new tokens, attention pairs, sampled sequences."""
        return float(
            self.flops_per_token * tokens
            + self.flops_per_pair * pairs
            + self.flops_per_sample * sampled
        )

    def bytes_of(self, tokens: int, sampled: int, cached: int) -> float:
        """Bytes from the sums: new tokens, sampled sequences, cached tokens attended to (context -
        new)."""
        return float(
            self.bytes_fixed
            + self.bytes_per_token * tokens
            + (self.bytes_if_sampled if sampled else 0)
            + self.bytes_per_cached_token * cached
        )


def step_flops(c: LlamaConfig, s: StepShape) -> float:
    return StepCost.of(c).flops(s)


def step_bytes(c: LlamaConfig, s: StepShape, weight_bytes: float = 2, kv_bytes: float = 2) -> float:
    """Bytes moved, with weights and K/V stored at ``weight_bytes`` / ``kv_bytes`` per element."""
    return StepCost.of(c, weight_bytes, kv_bytes).bytes(s)


def intensity(c: LlamaConfig, s: StepShape, weight_bytes: float = 2, kv_bytes: float = 2) -> float:
    return step_flops(c, s) / step_bytes(c, s, weight_bytes, kv_bytes)


@dataclass(frozen=True)
class StepTimeModel:
    """seconds = base + per_token * tokens + per_pair * attention pairs + per_sample * sampled
    sequences + multi_token if the step computes more than one token + multi_sample if more than one
    sequence samples + row_extra[t - 2] if the step computes exactly t = 2, 3, ... tokens.

    The last three terms are what the NumPy engine shows on a CPU (measured, SmolLM2 on one core):

    * ``multi_token``: a step of one token multiplies vectors by the weight matrices (BLAS
    matrix-vector
      kernels), a step of two or more multiplies matrices, whose kernels pay a fixed extra at these
      small
      sizes: one decode ~42 ms, a two-token step ~85-100 ms.
    * ``multi_sample``: the output head is the same story for the rows that sample: one row is a
      matrix-vector product, two or more a matrix-matrix one (16 prompt tokens of one sequence ~120
      ms,
      of two sequences of 8 that both sample ~136 ms).
    * ``row_extra``: matrix-matrix kernels on a handful of rows do not cost a straight line in the
    rows
      (2 rows ~82 ms, 3 rows ~99 ms, 4 rows ~94 ms): a signed correction for each of the smallest
      counts.

    On a GPU they fit to about 0.
    """

    base: float
    per_token: float
    per_pair: float
    per_sample: float
    multi_token: float = 0.0
    multi_sample: float = 0.0
    row_extra: tuple[float, ...] = ()

    def __call__(self, s: StepShape) -> float:
        return self.seconds_of(s.num_tokens, s.attention_pairs(), s.num_sampled,
                               sum(s.context_lens) - s.num_tokens)

    def seconds_of(self, tokens: int, pairs: int, sampled: int, cached: int = 0) -> float:
        """Seconds from the shape's sums (``cached`` is not in this model; taken for the common
        signature)."""
        seconds = (
            self.base + self.per_token * tokens + self.per_pair * pairs + self.per_sample * sampled
        )
        if tokens > 1:
            seconds += self.multi_token
        if sampled > 1:
            seconds += self.multi_sample
        if 2 <= tokens < 2 + len(self.row_extra):
            seconds += self.row_extra[tokens - 2]
        return seconds

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], seconds: Sequence[float], *,
            multi_sample: bool = False, row_extra: int = 0) -> StepTimeModel:
        """Least squares on measured steps; a coefficient that comes out negative is dropped (set
        0), except the signed ``row_extra`` corrections.

        A term is fitted only when the steps can tell it apart from the others: ``multi_token`` when
        there are one-token steps and larger ones; ``multi_sample`` (if asked) when some steps of
        more than one token sample at most one sequence and others sample several; ``row_extra`` (if
        asked:
        corrections for 2 .. row_extra + 1 tokens) for each count with at least 3 steps, when there
        are larger steps too.
        """
        tokens = np.array([s.num_tokens for s in shapes])
        sampled = np.array([s.num_sampled for s in shapes])
        columns = [np.ones(len(shapes)), tokens, [s.attention_pairs() for s in shapes], sampled,
                   tokens > 1, sampled > 1] + [tokens == t for t in range(2, 2 + row_extra)]
        features = np.array(columns, dtype=np.float64).T
        y = np.asarray(seconds, dtype=np.float64)
        keep = [0, 1, 2, 3]
        if 0 < features[:, 4].sum() < len(features):
            keep.append(4)
        several = (tokens > 1) & (sampled > 1)
        if multi_sample and several.any() and ((tokens > 1) & (sampled <= 1)).any():
            keep.append(5)
        keep += [
            6 + i
            for i in range(row_extra)
            if features[:, 6 + i].sum() >= 3 and (tokens > 2 + i).any()
        ]
        while True:
            coef, *_ = np.linalg.lstsq(features[:, keep], y, rcond=None)
            signed = [c if k < 6 else 0.0 for c, k in zip(coef, keep, strict=True)]
            if min(signed) >= 0 or len(keep) == 1:
                break
            keep.pop(int(np.argmin(signed)))
        full = np.zeros(features.shape[1])
        full[keep] = coef
        full[:6] = np.maximum(full[:6], 0)
        extra = tuple(
            max(float(full[6 + i]), -float(full[1] * (2 + i) + full[4])) for i in range(row_extra)
        )
        return cls(*(float(x) for x in full[:6]), row_extra=extra)
