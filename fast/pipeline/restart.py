"""``RestartingEngine``: a pipeline engine that outlives its stage processes, as the P/D endpoint does.

A stage that dies or hangs fails the step (``PipelineError``: the runner names the stage and kills every
stage process). Its KV is gone with it, so the engine over it is dropped whole; a new one is built on new
stage processes (``make_engine``), and every request that was in flight is added to it again, *migrated*
as a decode worker's requests are (``reference/disagg/coordinator.py``): its prompt is the client's prompt
plus the tokens already streamed, its budget what is left of ``max_tokens``, its seed the one it had. The
new engine recomputes that prompt and goes on; its token events are renumbered to continue the stream
(no token twice, none missing), and because the random number of the token at position i is a function
of (seed, i) only (``reference/engine/sampling.py``), a sampled request gives the tokens it would have
given without the fault. ``max_restarts`` restarts in a row without a token in between, or a restart
that cannot start its stages, end the step with ``PipelineError``: the server then ends every request
with an error event, as before.

The server's engine thread (``serve/engine_thread.py``) drives it as any engine; what it does not override
(``scheduler``, ``block_manager``, ``runner``, ``step_log``, ...) is the current engine's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fast.pipeline.chain import PipelineError
from reference.engine.request import RequestMetrics, RequestOutput, TokenEvent

log = logging.getLogger(__name__)


@dataclass
class _Before:
    """What a migrated request had before its current attempt."""

    prompt: list[int]  # the client's
    tokens: list[int] = field(default_factory=list)  # streamed before the current attempt
    times: list[float] = field(default_factory=list)
    arrival: float = 0.0


class RestartingEngine:
    """The engine interface over ``make_engine()``'s engine, rebuilt (with its requests) when a stage fails."""

    def __init__(self, make_engine: Callable[[], Any], *, max_restarts: int = 2) -> None:
        self.make_engine, self.max_restarts = make_engine, max_restarts
        self.engine = make_engine()
        self.restarts = 0  # in all (/metrics, tests)
        self._in_a_row = 0  # restarts since the last token
        self.before: dict[str, _Before] = {}

    def __getattr__(self, name: str) -> Any:  # tokenizer, scheduler, runner, max_model_len, ...
        return getattr(self.__dict__["engine"], name)

    # -- the engine interface ---------------------------------------------------------------
    def add_request(self, *args: Any, **kwargs: Any) -> str:
        return self.engine.add_request(*args, **kwargs)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[TokenEvent]:
        try:
            events = self.engine.step()
        except PipelineError as e:
            self._restart(str(e))
            return []
        if events:
            self._in_a_row = 0
        return [self._renumbered(e) for e in events]

    def output(self, request_id: str) -> RequestOutput:
        out = self.engine.output(request_id)
        b = self.before.get(request_id)
        if b is None:
            return out
        tokens = b.tokens + list(out.output_token_ids)
        tok = self.engine.tokenizer
        text = tok.decode(tokens, skip_special=True) if tok is not None else ""
        metrics = RequestMetrics(b.arrival, b.times + list(out.metrics.token_times), out.metrics.finish_time)
        return dataclasses.replace(out, prompt_token_ids=list(b.prompt), output_token_ids=tokens, text=text,
                                   metrics=metrics)

    def release(self, request_id: str) -> RequestOutput:
        out = self.output(request_id)
        self.engine.release(request_id)
        self.before.pop(request_id, None)
        return out

    def metric_lines(self) -> list[str]:
        """What ``/metrics`` adds for the pipeline (serve/engine_thread.py's snapshot reads it)."""
        return ["# HELP unfire_pipeline_restarts_total Times the stages failed (died, hung) and were restarted.",
                "# TYPE unfire_pipeline_restarts_total counter", f"unfire_pipeline_restarts_total {self.restarts}"]

    def close(self) -> None:
        self.engine.runner.close()

    # -- a restart ---------------------------------------------------------------------------
    def _renumbered(self, event: TokenEvent) -> TokenEvent:
        b = self.before.get(event.request_id)
        return event if b is None else dataclasses.replace(event, index=event.index + len(b.tokens))

    def _restart(self, reason: str) -> None:
        """Drop the failed engine, build a new one, add every request in flight to it (migrated)."""
        if self._in_a_row >= self.max_restarts:
            raise PipelineError(f"{reason} (after {self._in_a_row} restarts of the stages without progress)")
        old = self.engine
        log.warning("pipeline stage failed (%s): restarting the stages and recomputing %d requests", reason,
                    sum(not r.finished for r in old.requests.values()))
        old.runner.close()
        try:
            new = self.make_engine()
        except PipelineError as e:
            raise PipelineError(f"{reason}; restarting the stages failed: {e}") from None
        self.engine, self.restarts, self._in_a_row = new, self.restarts + 1, self._in_a_row + 1
        for rid, req in old.requests.items():
            if req.finished:
                continue
            b = self.before.setdefault(rid, _Before(list(req.prompt_token_ids), arrival=req.metrics.arrival_time))
            b.tokens += req.output_token_ids
            b.times += req.metrics.token_times
            params = dataclasses.replace(req.params, max_tokens=req.params.max_tokens - len(req.output_token_ids),
                                         seed=req.seed)  # the same stream, from where it was
            new.add_request(b.prompt + b.tokens, params, tenant=req.tenant, request_id=rid,
                            arrival_time=req.metrics.arrival_time, cache_salt=req.seq.cache_salt)
