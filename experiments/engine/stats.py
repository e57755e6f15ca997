"""Shared pieces of the engine experiments (E1, E3, E8, E9): model, ShareGPT workload, runs, stats.

Not an experiment itself (its name has no claim id). The NumPy engine runs SmolLM2-135M on this
CPU, with BLAS limited to one thread (a second thread on a shared 2-core machine spin-waits and is
far slower), so the workloads are ShareGPT requests scaled down: prompts truncated, outputs capped.
Engine time is ``CpuClock``: this process's CPU seconds (result clock "cpu-process"). That keeps out
the time other jobs hold the CPU, but not their effect on caches, memory bandwidth and frequency:
rerun under other load, absolute figures moved 1.4-3x. So each timed claim leads with a ratio of two
configurations measured back to back in one run, repeated a few times, with its spread (``spread``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from reference.engine import Engine, SamplingParams
from reference.engine.cost import StepTimeModel
from reference.model.llama import LlamaModel
from reference.model.tokenizer import Tokenizer, load_tokenizer
from reference.model.weights import open_weights
from reference.workload import iter_sharegpt


class CpuClock:
    """The engine clock of these experiments: CPU seconds of this process, plus skipped idle time.

    The machine is shared (other jobs come and go), so wall-clock step times would count the time
    the neighbours hold the CPU. With BLAS on one thread, this process's CPU time excludes that, but
    the neighbours still slow the engine's own work (shared caches, memory bandwidth, frequency).
    When the engine is idle until the next arrival, ``idle_until`` moves the clock forward instead of
    sleeping. ``pause``/``resume``: several engines of one process take turns, each counting its own turns.
    """

    def __init__(self) -> None:
        self.offset = 0.0
        self.paused_at = 0.0

    def __call__(self) -> float:
        return time.process_time() + self.offset

    def idle_until(self, t: float) -> None:
        self.offset += max(0.0, t - self())

    def pause(self) -> None:
        """Stop counting (another engine of this process takes its turn) until ``resume``."""
        self.paused_at = time.process_time()

    def resume(self) -> None:
        self.offset -= time.process_time() - self.paused_at


# how the engine experiments measure time (Result.clock_detail of every engine result)
CLOCK = ("engine time = CPU seconds of the engine process (1 BLAS thread; idle gaps skipped); other load on "
         "the machine (its load average is in setup.machine) still slows the engine (caches, memory bandwidth), "
         "so absolute times vary between runs: the headline is a ratio measured within one run")


def spread(values: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """Median, min and max of a figure measured in several repeats (and the values themselves)."""
    v = [float(x) for x in values]
    return {"median": round(float(np.median(v)), digits), "min": round(min(v), digits),
            "max": round(max(v), digits), "runs": [round(x, digits) for x in v]}


def spread_text(s: dict[str, Any], unit: str = "x") -> str:
    """'1.39x (1.31-1.45 over 3 runs)'."""
    return f"{s['median']:.2f}{unit} ({s['min']:.2f}-{s['max']:.2f} over {len(s['runs'])} runs)"


def against(s: dict[str, Any], threshold: float, strict: bool = False) -> str:
    """Where a repeated ratio's spread sits against a threshold it should reach: 'clears' (every repeat
    reaches it; ``strict``: exceeds it), 'fails' (no repeat does) or 'straddles' (the spread covers it:
    within noise, the timed verdict is inconclusive). Depends only on the min and max, so not on the
    order of the repeats."""
    lo, hi = s["min"], s["max"]
    if lo > threshold or (lo == threshold and not strict):
        return "clears"
    if hi < threshold or (hi == threshold and strict):
        return "fails"
    return "straddles"


def inconclusive(name: str, s: dict[str, Any], threshold: float) -> str:
    """'inconclusive (ITL p50 ratio spread 0.98-1.02 straddles 1)'."""
    return f"inconclusive ({name} spread {s['min']:.2f}-{s['max']:.2f} straddles {threshold:g})"


@contextmanager
def one_blas_thread() -> Iterator[None]:
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1, user_api="blas"):
        yield


@functools.cache
def smollm2() -> tuple[LlamaModel, Tokenizer]:
    source = open_weights("smollm2")  # opened once for both (parsing the GGUF's fields costs ~1 CPU-s)
    return LlamaModel.load(source), load_tokenizer(source)


@dataclass(frozen=True)
class Job:
    """One request of a workload: its prompt ids and how many tokens it must generate."""

    prompt: list[int]
    output_len: int
    arrival: float = 0.0  # seconds after the start of the run
    tenant: str = "default"


def sharegpt_jobs(tokenizer: Tokenizer, n: int, max_prompt: int, max_output: int, skip: int = 0,
                  output_scale: float = 1.0) -> list[Job]:
    """The first n ShareGPT conversations (after ``skip``): prompt = the first human turn's tokens,
    truncated to ``max_prompt``; output length = the tokens of the first answer times ``output_scale``
    (rounded up), capped at ``max_output``. Scaling keeps the spread of lengths, which capping alone
    would flatten."""
    jobs = []
    for conv in iter_sharegpt(limit=n + skip):
        if skip:
            skip -= 1
            continue
        prompt = tokenizer.encode(conv.prompt)[:max_prompt]
        out = int(np.ceil(len(tokenizer.encode(conv.answer)) * output_scale))
        jobs.append(Job(prompt, max(1, min(out, max_output))))
    return jobs


def run_jobs(engine: Engine, jobs: Sequence[Job], salt_by_tenant: bool = False) -> list[Any]:
    """Feed jobs at their arrival times (engine clock) and step until all finish; outputs in job order.
    ``salt_by_tenant``: each request's prefix-cache salt is its tenant (tenants share no cached KV)."""
    steps = run_jobs_stepwise(engine, jobs, salt_by_tenant)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def run_jobs_stepwise(engine: Engine, jobs: Sequence[Job], salt_by_tenant: bool = False) -> Generator[None, None, list]:
    """``run_jobs`` one engine step (or one skip of idle time) at a time: it pauses after each, so that several
    engines can take turns; the outputs come back as the generator's return value."""
    t0 = engine.clock()
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].arrival)
    ids: dict[int, str] = {}
    k = 0
    while k < len(order) or engine.has_unfinished():
        now = engine.clock() - t0
        while k < len(order) and jobs[order[k]].arrival <= now:
            j = jobs[order[k]]
            params = SamplingParams(max_tokens=j.output_len, ignore_eos=True)
            ids[order[k]] = engine.add_request(j.prompt, params, tenant=j.tenant, arrival_time=t0 + j.arrival,
                                               cache_salt=j.tenant if salt_by_tenant else None)
            k += 1
        if engine.has_unfinished():
            engine.step()
        elif k < len(order):
            next_arrival = t0 + jobs[order[k]].arrival
            if isinstance(engine.clock, CpuClock):
                engine.clock.idle_until(next_arrival)
            else:
                time.sleep(max(0.0, next_arrival - engine.clock()))
        yield
    return [engine.output(ids[i]) for i in range(len(jobs))]


def pct(values: Sequence[float], ps: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    """Percentiles (seconds -> milliseconds), plus the mean."""
    if not len(values):
        return {f"p{p}": float("nan") for p in ps} | {"mean": float("nan")}
    v = np.asarray(values, dtype=np.float64) * 1000
    return {f"p{p}": round(float(np.percentile(v, p)), 2) for p in ps} | {"mean": round(float(v.mean()), 2)}


def calibrate(engine: Engine, skip_first: int = 1) -> StepTimeModel:
    """A step-time model fitted to the steps this engine has run (the first ones warm up caches)."""
    log = engine.step_log[skip_first:]
    return StepTimeModel.fit([r.shape() for r in log], [r.duration for r in log])
