"""A request's state as the scheduler and the block manager see it."""

from __future__ import annotations

import enum
import itertools
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from reference.sched.errors import RequestError

_next_id = itertools.count()


def _non_negative_ints(tokens: list[Any]) -> bool:
    """Whether every token id is an int (not a bool) >= 0. The common case, plain ``int`` only, is
    checked with two C-level passes (``set(map(type, ...))`` and ``min``); anything else item by
    item."""
    if set(map(type, tokens)) == {int}:
        return min(tokens) >= 0
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks (new, or preempted)
    RUNNING = "running"  # admitted: holds blocks, gets tokens computed each step
    FINISHED = "finished"  # hit max_tokens, EOS, a stop id or the context length; blocks freed
    ABORTED = "aborted"  # aborted by the caller; blocks freed


@dataclass(eq=False)
class Sequence:
    """One request: its prompt, the tokens generated so far, and its place in the KV cache.

    ``token_ids`` is prompt + output. ``num_computed_tokens`` of them have their K/V in the cache;
    the rest are computed by the coming steps (a prefill computes many at once, in chunks; a decode
    computes the one token sampled last). Preemption frees the blocks and resets
    ``num_computed_tokens`` to 0: the tokens are kept and recomputed later (recompute preemption).
    """

    prompt_token_ids: list[int]
    _: KW_ONLY  # everything after the prompt is passed by name
    max_tokens: int = 16
    tenant: str = "default"
    arrival_time: float | None = None  # set by Scheduler.add when None
    predicted_output_len: int | None = None  # for SJF; None means max_tokens
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None  # prefix-cache isolation: e.g. the tenant id
    request: Any = None  # the engine's own per-request object; the scheduler never reads it
    seq_id: int = field(default_factory=lambda: next(_next_id))

    status: SequenceStatus = field(default=SequenceStatus.WAITING, init=False)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = field(default=0, init=False)
    # from the prefix cache at the last admission
    num_cached_tokens: int = field(default=0, init=False)
    block_table: list[int] = field(default_factory=list, init=False)
    block_keys: list[bytes] = field(default_factory=list, init=False)
    finish_reason: str | None = field(default=None, init=False)  # "length" | "stop" | "abort"
    num_preemptions: int = field(default=0, init=False)
    first_scheduled_time: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    finish_time: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        prompt = list(self.prompt_token_ids)
        if not prompt:
            raise RequestError("empty prompt: a request needs at least one prompt token")
        if not _non_negative_ints(prompt):
            raise RequestError("prompt token ids must be non-negative integers")
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.predicted_output_len is not None and self.predicted_output_len < 0:
            raise RequestError(
                f"predicted_output_len must be >= 0, got {self.predicted_output_len}"
            )
        self.prompt_token_ids = prompt
        self.token_ids = list(prompt)
        self.stop_token_ids = tuple(self.stop_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V still have to be computed: 1 when decoding, more during a prefill."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)

    def predicted_remaining_work(self) -> int:
        """Tokens still to compute, predicted: uncomputed tokens + predicted outputs not yet
        made."""
        predicted = (
            self.max_tokens
            if self.predicted_output_len is None
            else min(self.predicted_output_len, self.max_tokens)
        )
        num_tokens, num_prompt = len(self.token_ids), len(self.prompt_token_ids)
        return num_tokens - self.num_computed_tokens + max(0, predicted - (num_tokens - num_prompt))
