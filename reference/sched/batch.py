"""What one scheduler step asks the data plane to do, and the scheduler's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from reference.sched.errors import ConfigError
from reference.sched.sequence import Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step, and of a request.

    max_num_batched_tokens: the token budget of one step (decode tokens + prefill chunk tokens).
    max_num_seqs: most sequences running at once (and so in one step). Must be <= the budget, so
        that every running decode fits in every step.
    max_model_len: context length; a request's prompt must be shorter, and it finishes ("length")
        when it reaches it. None: limited by max_tokens and the cache only.
    watermark: share of the KV blocks that admission leaves free, as room for running sequences to
        grow (fewer preemptions; vLLM uses 0.01). 0: admit while the blocks fit.
    max_prefill_tokens_with_decodes: most prompt tokens a step computes when it also carries
    decodes.
        Every running stream waits for the whole step, so this bounds the gap a new prompt adds to
        their
        inter-token latency; a step without decodes (new prompts into an idle engine) still takes
        prompt chunks up to the whole budget. None (default): the whole budget, as vLLM's scheduler.
    decode_stall_budget: S, a prompt-token budget of a step that carries decodes which shrinks with
        the decodes waiting on it: with d decodes in the step it takes at most max(1, S // d) prompt
        tokens (and no more than ``max_prefill_tokens_with_decodes``, if set). A step stalls every
        running stream, so this bounds prompt tokens x stalled streams per step: a prompt arriving
        beside one or two streams is taken in a large chunk (few gaps get longer), beside many in a
        small one (each of the many gaps gets only a little longer). At least one prompt token a
        step: no waiting prompt starves. None (default): no such limit.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    watermark: float = 0.0
    max_prefill_tokens_with_decodes: int | None = None
    decode_stall_budget: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len",
                     "max_prefill_tokens_with_decodes", "decode_stall_budget"):
            value = getattr(self, name)
            if value is None and name in ("max_model_len", "max_prefill_tokens_with_decodes",
                                          "decode_stall_budget"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ConfigError(f"max_num_seqs ({self.max_num_seqs}) must be <= "
                              "max_num_batched_tokens "
                              f"({self.max_num_batched_tokens}): every running decode must fit in "
                              "a step")


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute K/V for tokens
    ``start .. start + num_new_tokens - 1``.

    ``token_ids`` are those tokens, ``positions`` their positions; attention reads the K/V of
    positions ``0 .. start + num_new_tokens - 1`` through ``block_table``. When ``needs_sample`` is
    true this is the sequence's last uncomputed token, so the logits at the last position give its
    next token (pass it to ``Scheduler.postprocess``); otherwise this is a prefill chunk and no
    token is sampled.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    token_ids: list[int]
    block_table: list[int]
    needs_sample: bool
    is_prefill: bool  # False: a decode (the one token sampled last step)

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.num_new_tokens)

    @property
    def context_len(self) -> int:
        """Tokens attention covers after this step: the cached ones and the new ones."""
        return self.start + self.num_new_tokens

    def slot_mapping(self, block_size: int) -> list[int]:
        """The cache slot (``block * block_size + offset``) of each new token."""
        return [
            self.block_table[p // block_size] * block_size + p % block_size for p in self.positions
        ]


@dataclass
class Batch:
    """Everything one step computes. Apply ``block_copies`` (src, dst) to the K/V arrays first."""

    entries: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # sent back to the waiting queue this step
    preempted: list[Sequence] = field(default_factory=list)
    now: float = 0.0

    @property
    def num_batched_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries if e.is_prefill)

    def __len__(self) -> int:
        return len(self.entries)
