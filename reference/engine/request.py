"""What the engine keeps per request: its parameters, random stream (a seed), tokens and latency
metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reference.engine.params import SamplingParams


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model, and the most likely tokens' at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, as the streaming API yields it."""

    request_id: str
    token_id: int
    index: int  # 0 for the first generated token
    time: float  # engine clock when the token was ready
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    text: str = ""  # the token's text when the engine has a tokenizer
    logprob: Logprob | None = None  # when the request asked for logprobs
    # on the first token, if asked for: one per prompt token (the first None)
    prompt_logprobs: tuple[Logprob | None, ...] | None = None


@dataclass
class RequestMetrics:
    """Latency of one request, from the engine clock (seconds)."""

    arrival_time: float
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first generated token."""
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def inter_token_latencies(self) -> list[float]:
        """Every gap between consecutive generated tokens."""
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str
    seed: int  # the random stream: the token at position i draws sampling.uniform(seed, i)
    metrics: RequestMetrics
    seq: Any = None  # the scheduler's Sequence
    number: int = 0  # the engine's serial number: the default id and random stream come from it
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    output_logprobs: list[Logprob] = field(default_factory=list)  # when params.logprobs is not None
    prompt_logprobs: dict[int, Logprob] = field(default_factory=dict)  # by prompt position
    constraint: Any = None  # grammar.Constraint when params.grammar is set

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """A finished request, as ``Engine.generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str | None
    tenant: str
    metrics: RequestMetrics
    num_cached_tokens: int  # prompt tokens served from the prefix cache (at the last admission)
    logprobs: list[Logprob] | None = None  # per output token, when asked
    prompt_logprobs: list[Logprob | None] | None = None  # per prompt token (the first None)
