"""Colocated vs 1:1 disaggregated serving, measured the same way: ``serve.bench`` against ``python -m serve``.

Both endpoints run the same engine on SmolLM2 with the same scheduler settings: ``--engine reference`` (the
NumPy engine; what the stored ``serve_disagg.json`` ran) or ``--engine fast`` (the torch runner in bf16, the
server's default and its disaggregated workers' runner). Disaggregated is one prefill and one decode worker
process (``--prefill-workers 1 --decode-workers 1``), one thread each; colocated is one engine with one thread
(the same per process) and, to match the two threads in all, with two (on a loaded machine a second thread
spin-waits for a busy core).
The workload is the first ``--num-prompts`` ShareGPT prompts (cut to ``--max-prompt-chars``), streamed
chat completions, greedy, ``--max-tokens``, arriving as one seeded Poisson process at ``--request-rate``.
The setups alternate ``--repeats`` times (colocated, disaggregated, colocated, ...; the 2-thread colocated one
only in the first round) so that the load of other jobs on a shared machine falls on both alike; TTFT / ITL /
TPOT / end-to-end p50/p90/p99 and goodput at the stated SLO come from ``serve/latency.py``; CPU per output
token is the user+system CPU seconds of the server's whole process tree (server and workers) over the run,
divided by the output tokens.

Then each KV wire dtype (fp32, bf16, fp8) is run once more without timing, and every answer's text is
compared with the colocated endpoint's: the share of answers that are identical, and the mean share of the
colocated text that is reproduced before the first difference (the fp8 wire's agreement rate).

Writes ``experiments/results/serve_disagg.json`` and ``serve_disagg.png``.

    python -m experiments.disagg.bench_disagg_serve [--num-prompts 16] [--max-tokens 32] [--request-rate 1] [--repeats
    2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from reference.provenance import commit, machine, now
from reference.safe_write import write_text
from serve.bench import BenchConfig, run_bench, sharegpt_prompts

RESULTS = Path(__file__).resolve().parents[1] / "results"
REPO = Path(__file__).resolve().parents[2]
# the reference engine, colocated and in the workers, unless --engine says otherwise (``Served.engine``, set by
# main); bench_compressed_serve passes --engine fast after these
ENGINE = ["--num-blocks", "512", "--block-size", "16", "--max-num-seqs", "32", "--max-num-batched-tokens", "256"]
# one thread per process: the reference engine's BLAS threads, the fast engine's torch threads (its workers take
# OMP_NUM_THREADS, set to 1 for every server below)
SETUPS = {"colocated": ["--blas-threads", "1", "--threads", "1"],
          "colocated_2threads": ["--blas-threads", "2", "--threads", "2"],
          "disagg_fp32": ["--prefill-workers", "1", "--decode-workers", "1", "--kv-wire", "fp32"],
          "disagg_bf16": ["--prefill-workers", "1", "--decode-workers", "1", "--kv-wire", "bf16"],
          "disagg_fp8": ["--prefill-workers", "1", "--decode-workers", "1", "--kv-wire", "fp8"]}


class Served:
    """``python -m serve --model MODEL`` with the common engine settings and ``args``, on a free port."""

    engine = "reference"  # which engine every server of this run serves with (``--engine``; args may override)

    def __init__(self, args: list[str], model: str = "smollm2") -> None:
        cmd = [sys.executable, "-m", "serve", "--model", model, "--port", "0", "--log-level", "error",
               "--engine", Served.engine, *ENGINE, *args]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        if not select.select([self.proc.stdout], [], [], 300)[0]:
            self.stop()
            raise RuntimeError("the server did not start within 300 s")
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        found = re.search(r"(http://\S+)/v1", line)
        if not found:
            self.stop()
            raise RuntimeError(f"the server did not start: {line}{self.proc.stderr.read()}")  # type: ignore[union-attr]
        self.url = found.group(1)

    def cpu_s(self) -> float:
        import psutil

        root = psutil.Process(self.proc.pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def metrics(self) -> str:
        import httpx

        return httpx.get(self.url + "/metrics", timeout=30).text

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def timed(setup: str, prompts: list[str], cfg: BenchConfig, args: list[str] | None = None,
          model: str = "smollm2") -> dict:
    """One ``serve.bench`` run against a fresh server of ``setup`` (its arguments: ``args``, or ``SETUPS``)."""
    server = Served(SETUPS[setup] if args is None else args, model)
    try:
        cfg.url = server.url
        cpu0 = server.cpu_s()
        result = asyncio.run(run_bench(cfg, prompts))
        cpu = server.cpu_s() - cpu0
        worker_lines = [ln for ln in server.metrics().splitlines() if ln.startswith("unfire_disagg_")
                        and "_total{" in ln and "kv_blocks" not in ln]
    finally:
        server.stop()
    s = result["summary"]
    per_request = [{"ttft": r["ttft"], "tpot": r["tpot"], "output_tokens": r["output_tokens"]}
                   for r in result["requests"]]
    return {"setup": setup, "summary": s, "server_tree_cpu_s": cpu, "requests": per_request,
            "cpu_ms_per_output_token": 1e3 * cpu / max(1, s["output_tokens"]), "worker_metrics": worker_lines}


def answers(setup: str, prompts: list[str], max_tokens: int, args: list[str] | None = None,
            model: str = "smollm2") -> list[str]:
    """Every prompt's greedy chat answer from a fresh server of ``setup`` (8 at a time)."""
    import httpx

    server = Served(SETUPS[setup] if args is None else args, model)
    try:
        def one(p: str) -> str:
            r = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
                "model": "smollm2", "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                "temperature": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, prompts))
    finally:
        server.stop()


def agreement(ref: list[str], got: list[str]) -> dict:
    def prefix(a: str, b: str) -> float:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n / len(a) if a else 1.0

    return {"identical_answers": sum(a == b for a, b in zip(ref, got, strict=True)), "answers": len(ref),
            "identical_rate": float(np.mean([a == b for a, b in zip(ref, got, strict=True)])),
            "mean_common_prefix_share": float(np.mean([prefix(a, b) for a, b in zip(ref, got, strict=True)]))}


TIMED = ("colocated", "colocated_2threads", "disagg_fp32")
KEYS = [("ttft_ms", "p50"), ("ttft_ms", "p90"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p90"),
        ("itl_ms", "p99"), ("tpot_ms", "p50"), ("e2e_ms", "p50"), ("e2e_ms", "p90"), ("e2e_ms", "p99"),
        ("output_throughput_tok_s",), ("goodput_rps",)]


def _get(run: dict, key: tuple[str, ...]) -> float:
    v: Any = run["summary"]
    for k in key:
        v = v[k]
    return float(v)


def medians(runs: list[dict]) -> dict:
    out = {"/".join(k): float(np.median([_get(r, k) for r in runs])) for k in KEYS}
    out["cpu_ms_per_output_token"] = float(np.median([r["cpu_ms_per_output_token"] for r in runs]))
    return out


def figure(result: dict, path: Path, setups: tuple[str, ...] = TIMED, title: str | None = None) -> None:
    """TTFT / ITL / e2e percentiles and CPU per token of every setup's medians (``result["medians"]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = result["medians"]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
    shown = [s for s in setups if s in med]
    width = 0.81 / len(shown)
    for ax, metric in zip(axes[:3], ("ttft_ms", "itl_ms", "e2e_ms"), strict=True):
        x = np.arange(3)
        for i, setup in enumerate(shown):
            ax.bar(x + width * i, [med[setup][f"{metric}/{p}"] for p in ("p50", "p90", "p99")], width, label=setup)
        ax.set_xticks(x + width * (len(shown) - 1) / 2, ["p50", "p90", "p99"])
        ax.set_title(metric.replace("_ms", " (ms)"))
    axes[3].bar(shown, [med[s]["cpu_ms_per_output_token"] for s in shown], color=[f"C{i}" for i in range(len(shown))])
    axes[3].tick_params(axis="x", labelsize=7)
    axes[3].set_title("CPU ms / output token")
    axes[0].legend(fontsize=8)
    engine = result.get("engine", "reference")
    fig.suptitle(title or f"SmolLM2, {engine} engine, {result['workload']['num_prompts']} ShareGPT prompts at "
                 f"{result['workload']['request_rate']} req/s (medians of {result['workload']['repeats']} runs)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload and SLO options this benchmark and ``bench_compressed_serve`` share."""
    p.add_argument("--num-prompts", type=int, default=16, help="ShareGPT prompts per run (default 16)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--max-prompt-chars", type=int, default=600, help="prompt text cut to this length (default 600)")
    p.add_argument("--request-rate", type=float, default=1.0, help="Poisson arrivals per second (default 1.0)")
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of every setup (default 2)")
    p.add_argument("--slo-ttft-ms", type=float, default=10000.0, help="goodput's TTFT bound in ms (default 10000)")
    p.add_argument("--slo-tpot-ms", type=float, default=1000.0, help="goodput's TPOT bound in ms (default 1000)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.disagg.bench_disagg_serve",
                                description=__doc__.split("\n")[0])
    add_workload_arguments(p)
    p.add_argument("--setups", default=",".join(TIMED), help=f"which of {', '.join(TIMED)} to time")
    p.add_argument("--engine", choices=("reference", "fast"), default="fast",
                   help="the engine of every endpoint, colocated and in the workers (default fast: the server's)")
    p.add_argument("--out", type=Path, default=RESULTS / "serve_disagg.json",
                   help="results JSON (default experiments/results/serve_disagg.json; the figure beside it)")
    a = p.parse_args(argv)
    if a.num_prompts < 1 or a.max_tokens < 1 or a.repeats < 1 or not a.request_rate > 0:
        p.error("--num-prompts, --max-tokens, --repeats and --request-rate must be > 0")
    setups = set(a.setups.split(","))
    if not setups <= set(TIMED) or "colocated" not in setups or "disagg_fp32" not in setups:
        p.error(f"--setups: colocated and disagg_fp32, and optionally colocated_2threads (got {a.setups!r})")
    Served.engine = a.engine
    prompts = sharegpt_prompts(a.num_prompts, a.max_prompt_chars)
    load0 = os.getloadavg()
    started = time.time()
    runs: list[dict] = []
    for repeat in range(a.repeats):
        for setup in [t for t in TIMED if t in setups and (repeat == 0 or t != "colocated_2threads")]:
            cfg = BenchConfig(url="", num_prompts=a.num_prompts, request_rate=a.request_rate,
                              max_tokens=a.max_tokens, max_prompt_chars=a.max_prompt_chars,
                              slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms)
            runs.append(timed(setup, prompts, cfg))
            print(setup, json.dumps({k: runs[-1]["summary"][k] for k in ("completed", "failed", "duration_s")}),
                  f"{runs[-1]['cpu_ms_per_output_token']:.1f} CPU ms/token", flush=True)
    ref = answers("colocated", prompts, a.max_tokens)
    agree = {w: agreement(ref, answers(f"disagg_{w}", prompts, a.max_tokens)) for w in ("fp32", "bf16", "fp8")}
    print(json.dumps(agree), flush=True)
    result = {
        "what": "colocated vs 1:1 disaggregated serving (python -m serve) measured with serve.bench",
        "engine": a.engine, "commit": commit(), "machine": machine(), "when": now(),
        "wall_s": time.time() - started,
        "clock": "latencies: wall clock at the client (time.perf_counter, serve.bench); CPU: user+system seconds "
                 "of the server's process tree (psutil)",
        "load_average_start": load0, "load_average_end": os.getloadavg(),
        "workload": {"dataset": "sharegpt", "num_prompts": a.num_prompts, "max_tokens": a.max_tokens,
                     "max_prompt_chars": a.max_prompt_chars, "request_rate": a.request_rate, "repeats": a.repeats,
                     "greedy": True, "model": "smollm2", "engine": a.engine,
                     "setups": {k: ["--engine", a.engine, *SETUPS[k], *ENGINE] for k in SETUPS}},
        "slo": {"ttft_ms": a.slo_ttft_ms, "tpot_ms": a.slo_tpot_ms},
        "medians": {s: medians([r for r in runs if r["setup"] == s]) for s in TIMED if s in setups},
        "agreement_with_colocated": agree,
        "runs": runs,
    }
    write_text(a.out, json.dumps(result, indent=2) + "\n")
    figure(result, a.out.with_suffix(".png"))
    print(json.dumps(result["medians"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
