"""Sampling parameters of a request, checked when the request is made; the engine's errors, and the
checks of its other arguments (each error names the argument)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np


class EngineError(ValueError):
    """A request or call the engine cannot accept. The message names the problem."""


class SamplingParamsError(EngineError):
    """Invalid sampling parameters."""


class RequestRejected(EngineError):
    """A request was refused (bad prompt, unknown tenant, does not fit); nothing else changed."""


class UnknownRequestError(EngineError, KeyError):
    """No request has this id (a KeyError too, for code that looks requests up like a dict)."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0])


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    temperature 0 means greedy (argmax). Otherwise logits are divided by ``temperature``, then only
    the ``top_k`` most likely tokens are kept (0: all), then the smallest set of most likely tokens
    whose probabilities add up to at least ``top_p`` (1.0: all), and one token is drawn. ``seed``
    fixes the request's random stream (None: the engine derives one from its own seed and the
    request's number), so the same request gives the same tokens however it is batched.

    Before any of that the logits are adjusted (``sampling.adjust``, greedy too): ``logit_bias``
    (token id -> added bias, in [-100, 100]) is added; ``repetition_penalty`` (vLLM's, 1: off)
    divides the positive logits and multiplies the negative ones of every token seen in the prompt
    or the output; ``frequency_penalty`` (times the token's count) and ``presence_penalty`` (once)
    are subtracted for every token of the output (OpenAI's, in [-2, 2]). ``min_p`` (0: off) drops
    the tokens less likely than ``min_p`` times the most likely one (after temperature).

    ``logprobs``: report the log-probability of each sampled token and of its ``logprobs`` most
    likely alternatives (None: none, 0: the sampled token's only); ``prompt_logprobs`` the same for
    every prompt token (the first has none). They are of the model's raw distribution: the
    log-softmax of the logits before the adjustments, temperature and cuts (vLLM's default,
    "raw_logprobs").

    ``grammar`` (structured output): only tokens the grammar allows are sampled, and the answer
    ends with the end-of-sequence token once the grammar is complete (``grammar.py``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # keep going past the end-of-sequence token (benchmarks with fixed lengths)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # token id -> bias; a dict is stored as a sorted tuple of pairs (the params stay hashable)
    logit_bias: tuple[tuple[int, float], ...] | Mapping[int, float] = ()
    # structured output: llguidance's grammar text (reference/engine/grammar.py); None: free text
    grammar: str | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name}={getattr(self, name)!r}: {why}")

        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an integer >= 1")
        if (
            not _is_number(self.temperature)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 means no top-k cut)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise bad("seed", "must be None or an integer >= 0")
        if not isinstance(self.ignore_eos, bool | np.bool_):
            raise bad("ignore_eos", "must be True or False")
        if isinstance(self.stop_token_ids, str | bytes | bytearray) or not isinstance(
            self.stop_token_ids, Iterable
        ):
            raise bad("stop_token_ids", "must be a list of non-negative integers (a single id: "
                                        "[id])")
        stops = tuple(self.stop_token_ids)
        if not all(
            isinstance(t, int | np.integer) and not isinstance(t, bool | np.bool_) and t >= 0
            for t in stops
        ):
            raise bad("stop_token_ids", "must be non-negative integers")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | np.integer)
                                      or isinstance(value, bool) or value < 0):
                raise bad(name, "must be None or an integer >= 0 (alternatives per token)")
        ranges = (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("min_p", 0, 1))
        for name, low, high in ranges:
            value = getattr(self, name)
            if not _is_number(value) or not low <= value <= high:
                raise bad(name, f"must be a number in [{low}, {high}]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise bad("repetition_penalty", "must be a number in (0, 100] (1 means none)")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias, bad))
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar:
                raise bad("grammar", "must be None or a non-empty grammar text "
                                     "(reference/engine/grammar.py)")
            if self.ignore_eos:
                raise bad("ignore_eos", "cannot be True with a grammar: a complete answer ends "
                                        "with the end-of-sequence token")

    @property
    def penalized(self) -> bool:
        """Whether any logit adjustment is on (bias or penalty)."""
        return (bool(self.logit_bias) or self.presence_penalty != 0
                or self.frequency_penalty != 0 or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _bias_pairs(bias: object, bad: Callable[[str, str], SamplingParamsError]
                ) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs: ids >= 0, biases in [-100, 100]."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else bias
    if isinstance(pairs, str | bytes) or not isinstance(pairs, Iterable):
        raise bad("logit_bias", "must map token ids to biases")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise bad("logit_bias", "must map token ids to biases")
        token, value = pair
        if not isinstance(token, int | np.integer) or isinstance(token, bool) or token < 0:
            raise bad("logit_bias", f"token id {token!r}: must be an integer >= 0")
        if not _is_number(value) or not -100 <= value <= 100:
            raise bad("logit_bias", f"bias {value!r} of token {token}: must be in [-100, 100]")
        out[int(token)] = float(value)
    return tuple(sorted(out.items()))


def _is_number(x: object) -> bool:
    """An int or float, not a bool (True would pass for 1: a mistake, not a temperature)."""
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(
        x, bool | np.bool_
    )


def check_engine_args(*, max_model_len: int | None, seed: int, **counts: int) -> None:
    """Engine arguments: each count an integer >= 1, max_model_len None or >= 1, seed >= 0."""
    for name, value in counts.items():
        if type(value) is not int or value < 1:
            raise EngineError(f"{name}={value!r}: must be an integer >= 1")
    if max_model_len is not None and (type(max_model_len) is not int or max_model_len < 1):
        raise EngineError(f"max_model_len={max_model_len!r}: must be None (the model's context) or "
                          "an integer >= 1")
    if type(seed) is not int or seed < 0:
        raise EngineError(f"seed={seed!r}: must be an integer >= 0")


def check_request_args(*, tenant: object, request_id: object, arrival_time: object,
                       cache_salt: object,
                        predicted_output_len: object) -> None:
    """The types of add_request's keyword arguments (RequestRejected naming the argument)."""
    if not isinstance(tenant, str):
        raise RequestRejected(f"tenant={tenant!r}: must be a str")
    if request_id is not None and (
        isinstance(request_id, bool) or not isinstance(request_id, str | int)
    ):
        raise RequestRejected(f"request_id={request_id!r}: must be None, a str or an int")
    if arrival_time is not None and (isinstance(arrival_time,
                                                bool) or not isinstance(arrival_time, int | float)
                                     or not math.isfinite(arrival_time)):
        raise RequestRejected(f"arrival_time={arrival_time!r}: must be None or a finite number")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise RequestRejected(f"cache_salt={cache_salt!r}: must be None or a str")
    if predicted_output_len is not None and (
        type(predicted_output_len) is not int or predicted_output_len < 0
    ):
        raise RequestRejected(f"predicted_output_len={predicted_output_len!r}: must be None or an "
                              "integer >= 0")
