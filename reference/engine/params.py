"""Sampling parameters of a request, checked when the request is made, and the engine's errors."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


class EngineError(ValueError):
    """A request or call the engine cannot accept. The message names the problem."""


class SamplingParamsError(EngineError):
    """Invalid sampling parameters."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    temperature 0 means greedy (argmax). Otherwise logits are divided by ``temperature``, then only
    the ``top_k`` most likely tokens are kept (0: all), then the smallest set of most likely tokens
    whose probabilities add up to at least ``top_p`` (1.0: all), and one token is drawn. ``seed``
    fixes the request's random stream (None: the engine derives one from its own seed and the
    request's number), so the same request gives the same tokens however it is batched.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep going past the end-of-sequence token (benchmarks with fixed lengths)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name}={getattr(self, name)!r}: {why}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 means no top-k cut)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", "must be None or an integer >= 0")
        if not isinstance(self.ignore_eos, bool | np.bool_):
            raise bad("ignore_eos", "must be True or False")
        if isinstance(self.stop_token_ids, str | bytes | bytearray) or not isinstance(self.stop_token_ids, Iterable):
            raise bad("stop_token_ids", "must be a list of non-negative integers (a single id: [id])")
        stops = tuple(self.stop_token_ids)
        if not all(isinstance(t, int | np.integer) and not isinstance(t, bool | np.bool_) and t >= 0 for t in stops):
            raise bad("stop_token_ids", "must be non-negative integers")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(x: object) -> bool:
    """An int or float, not a bool (True would pass for 1: a mistake, not a temperature)."""
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool | np.bool_)
