"""Where an engine step's time goes at a given number of concurrent sequences (E10, gpu_engine).

``decode_load`` starts ``n`` requests at once (short distinct prompts), lets the prefill finish, then
times ``steps`` pure decode steps of all ``n`` sequences and splits each step into
  * model: the runner's forward pass (kernels / matmuls), without laying out its inputs;
  * step tensors: the runner turning the chunks into token/position/block-table/slot tensors;
  * schedule: ``Scheduler.schedule`` (admission, budget, block allocation, copy-on-write);
  * bookkeeping: the rest of ``Engine.step``: sampling, ``postprocess`` (finishing, prefix-cache
    registration), request metrics and events.
The control plane is schedule + step tensors + bookkeeping; its share is of the whole step. All
parts are measured with the engine's clock: on a shared CPU pass ``clock=time.thread_time`` (the
engine thread's CPU seconds, blind to other load; with one torch thread the model runs on it too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.engine.stats import pct


def _timed_schedule(engine: Any, spent: list[float]) -> None:
    """Wrap the engine's scheduler so each schedule() call's seconds (engine clock) are appended to ``spent``."""
    inner, clock = engine.scheduler.schedule, engine.clock

    def schedule(now: float) -> Any:
        t = clock()
        batch = inner(now)
        spent.append(clock() - t)
        return batch

    engine.scheduler.schedule = schedule


def max_tokens_for(n: int, prompt_len: int, steps: int, budget: int) -> int:
    """Output tokens each request needs so that none finishes before the timed steps are over: the
    first requests start decoding while later prompts are still being prefilled (chunked prefill)."""
    return steps + 2 + -(-n * prompt_len // budget)


def blocks_needed(n: int, prompt_len: int, steps: int, budget: int, block_size: int = 16) -> int:
    """KV blocks for ``decode_load`` to run without preemption."""
    return n * -(-(prompt_len + max_tokens_for(n, prompt_len, steps, budget)) // block_size) + 8


def decode_load(engine: Any, n: int, *, prompt_len: int = 8, steps: int = 5, vocab: int | None = None,
                seed: int = 0) -> dict[str, Any]:
    """Time ``steps`` decode steps of ``n`` concurrent sequences on ``engine`` (see the module docstring)."""
    from reference.engine import SamplingParams

    vocab = vocab or engine.model.config.vocab_size
    if hasattr(engine.runner, "clock"):
        engine.runner.clock = engine.clock  # one clock for every part of the split
    rng = np.random.default_rng(seed)
    spent: list[float] = []
    _timed_schedule(engine, spent)
    budget = engine.scheduler.config.max_num_batched_tokens
    params = SamplingParams(max_tokens=max_tokens_for(n, prompt_len, steps, budget), ignore_eos=True)
    t0 = engine.clock()
    ids = [engine.add_request(rng.integers(1, vocab, prompt_len).tolist(), params, arrival_time=t0)
           for _ in range(n)]
    while any(not engine.requests[i].output_token_ids for i in ids):  # prefill, and each one's first token
        engine.step()
    first = len(engine.step_log)
    prepare = []
    for _ in range(steps):
        engine.step()
        prepare.append(getattr(engine.runner, "prepare_time", 0.0))
    records = engine.step_log[first:]
    sched = spent[first:first + steps]
    if any(len(r.new_tokens) != n or any(r.is_prefill) for r in records):
        raise RuntimeError(f"the timed steps were not pure decode steps of {n} sequences")
    duration = np.array([r.duration for r in records])
    model = np.array([r.model_time for r in records]) - np.array(prepare)
    schedule, tensors = np.array(sched), np.array(prepare)
    bookkeeping = duration - model - tensors - schedule
    control = duration - model
    while engine.has_unfinished():  # finish the requests so the engine can be reused
        engine.step()
    ttft = [engine.requests[i].metrics.ttft for i in ids]
    return {"sequences": n, "decode_steps": steps, "tok_s": round(float(n / duration.mean()), 2),
            "step_ms": round(float(duration.mean() * 1e3), 3), "model_ms": round(float(model.mean() * 1e3), 3),
            "schedule_ms": round(float(schedule.mean() * 1e3), 3),
            "step_tensors_ms": round(float(tensors.mean() * 1e3), 3),
            "bookkeeping_ms": round(float(bookkeeping.mean() * 1e3), 3),
            "control_share": round(float(control.sum() / duration.sum()), 4),
            "ttft_ms": pct(ttft, (50, 99)), "itl_ms": pct(list(duration), (50, 99))}
