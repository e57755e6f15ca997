"""The engine: requests in, tokens out. It joins the control plane and the data plane.

Each ``step()``:
  1. the scheduler (``reference/sched``) picks this step's work within its token budget: decodes of
     running sequences first, then prefill chunks, admitting waiting requests while KV blocks last;
  2. the model runner applies the copy-on-write block copies it asks for to the KV cache;
  3. the model runner runs every scheduled chunk in one forward pass over the paged KV cache;
  4. a token is sampled for each sequence whose prompt is complete, from the request's (seed,
  position) stream (and its log-probabilities kept, when asked: a request that wants its prompt's
  asks the runner for the logits of every prompt row, and skips the prefix cache);
  5. the scheduler records the tokens and finishes requests (end token, stop id, max_tokens,
  context).

Typical use::

    engine = Engine(LlamaModel.load("smollm2"), load_tokenizer("smollm2"))
    outputs = engine.generate(["Hello"], SamplingParams(max_tokens=20))
    # the fast engine is this class with a torch runner: fast.engine.Engine.load("smollm2")
    for event in engine.stream("Tell me a story", SamplingParams(temperature=0.8, seed=1)):
        print(event.text, end="")

The model runner (``model_runner.py``) is the only part that differs between the NumPy
engine and the fast one: ``model.make_runner(...)`` gives the data plane, everything else here is
the one control plane both share.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from reference.engine import grammar
from reference.engine.cost import StepShape
from reference.engine.model_runner import ModelRunner, RunnableModel
from reference.engine.params import (
    EngineError,
    RequestRejected,
    SamplingParams,
    SamplingParamsError,
    UnknownRequestError,
    check_engine_args,
    check_request_args,
)
from reference.engine.request import Logprob, Request, RequestMetrics, RequestOutput, TokenEvent
from reference.engine.sampling import derive_seed, log_softmax, logprob_of, sample
from reference.kv.block_manager import BlockManager
from reference.model.llama import Chunk
from reference.sched import (
    RequestError,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    Tenants,
    make_policy,
)
from reference.sched import Sequence as SchedSequence


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """What one step computed (for throughput and arithmetic-intensity accounting)."""

    time: float  # engine clock at the end of the step
    duration: float  # seconds the step took (schedule + forward + sample)
    model_time: float  # seconds of it spent in the model runner; the rest is the control plane
    new_tokens: tuple[int, ...]  # tokens computed per scheduled sequence
    context_lens: tuple[int, ...]  # tokens attention covered per sequence (cached + new)
    is_prefill: tuple[bool, ...]
    num_sampled: int
    num_preempted: int

    def shape(self) -> StepShape:
        return StepShape(self.new_tokens, self.context_lens, self.num_sampled)


class Engine:
    def __init__(self, model: RunnableModel, tokenizer: Any = None, *, num_blocks: int = 512,
                 block_size: int = 16, kv_dtype: str = "float32", max_num_batched_tokens: int = 256,
                 max_num_seqs: int = 32, max_model_len: int | None = None, policy: Any = "fcfs",
                 tenants: Tenants | None = None,
                 aging: float = 0.0, prefix_cache: bool = True, watermark: float = 0.0,
                 seed: int = 0, clock: Callable[[], float] = time.monotonic,
                 max_prefill_tokens_with_decodes: int | None = None,
                 decode_stall_budget: int | None = None):
        check_engine_args(num_blocks=num_blocks, block_size=block_size,
                          max_num_batched_tokens=max_num_batched_tokens,
                           max_num_seqs=max_num_seqs, max_model_len=max_model_len, seed=seed)
        if max_prefill_tokens_with_decodes is not None and (
            type(max_prefill_tokens_with_decodes) is not int or max_prefill_tokens_with_decodes < 1
        ):
            got = max_prefill_tokens_with_decodes
            raise EngineError(f"max_prefill_tokens_with_decodes={got!r}: must be None "
                              "(the whole step budget) or an integer >= 1")
        if decode_stall_budget is not None and (
            type(decode_stall_budget) is not int or decode_stall_budget < 1
        ):
            raise EngineError(f"decode_stall_budget={decode_stall_budget!r}: must be None "
                              "(no such limit) or an integer >= 1")
        self.model, self.tokenizer, self.clock, self.seed = model, tokenizer, clock, seed
        # the context: the checkpoint's, or less if asked, and never more than the whole KV cache
        # holds
        limits = [model.config.max_position, num_blocks * block_size] + (
            [max_model_len] if max_model_len else []
        )
        self.max_model_len = min(limits)
        # the data plane: model.make_runner gives an object with ModelRunner's interface (it owns
        # the KV cache)
        self.runner: ModelRunner = model.make_runner(num_blocks, block_size, kv_dtype)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_cache=prefix_cache)
        if isinstance(policy, str):
            policy = make_policy(policy, tenants, aging)
        config = SchedulerConfig(max_num_batched_tokens, max_num_seqs, self.max_model_len,
                                 watermark, max_prefill_tokens_with_decodes,
                                 decode_stall_budget)
        self.scheduler = Scheduler(self.block_manager, config, policy, tenants)
        self.requests: dict[str, Request] = {}
        self.step_log: list[StepRecord] = []
        self._next_number = 0  # numbers the requests (default ids, default random streams)
        eos = tokenizer.eos_token_ids if tokenizer is not None and tokenizer.eos_token_ids else \
            model.config.eos_token_ids
        self.eos_token_ids: tuple[int, ...] = tuple(eos)

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | dict | None = None,
                    *, tenant: str = "default", request_id: str | None = None,
                    arrival_time: float | None = None,
                    cache_salt: str | None = None, predicted_output_len: int | None = None) -> str:
        """Queue a request; returns its id. Raises ``EngineError`` and changes nothing on bad
        input."""
        req = self._new_request(prompt, _as_params(params), tenant=tenant, request_id=request_id,
                                arrival_time=arrival_time, cache_salt=cache_salt,
                                predicted_output_len=predicted_output_len)
        self._queue([req])
        return req.request_id

    def _new_request(self, prompt: str | Sequence[int], params: SamplingParams, *, tenant: str,
                     request_id: str | None, arrival_time: float | None, cache_salt: str | None,
                     predicted_output_len: int | None, pending: Sequence[Request] = ()) -> Request:
        """Check one request completely and build it, without queuing it. ``pending``: requests
        built for the same call, not queued yet. Raises ``RequestRejected``; changes nothing."""
        ids = self._prompt_ids(prompt)
        check_request_args(tenant=tenant, request_id=request_id, arrival_time=arrival_time,
                           cache_salt=cache_salt,
                            predicted_output_len=predicted_output_len)
        taken = set(self.requests) | {r.request_id for r in pending}
        number = max([self._next_number] + [r.number + 1 for r in pending])
        if request_id is None:  # a generated id never takes one a caller chose
            while str(number) in taken:
                number += 1
        request_id = str(number) if request_id is None else str(request_id)
        if request_id in taken:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        self._check_extras(params)
        if params.prompt_logprobs is not None:  # every prompt row computed: no prefix cache hit
            cache_salt = f"{cache_salt or ''}\0prompt-logprobs\0{request_id}\0{number}"
        eos = () if params.ignore_eos else self.eos_token_ids
        now = self.clock() if arrival_time is None else arrival_time
        seed = params.seed if params.seed is not None else derive_seed(self.seed, number)
        req = Request(request_id, ids, params, tenant, seed, RequestMetrics(now), number=number)
        if params.grammar is not None:
            req.constraint = self._constraint(params.grammar)
        try:
            req.seq = SchedSequence(ids, max_tokens=params.max_tokens, tenant=tenant,
                                    arrival_time=now, predicted_output_len=predicted_output_len,
                                    eos_token_id=eos[0] if eos else None,
                                    stop_token_ids=tuple(eos[1:]) + params.stop_token_ids,
                                    cache_salt=cache_salt, request=req)
            self.scheduler.check(req.seq)
        except (RequestError, SchedulerError) as e:  # includes an unknown tenant
            raise RequestRejected(f"request {request_id!r} rejected: {e}") from e
        return req

    def _check_extras(self, params: SamplingParams) -> None:
        """What the params ask beyond the sampling itself: a vocabulary's token ids, a runner that
        gives every prompt row's logits."""
        vocab = self.model.config.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise RequestRejected(f"logit_bias: token ids must be in [0, {vocab})")
        if params.prompt_logprobs is not None and not getattr(self.runner, "all_logits", False):
            raise RequestRejected("prompt_logprobs: this engine's runner gives no logits of prompt "
                                  "rows (Chunk.all_logits); ask without prompt logprobs (echo)")

    def _constraint(self, text: str) -> grammar.Constraint:
        """A request's grammar, checked against this engine's tokenizer and vocabulary."""
        if self.tokenizer is None:
            raise RequestRejected("grammar: structured output needs an engine with a tokenizer")
        try:
            ll = grammar.grammar_tokenizer(self.tokenizer, self.model.config.vocab_size)
            grammar.check(text, ll)
            return grammar.Constraint(text, ll, self.model.config.vocab_size)
        except grammar.GrammarError as e:
            raise RequestRejected(f"grammar: {e}") from None

    def _queue(self, reqs: list[Request]) -> None:
        """Queue requests that ``_new_request`` built (checked: adding them cannot fail)."""
        for req in reqs:
            self.scheduler.add(req.seq, req.metrics.arrival_time)
            self.requests[req.request_id] = req
            self._next_number = max(self._next_number, req.number + 1)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("a text prompt needs an engine with a tokenizer; pass token "
                                      "ids instead")
            ids = self.tokenizer.encode(prompt)
        # list(b"hi") would be [104, 105]: not token ids
        elif isinstance(prompt, bytes | bytearray | memoryview):
            raise RequestRejected("prompt must be a str or a list of token ids, not bytes: decode "
                                  "it to str first")
        elif (
            isinstance(prompt, np.ndarray)
            and prompt.ndim == 1
            or isinstance(prompt, list | tuple | range)
        ):
            ids = list(prompt)
            if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids):
                raise RequestRejected("prompt token ids must be integers")
            ids = [int(t) for t in ids]
        else:
            raise RequestRejected("prompt must be a str or a list of token ids, not "
                                  f"{type(prompt).__name__}")
        if not ids:
            raise RequestRejected("empty prompt: a request needs at least one token")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise RequestRejected(f"prompt of {len(ids)} tokens is too long for the context of "
                                  f"{self.max_model_len} tokens (at least one output token must "
                                  "fit)")
        return ids

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks. False if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        now = self.clock()
        self.scheduler.abort(req.seq.seq_id, now)
        req.finish_reason, req.metrics.finish_time = "abort", now
        return True

    def release(self, request_id: str) -> RequestOutput:
        """Return a finished (or aborted) request's output and forget the request.

        The engine keeps every request it was given so that ``output`` can be asked later; a server
        that runs for days calls this once it has sent the answer. An unfinished request is refused:
        abort it first.
        """
        out = self.output(request_id)
        if not self.requests[request_id].finished:
            raise EngineError(f"request {request_id!r} has not finished; abort it before releasing "
                              "it")
        del self.requests[request_id]
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping ---------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Run one scheduler step and the model on it; returns the tokens it produced."""
        started = self.clock()
        batch = self.scheduler.schedule(started)
        if not batch.entries:
            if self.has_unfinished():
                raise EngineError("the scheduler scheduled nothing although requests are waiting")
            return []
        model_started = self.clock()
        self.runner.copy_blocks(batch.block_copies)
        chunks = [Chunk(e.token_ids, e.start, e.block_table, wants_logits=e.needs_sample,
                        all_logits=_wants_prompt_rows(e)) for e in batch.entries]
        logits = self.runner.forward(chunks)
        model_time = self.clock() - model_started
        for e, ch, lg in zip(batch.entries, chunks, logits, strict=True):
            if ch.all_logits:
                _keep_prompt_logprobs(e.seq.request, e.start, lg)
        last = [lg[-1] if ch.all_logits else lg for ch, lg in zip(chunks, logits, strict=True)]
        tokens = [_sample(e.seq.request, lg, e.seq.num_tokens) if e.needs_sample else None
                  for e, lg in zip(batch.entries, last, strict=True)]
        now = self.clock()
        self.scheduler.postprocess(batch, tokens, now)
        events = []
        for e, token, lg in zip(batch.entries, tokens, last, strict=True):
            if token is None:
                continue
            req: Request = e.seq.request
            logprob = None
            if req.params.logprobs is not None:
                logprob = logprob_of(log_softmax(lg), token, req.params.logprobs)
                req.output_logprobs.append(logprob)
            req.output_token_ids.append(token)
            req.metrics.token_times.append(now)
            if e.seq.is_finished:
                req.finish_reason, req.metrics.finish_time = e.seq.finish_reason, now
            text = (
                self.tokenizer.decode([token], skip_special=True)
                if self.tokenizer is not None
                else ""
            )
            index = len(req.output_token_ids) - 1
            events.append(TokenEvent(req.request_id, token, index, now, req.finished,
                                     req.finish_reason, text, logprob,
                                     _prompt_logprobs(req) if index == 0 else None))
        self.step_log.append(StepRecord(time=now, duration=now - started, model_time=model_time,
                                        new_tokens=tuple(e.num_new_tokens for e in batch.entries),
                                        context_lens=tuple(e.context_len for e in batch.entries),
                                        is_prefill=tuple(e.is_prefill for e in batch.entries),
                                        num_sampled=sum(t is not None for t in tokens),
                                        num_preempted=len(batch.preempted)))
        return events

    def events(self) -> Iterator[TokenEvent]:
        """Step until every request has finished, yielding each token as it is produced."""
        while self.has_unfinished():
            yield from self.step()

    # -- convenience ------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], params: SamplingParams | dict | None = None,
               **kwargs: Any) -> Iterator[TokenEvent]:
        """Add one request now (bad input raises here) and return an iterator of its tokens, with
        timestamps, as they come; other requests advance too. Closing the iterator early aborts
        it."""
        return self._follow(self.add_request(prompt, params, **kwargs))

    def _follow(self, request_id: str) -> Iterator[TokenEvent]:
        req = self.requests[request_id]
        try:
            while not req.finished:
                for event in self.step():
                    if event.request_id == request_id:
                        yield event
        finally:
            self.abort(request_id)  # no-op when it finished

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | dict | None = None, **kwargs: Any) -> list[RequestOutput]:
        """Run a list of prompts to completion (continuous batching) and return their outputs in
        order.

        Every prompt and the parameters are checked before any request is queued: on bad input it
        raises ``EngineError`` and nothing is queued."""
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence | np.ndarray):
            raise RequestRejected("prompts must be a list of prompts, not "
                                  f"{type(prompts).__name__} "
                                  "(for one prompt: [prompt])")
        unknown = set(kwargs) - {"tenant", "request_id", "arrival_time", "cache_salt",
                                 "predicted_output_len"}
        if unknown:
            raise EngineError(f"generate() got unknown arguments {sorted(unknown)}")
        options = {"tenant": "default", "request_id": None, "arrival_time": None,
                   "cache_salt": None, "predicted_output_len": None} | kwargs
        params = _as_params(params)
        reqs: list[Request] = []
        for i, prompt in enumerate(prompts):
            try:
                reqs.append(self._new_request(prompt, params, pending=reqs, **options))
            except EngineError as e:
                raise type(e)(f"prompt {i}: {e}") from e
        self._queue(reqs)
        ids = [r.request_id for r in reqs]
        while not all(self.requests[i].finished for i in ids):
            self.step()
        return [self.output(i) for i in ids]

    def output(self, request_id: str) -> RequestOutput:
        req = self.requests.get(request_id) if isinstance(request_id, str) else None
        if req is None:
            raise UnknownRequestError(f"no request has the id {request_id!r}")
        text = (
            self.tokenizer.decode(req.output_token_ids, skip_special=True)
            if self.tokenizer is not None
            else ""
        )
        logprobs = list(req.output_logprobs) if req.params.logprobs is not None else None
        prompt = _prompt_logprobs(req)
        return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids), text,
                             req.finish_reason, req.tenant, req.metrics, req.seq.num_cached_tokens,
                             logprobs, list(prompt) if prompt is not None else None)


def _sample(req: Request, logits: np.ndarray, position: int) -> int:
    """The request's next token (the penalties see its prompt and output so far; a grammar, the
    tokens it allows next, and it takes the token drawn)."""
    allowed = req.constraint.allowed() if req.constraint is not None else None
    token = sample(logits, req.params, req.seed, position, req.prompt_token_ids,
                   req.output_token_ids, allowed)
    if req.constraint is not None:
        req.constraint.advance(token)
    return token


def _wants_prompt_rows(e: Any) -> bool:
    """Whether a scheduled chunk computes prompt rows whose logprobs its request wants (the row at
    position i gives the logprob of prompt token i + 1)."""
    req: Request = e.seq.request
    return req.params.prompt_logprobs is not None and e.start < len(req.prompt_token_ids) - 1


def _keep_prompt_logprobs(req: Request, start: int, rows: np.ndarray) -> None:
    """Record the logprobs of the prompt tokens that the rows of positions start.. predict (the
    first computation of a position is kept: a recomputation after preemption changes nothing)."""
    prompt, k = req.prompt_token_ids, req.params.prompt_logprobs or 0
    for r, row in enumerate(rows):
        target = start + r + 1
        if target < len(prompt) and target not in req.prompt_logprobs:
            req.prompt_logprobs[target] = logprob_of(log_softmax(row), prompt[target], k)


def _prompt_logprobs(req: Request) -> tuple[Logprob | None, ...] | None:
    """The prompt's logprobs, one per token, the first None (None: not asked)."""
    if req.params.prompt_logprobs is None:
        return None
    return (None,) + tuple(req.prompt_logprobs.get(i) for i in range(1, len(req.prompt_token_ids)))


def _as_params(params: SamplingParams | dict | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        try:
            return SamplingParams(**params)
        except TypeError as e:
            raise SamplingParamsError(f"unknown sampling parameter: {e}") from None
    raise SamplingParamsError("params must be SamplingParams, a dict or None, not "
                              f"{type(params).__name__}")
