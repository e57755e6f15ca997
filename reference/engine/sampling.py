"""Pick the next token from logits: logit bias and penalties, greedy, temperature, min-p, top-k,
top-p, from a counter-based random stream; and the log-probabilities a client may ask for.

A request's random number for a token is a pure function of (the request's seed, the token's
position in the sequence): ``uniform(seed, position)``, a hash of the two (SplitMix64's mixer, the
counter-based scheme of Salmon et al.'s Philox family in its simplest form). Nothing is carried from
one token to the next, so the token at a position is the same wherever it is computed: in a
colocated engine, on a prefill worker (the first token) or a decode worker (the rest, after a
migration too: the new attempt's prompt ends where the stream was), or behind a pipeline; and
whatever else is in the batch.

The arithmetic is float64 and draws exactly one number per sampled token; greedy draws nothing.

The order, as vLLM's sampler has it: a grammar's mask (structured output, grammar.py), then
``adjust`` (logit bias, then the repetition, frequency and presence penalties), then greedy's
argmax, or temperature, min-p, top-k, top-p and a draw. The
log-probabilities reported (``logprobs``) are the model's raw ones: the log-softmax of the logits as
the model gave them, before any of these steps (vLLM's default, "raw_logprobs"), so they do not
depend on how the request samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from reference.engine.params import SamplingParams
from reference.engine.request import Logprob

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: SplitMix64's counter increment


def mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers whose output bits all depend on every
    input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """The random number in [0, 1) of the token at ``position`` (0-based, counting the prompt) of a
    request whose stream is ``seed``: 53 bits of a hash of (seed, position), as a float64."""
    key = mix64((seed & MASK64) ^ GOLDEN)  # the stream: one key per seed
    x = mix64((key + (position + 1) * GOLDEN) & MASK64)  # the counter: one number per position
    return (x >> 11) * 2.0 ** -53


def derive_seed(base: int, number: int) -> int:
    """A stream for request ``number`` of an engine seeded with ``base`` (requests that give no
    seed)."""
    # < 2**63, as a client's seed
    return mix64((mix64(base & MASK64) + number * GOLDEN) & MASK64) >> 1


def adjust(logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int] = (),
           output_ids: Sequence[int] = ()) -> np.ndarray:
    """The logits after ``logit_bias`` and the penalties, as float64 (the input is left as it is).

    ``repetition_penalty`` r: a token seen in the prompt or the output has its logit divided by r
    when positive, multiplied by r when not. ``frequency_penalty`` f and ``presence_penalty`` p: a
    token generated c times loses f * c + p * (c > 0)."""
    z = np.array(logits, dtype=np.float64)
    for token, bias in params.logit_bias:
        z[token] += bias
    if params.repetition_penalty != 1:
        seen = np.zeros(len(z), dtype=bool)
        seen[np.asarray(prompt_ids, dtype=np.int64)] = True
        seen[np.asarray(output_ids, dtype=np.int64)] = True
        r = params.repetition_penalty
        z = np.where(seen, np.where(z > 0, z / r, z * r), z)
    if len(output_ids) and (params.frequency_penalty or params.presence_penalty):
        counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=len(z))[:len(z)]
        z = z - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return z


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from (float64, sums to 1), after temperature, min-p, top-k,
    top-p."""
    z = np.asarray(logits, dtype=np.float64) / params.temperature
    z = z - z.max()
    if params.min_p > 0:  # exp(z) is the probability relative to the most likely token's
        z = np.where(z >= np.log(params.min_p), z, -np.inf)
    if params.top_k and params.top_k < len(z):
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)  # ties with the k-th value are kept
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # mass of the strictly more likely tokens
        keep = order[before < params.top_p]  # the first token is always kept
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def sample(logits: np.ndarray, params: SamplingParams, seed: int, position: int,
           prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
           allowed: np.ndarray | None = None) -> int:
    """One token id for ``position`` of the request whose stream is ``seed``, ``prompt_ids`` and
    ``output_ids`` the tokens so far (for the penalties). ``allowed``: a bool per token, the only
    tokens that may be drawn (a grammar's mask, grammar.py); the others' logits become -inf first.
    Greedy takes the first index of the largest logit and draws nothing."""
    if allowed is not None:
        logits = np.where(allowed, np.asarray(logits, dtype=np.float64), -np.inf)
    if params.penalized:
        logits = adjust(logits, params, prompt_ids, output_ids)
    if params.greedy:
        return int(np.argmax(logits))
    p = probabilities(logits, params)
    u = uniform(seed, position)
    cumulative = np.cumsum(p)
    index = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    return min(index, int(np.flatnonzero(p)[-1]))  # guard against rounding at the very top


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The model's log-probabilities (float64) from its logits: ``z - log(sum(exp(z)))``."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def logprob_of(logprobs: np.ndarray, token: int, k: int) -> Logprob:
    """``token``'s log-probability and the ``k`` most likely tokens' (most likely first, ties by
    the smaller id)."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, len(logprobs))
        best = np.argpartition(-logprobs, k - 1)[:k]
        best = best[np.lexsort((best, -logprobs[best]))]
        top = tuple((int(t), float(logprobs[t])) for t in best)
    return Logprob(int(token), float(logprobs[token]), top)
