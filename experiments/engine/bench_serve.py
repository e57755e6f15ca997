"""The HTTP layer's overhead: the load generator against our server vs the engine in-process.

Same workload both ways: the first ``--num-prompts`` ShareGPT prompts (cut to ``--max-prompt-chars``
characters, wrapped in SmolLM2's chat template), arriving as the same seeded Poisson process at
``--request-rate`` per second (or all at once with ``--burst``), greedy, exactly ``--max-tokens``
output tokens each (``ignore_eos``). The same engine settings (reference NumPy engine on SmolLM2,
one BLAS thread, SJF+WFQ) run

* in-process: a fresh Python process adds each request at its arrival time and steps the engine;
  latencies come from the engine's own token timestamps (wall clock, ``time.perf_counter``);
* served: ``python -m serve`` in a subprocess, measured by ``python -m serve.bench`` (streaming chat
  completions over HTTP, timed by the client).

The two alternate ``--repeats`` times (in-process, served, in-process, ...), each in a fresh process;
every in-process run is compared with the served run right after it (a pair), so that slow drifts in
the load from other jobs on a shared machine fall on both alike, and the result keeps every run, every
pair and the median over the pairs. Wall-clock latencies move with that load; CPU seconds per output
token of the process that runs the engine (this run's own work, whatever else runs) is the steadier
measure of what the HTTP layer adds, and the load generator's own CPU is reported beside it.
Writes ``experiments/results/serve_overhead.json``.

    python -m experiments.engine.bench_serve [--num-prompts 16] [--max-tokens 16] [--request-rate 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from reference import provenance as setup_info
from reference.safe_write import write_text
from serve.bench import BenchConfig, arrival_times, run_bench, sharegpt_prompts
from serve.latency import RequestRecord, summarize

RESULTS = Path(__file__).resolve().parents[1] / "results"
REPO = Path(__file__).resolve().parents[2]
ENGINE = {"num_blocks": 512, "block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 256}


def in_process(prompts: list[str], starts: list[float], max_tokens: int) -> dict:
    """The engine driven directly: add each request at its arrival time, step while work remains."""
    from reference.engine import Engine, SamplingParams
    from reference.model.llama import LlamaModel
    from reference.model.tokenizer import load_tokenizer
    from reference.sched import Tenants

    tok = load_tokenizer("smollm2")
    engine = Engine(LlamaModel.load("smollm2"), tok, policy="sjf+wfq", tenants=Tenants.open(),
                    clock=time.perf_counter, **ENGINE)
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    cpu0 = time.process_time()
    t0, next_i, rids = time.perf_counter(), 0, []
    while next_i < len(ids) or engine.has_unfinished():
        now = time.perf_counter()
        while next_i < len(ids) and t0 + starts[next_i] <= now:
            rids.append(engine.add_request(ids[next_i], params, arrival_time=t0 + starts[next_i]))
            next_i += 1
        if engine.has_unfinished():
            engine.step()
        elif next_i < len(ids):
            time.sleep(max(0.0, t0 + starts[next_i] - time.perf_counter()))
    duration, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    records = []
    for rid in rids:
        m = engine.output(rid).metrics
        records.append(RequestRecord(ok=True, output_tokens=len(m.token_times), ttft=m.ttft,
                                     itl=[float(g) for g in m.inter_token_latencies], e2e=m.e2e_latency))
    return {**summarize(records, duration), "engine_process_cpu_s": cpu}


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), None where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_process_fresh(a: argparse.Namespace) -> dict:
    """``in_process`` in a fresh Python process, as the server gets one (same imports, same BLAS limit)."""
    cmd = [sys.executable, "-m", "experiments.engine.bench_serve", "--in-process-worker", "--num-prompts",
           str(a.num_prompts), "--max-tokens", str(a.max_tokens), "--max-prompt-chars", str(a.max_prompt_chars),
           "--request-rate", str(a.request_rate)] + (["--burst"] if a.burst else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if out.returncode != 0:
        raise RuntimeError(f"the in-process run failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def served(prompts: list[str], cfg: BenchConfig) -> dict:
    """Start ``python -m serve`` with the same engine settings, run the load generator, stop it."""
    cmd = [sys.executable, "-m", "serve", "--model", "smollm2", "--engine", "reference", "--port", "0",
           "--log-level", "error",
           "--num-blocks", str(ENGINE["num_blocks"]), "--block-size", str(ENGINE["block_size"]),
           "--max-num-seqs", str(ENGINE["max_num_seqs"]),
           "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"])]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        if not select.select([proc.stdout], [], [], 120)[0]:
            raise RuntimeError("the server did not start within 120 s")
        line = proc.stdout.readline()
        if " on " not in line:
            raise RuntimeError(f"the server did not start: {line}{proc.stderr.read()}")
        cfg.url = line.split(" on ")[1].split()[0]
        server_cpu0, client_cpu0 = process_cpu_s(proc.pid), time.process_time()
        result = asyncio.run(run_bench(cfg, prompts))
        server_cpu1, client_cpu = process_cpu_s(proc.pid), time.process_time() - client_cpu0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if result["summary"]["failed"]:
        raise RuntimeError(f"requests failed against the server: {result['summary']['errors']}")
    cpu = None if server_cpu0 is None or server_cpu1 is None else server_cpu1 - server_cpu0
    return {**result["summary"], "engine_process_cpu_s": cpu, "client_process_cpu_s": client_cpu}


KEYS = [("output_throughput_tok_s",), ("request_throughput_rps",), ("ttft_ms", "p50"), ("ttft_ms", "p90"),
        ("itl_ms", "p50"), ("itl_ms", "p90"), ("tpot_ms", "p50"), ("e2e_ms", "p50"), ("e2e_ms", "p90")]


def _get(summary: dict, key: tuple[str, ...]) -> float:
    v: Any = summary
    for k in key:
        v = v[k]
    return float(v)


def _pair(inproc: dict, srv: dict) -> dict[str, float | None]:
    """One in-process run against the served run right after it: ratios and differences."""
    def cpu_per_token(run: dict) -> float | None:
        cpu = run.get("engine_process_cpu_s")
        return None if cpu is None else cpu / run["output_tokens"]

    a, b = cpu_per_token(inproc), cpu_per_token(srv)
    return {
        "output_throughput_ratio": srv["output_throughput_tok_s"] / inproc["output_throughput_tok_s"],
        "ttft_p50_added_ms": srv["ttft_ms"]["p50"] - inproc["ttft_ms"]["p50"],
        "itl_p50_added_ms": srv["itl_ms"]["p50"] - inproc["itl_ms"]["p50"],
        "e2e_p50_added_ms": srv["e2e_ms"]["p50"] - inproc["e2e_ms"]["p50"],
        "engine_process_cpu_per_token_ratio": None if a is None or b is None else b / a,
        "client_cpu_per_token_ms": 1e3 * srv["client_process_cpu_s"] / srv["output_tokens"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.engine.bench_serve", description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=16, help="ShareGPT prompts per run (default 16)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (default 16)")
    p.add_argument("--max-prompt-chars", type=int, default=300,
                   help="longest prompt taken, in characters (default 300)")
    p.add_argument("--request-rate", type=float, default=2.0, help="Poisson arrivals per second (default 2)")
    p.add_argument("--burst", action="store_true", help="send every request at once instead")
    p.add_argument("--repeats", type=int, default=2, help="runs of each side (default 2)")
    p.add_argument("--out", default=str(RESULTS / "serve_overhead.json"),
                   help="the results file (default experiments/results/serve_overhead.json)")
    p.add_argument("--in-process-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from rich.progress import Progress
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")  # numpy is loaded by now (serve.bench imports it)
    prompts = sharegpt_prompts(a.num_prompts, a.max_prompt_chars)
    starts = arrival_times(a.num_prompts, a.request_rate, a.burst, seed=0)
    if a.in_process_worker:
        print(json.dumps(in_process(prompts, starts, a.max_tokens)))
        return 0
    cfg = BenchConfig(url="", model="smollm2", num_prompts=a.num_prompts, request_rate=a.request_rate,
                      burst=a.burst, max_tokens=a.max_tokens, max_prompt_chars=a.max_prompt_chars, ignore_eos=True)
    runs: dict[str, list[dict]] = {"in_process": [], "served": []}
    with Progress() as bar:
        task = bar.add_task("in-process / served runs", total=2 * a.repeats)
        for _ in range(a.repeats):
            runs["in_process"].append(in_process_fresh(a))
            bar.advance(task)
            runs["served"].append(served(prompts, cfg))
            bar.advance(task)
    median = {side: {".".join(k): float(np.median([_get(s, k) for s in rs])) for k in KEYS}
              for side, rs in runs.items()}
    overhead = {"per_pair": [_pair(i, s) for i, s in zip(runs["in_process"], runs["served"], strict=True)]}
    overhead["median_of_pairs"] = {k: float(np.median([p[k] for p in overhead["per_pair"] if p[k] is not None]))
                                   for k in overhead["per_pair"][0] if any(p[k] is not None
                                                                          for p in overhead["per_pair"])}
    record = {
        "what": "HTTP serving overhead: python -m serve.bench against python -m serve vs the same engine in-process",
        "setup": {"weights": "SmolLM2-135M (packaged GGUF, Q4_1 dequantized)", "engine": "reference (NumPy)",
                  "engine_options": {**ENGINE, "policy": "sjf+wfq", "blas_threads": 1},
                  "workload": {"dataset": "ShareGPT V3 first turns", "num_prompts": a.num_prompts,
                               "max_prompt_chars": a.max_prompt_chars, "max_tokens": a.max_tokens,
                               "ignore_eos": True, "sampling": "greedy",
                               "arrivals": "all at once" if a.burst else f"Poisson, {a.request_rate}/s, seed 0"},
                  "repeats": a.repeats, "order": "alternating in-process, served; each run in a fresh process",
                  "clock": "wall clock (time.perf_counter): in-process from the engine's token timestamps, "
                           "served from the client's receipt of each streamed piece",
                  "note": "2-core machine shared with other jobs during the run: absolute numbers are disturbed; "
                          "the in-process and served runs alternate so that both see alike load",
                  "machine": setup_info.machine(), "commit": setup_info.commit(), "date": setup_info.now()},
        "clock": "wall", "clock_detail": "latencies and throughput: wall clock (time.perf_counter); "
                                          "engine_process_cpu_s: CPU seconds of the process running the engine",
        "median": median, "overhead": overhead, "runs": runs,
    }
    write_text(Path(a.out), json.dumps(record, indent=2) + "\n")
    print(json.dumps({"median": median, "overhead": overhead}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
