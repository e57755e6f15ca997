"""Serving head to head: ``vllm serve`` and ``python -m serve --engine fast``, under the same load generators.

    python -m experiments.engine.bench_serve_vllm [--vllm-python PY] [--cpus 0] [--client-cpus 1] \\
        [--ours 256,2048,2048/256] [--vllm-budget 2048] [--num-prompts 16] [--input-len 128] [--max-tokens 32]

Each server runs on the same cores (``taskset -c --cpus``, both at the same ``nice``), serves the same
weights (SmolLM2-135M's GGUF; vLLM gets it as a Hugging Face folder of the very bf16 tensors our engine
runs, with the same tokenizer) and gets the same workload: ``--num-prompts`` prompts of ``--input-len``
random token ids (seeded, decoded to text, as vLLM's own ``random`` dataset makes them), all sent at
once, ``/v1/completions``, greedy, exactly ``--max-tokens`` output tokens each (``ignore_eos``). The
load generators run on other cores (``--client-cpus``).

Every server start gets a warm-up pass, then measured passes (``--passes`` of each client, taking
turns), each on fresh prompts of the same shape (another seed: no prefix-cache hit on a pass before
it), the same seeds on every server:

1. ``python -m serve.bench`` (this project's load generator);
2. ``vllm bench serve`` (vLLM's own client), fed the same prompt file (``--dataset-name sharegpt
   --disable-shuffle``). A peer's load generator is a real client: on the same server the two must
   agree, and the result reports by how much they do (output tok/s, TTFT, TPOT, ITL p50/p99), with
   both summaries computed the same way (``serve/latency.py``) from each client's per-request times;
   vLLM's own printed summary is kept beside.

Our server runs at each ``--ours`` setting: ``B`` is ``--max-num-batched-tokens B``; ``B/C`` adds
``--max-prefill-tokens-with-decodes C`` (a step that carries decodes takes at most C prompt tokens);
``B/C/S`` or ``B//S`` adds ``--decode-stall-budget S`` (with d decodes, at most S // d prompt tokens);
a suffix ``+gMS`` (e.g. ``2048/256+g30``) adds ``--burst-gather-ms MS`` (an idle engine's first step
waits up to MS ms for the rest of a burst).
The servers alternate over ``--repeats`` rounds (ours first in odd rounds, vLLM first in even ones) so
load drifts hit both. CPU seconds per output token are those of each server's whole process tree
(vLLM's API server and its engine-core process; ours is one process) over the measured pass. The
machine's load average is recorded with every pass. Without ``--vllm-python`` (or $UNFIRE_VLLM_PYTHON)
only our server runs, under ``serve.bench`` alone: vLLM is never needed (nor run in CI).
Writes ``experiments/results/bench_serve_vllm.json`` and a figure beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from reference import provenance as setup_info
from reference.safe_write import write_text
from serve.latency import RequestRecord, summarize

RESULTS = Path(__file__).resolve().parents[1] / "results"
REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
METRICS = (("output_throughput_tok_s",), ("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"),
           ("tpot_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99"))


# -- the workload ------------------------------------------------------------------------------------

def random_prompts(tokenizer: Any, n: int, input_len: int, seed: int) -> list[str]:
    """``n`` texts, each the decode of ``input_len`` random token ids (no special tokens), seeded."""
    rng = np.random.default_rng(seed)
    special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
    return [tokenizer.decode([vocab[i] for i in rng.integers(0, len(vocab), size=input_len)]) for _ in range(n)]


def write_prompt_file(prompts: Sequence[str], path: Path) -> Path:
    """The prompts as a ShareGPT-format JSON file: what ``serve.bench --dataset-path`` and vLLM's
    ``bench serve --dataset-name sharegpt`` both read (the second turn only satisfies vLLM's loader)."""
    data = [{"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "ok"}]}
            for i, p in enumerate(prompts)]
    path.write_text(json.dumps(data))
    return path


def write_model_folder(folder: Path) -> Path:
    """A Hugging Face folder of SmolLM2's tensors in bf16 (``engine_baselines.write_hf_folder``) and its
    tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the chat template): what ``vllm serve``
    and ``vllm bench serve --tokenizer`` load, offline."""
    from experiments.engine.engine_baselines import write_hf_folder
    from reference.model.loader import load_llama
    from reference.model.tokenizer import load_tokenizer

    config, weights = load_llama(MODEL)
    write_hf_folder(config, weights, folder)
    tok = load_tokenizer(MODEL)
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
         "chat_template": tok.chat_template, "model_max_length": config.max_position}))
    return folder


# -- process trees and servers -----------------------------------------------------------------------

def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (psutil)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> float:
    """Poll ``url`` until it answers 200; seconds it took. Raises with the log's tail if the server exits."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready; its log ends:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        time.sleep(1.0)
    raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s (log: {log})")


@contextlib.contextmanager
def server(kind: str, setting: str, a: argparse.Namespace, model_dir: Path | None, workdir: Path) -> Iterator[dict]:
    """Start one server (``kind`` "ours" or "vllm") pinned to ``--cpus``; yields its pid, url, start-up time."""
    port = free_port()
    threads = str(len(a.cpus.split(",")))
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": threads}
    if kind == "ours":
        base, gather = split_gather(setting)
        budget, cap, stall = parse_setting(base)
        cmd = [sys.executable, "-m", "serve", "--model", MODEL, "--engine", "fast", "--port", str(port),
               "--threads", threads, "--max-num-batched-tokens", str(budget), "--max-num-seqs", str(a.max_num_seqs)]
        cmd += ["--max-prefill-tokens-with-decodes", str(cap)] if cap else []
        cmd += ["--decode-stall-budget", str(stall)] if stall else []
        cmd += ["--burst-gather-ms", str(gather)] if gather else []
    else:
        assert model_dir is not None
        env |= {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": a.cpus.replace(",", "|") if "," in a.cpus else a.cpus}
        cmd = [a.vllm_python, "-m", "experiments.engine.vllm_cli", "serve", str(model_dir), "--served-model-name",
               MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "2048",
               "--max-num-batched-tokens", setting, "--max-num-seqs", str(a.max_num_seqs),
               "--gpu-memory-utilization", str(a.vllm_memory_fraction), "--disable-log-stats"]
    log = workdir / f"{kind}-{setting.replace('/', '_')}-{port}.log"
    with pinned_process(cmd, env, a, log, f"http://127.0.0.1:{port}/health") as srv:
        yield {**srv, "url": f"http://127.0.0.1:{port}"}


@contextlib.contextmanager
def pinned_process(cmd: list[str], env: dict[str, str], a: argparse.Namespace, log: Path, health: str,
                   cwd: Path | None = None) -> Iterator[dict]:
    """Start a server in its own session (vLLM's engine-core process, P/D's workers go with it), pinned to
    ``--cpus`` at ``--nice``; yields its pid and start-up time once ``health`` answers 200; stops the session."""
    with log.open("w") as f:
        proc = subprocess.Popen(["taskset", "-c", a.cpus, "nice", "-n", str(a.nice), *cmd], env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
    try:
        started = wait_ready(proc, health, log, a.startup_timeout)
        yield {"pid": proc.pid, "startup_s": round(started, 1), "log": log}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def split_gather(setting: str) -> tuple[str, float | None]:
    """``B/C+gMS`` as (``B/C``, MS); a setting without the suffix as (setting, None)."""
    base, sep, ms = setting.partition("+g")
    if not sep:
        return setting, None
    value = float(ms)  # ValueError if not a number
    if not 0 < value <= 1000:
        raise ValueError(setting)
    return base, value


def parse_setting(setting: str) -> tuple[int, int | None, int | None]:
    """``B``, ``B/C``, ``B/C/S`` or ``B//S`` as (budget, prefill cap beside decodes, decode stall budget)."""
    parts = setting.split("/")
    if not 1 <= len(parts) <= 3 or not parts[0]:
        raise ValueError(setting)
    budget, cap, stall = int(parts[0]), *(int(x) if x else None for x in (parts[1:] + ["", ""])[:2])
    if budget < 1 or any(x is not None and x < 1 for x in (cap, stall)):
        raise ValueError(setting)
    return budget, cap, stall


# -- the two load generators -------------------------------------------------------------------------

def run_ours_client(url: str, prompt_file: Path, a: argparse.Namespace, out: Path) -> list[RequestRecord]:
    """``python -m serve.bench`` on ``--client-cpus``; its per-request records."""
    cmd = ["taskset", "-c", a.client_cpus, sys.executable, "-m", "serve.bench", "--url", url, "--model", MODEL,
           "--endpoint", "completions", "--dataset-path", str(prompt_file), "--num-prompts", str(a.num_prompts),
           "--burst", "--max-tokens", str(a.max_tokens), "--max-prompt-chars", "1000000", "--ignore-eos",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"serve.bench failed ({done.returncode}): {done.stderr[-1500:]}{done.stdout[-1500:]}")
    reqs = json.loads(out.read_text())["requests"]
    return [RequestRecord(ok=r["ok"], output_tokens=r["output_tokens"], ttft=r["ttft"], itl=r["itl"], e2e=r["e2e"],
                          error=r["error"]) for r in reqs]


def run_vllm_client(url: str, prompt_file: Path, model_dir: Path, a: argparse.Namespace,
                    out: Path) -> tuple[list[RequestRecord], dict[str, Any]]:
    """``vllm bench serve`` on ``--client-cpus``, the same prompts; its per-request records and its own summary."""
    cmd = ["taskset", "-c", a.client_cpus, a.vllm_python, "-m", "experiments.engine.vllm_cli", "bench", "serve",
           "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", MODEL,
           "--tokenizer", str(model_dir), "--dataset-name", "sharegpt", "--dataset-path", str(prompt_file),
           "--disable-shuffle", "--sharegpt-output-len", str(a.max_tokens), "--num-prompts", str(a.num_prompts),
           "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--percentile-metrics",
           "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result", "--save-detailed",
           "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"]
    env = os.environ | {"PYTHONPATH": str(REPO), "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
                        "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {done.stdout[-1500:]}{done.stderr[-1500:]}")
    r = json.loads(out.read_text())
    records = []
    for ttft, itl, n, err in zip(r["ttfts"], r["itls"], r["output_lens"], r["errors"], strict=True):
        ok = not err and ttft is not None and ttft > 0
        records.append(RequestRecord(ok=ok, output_tokens=int(n or 0), ttft=ttft if ok else None,
                                     itl=list(itl or []), e2e=ttft + sum(itl or []) if ok else None,
                                     error=err or None))
    own = {k: r[k] for k in ("duration", "completed", "total_output_tokens", "output_throughput", "median_ttft_ms",
                             "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")
           if k in r}
    return records, own


def duration_of(records: Sequence[RequestRecord], wall_s: float) -> float:
    """A burst's duration: from the common send to the last answer (the longest e2e), else the wall time."""
    ends = [r.e2e for r in records if r.ok and r.e2e is not None]
    return max(ends) if ends else wall_s


# -- one measured pass -------------------------------------------------------------------------------

def measured_pass(srv: dict, client: str, prompt_file: Path, a: argparse.Namespace, model_dir: Path | None,
                  workdir: Path, tag: str) -> dict[str, Any]:
    """One pass of ``client`` against a running server: the summary, the server tree's CPU, the load."""
    load0, cpu0, t0 = os.getloadavg(), tree_cpu_s(srv["pid"]), time.perf_counter()
    own = None
    if client == "serve.bench":
        records = run_ours_client(srv["url"], prompt_file, a, workdir / f"{tag}.json")
    else:
        assert model_dir is not None
        records, own = run_vllm_client(srv["url"], prompt_file, model_dir, a, workdir / f"{tag}.json")
    wall, cpu = time.perf_counter() - t0, tree_cpu_s(srv["pid"]) - cpu0
    summary = summarize(records, duration_of(records, wall))
    if summary["failed"]:
        raise RuntimeError(f"{client}: {summary['failed']} requests failed: {summary['errors']}")
    out = {"client": client, "summary": _slim(summary),
           "server_cpu_s": round(cpu, 3),
           "server_cpu_ms_per_output_token": round(1e3 * cpu / summary["output_tokens"], 2),
           "load_average": [round(load0[0], 2), round(os.getloadavg()[0], 2)]}
    if own is not None:
        out["vllm_bench_own_summary"] = own
    return out


def _slim(summary: dict) -> dict:
    keep = ("completed", "duration_s", "output_tokens", "output_throughput_tok_s", "ttft_ms", "tpot_ms", "itl_ms",
            "e2e_ms")
    return {k: summary[k] for k in keep}


def _get(summary: dict, key: tuple[str, ...]) -> float:
    v: Any = summary
    for k in key:
        v = v[k]
    return float(v)


def agreement(ours: dict, peer: dict) -> dict[str, float]:
    """vllm bench serve's numbers over serve.bench's, on the same server (1.0: they agree)."""
    return {".".join(k): round(_get(peer, k) / _get(ours, k), 3) for k in METRICS if _get(ours, k) > 0}


# -- the run -----------------------------------------------------------------------------------------

def run(a: argparse.Namespace, on_entry: Any = None) -> dict[str, Any]:
    """Every server at every round; ``on_entry(runs)`` after each server's passes (to save as it goes)."""
    from reference.model.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL)
    with_vllm_server = a.vllm_python and not a.no_vllm_server
    servers = [("ours", s) for s in a.ours] + ([("vllm", str(a.vllm_budget))] if with_vllm_server else [])
    runs: dict[str, list[dict]] = {f"{k}@{s}": [] for k, s in servers}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="unfire-serve-vllm-") as tmp:
        workdir = Path(tmp)
        files = [write_prompt_file(random_prompts(tok, a.num_prompts, a.input_len, a.seed + k), workdir / f"p{k}.json")
                 for k in range(1 + 2 * a.passes)]  # warm-up, then serve.bench and vllm bench serve passes in turn
        model_dir = write_model_folder(workdir / "hf") if a.vllm_python else None
        for rnd in range(a.repeats):
            order = servers if rnd % 2 == 0 else servers[::-1]
            for kind, setting in order:
                name = f"{kind}@{setting}"
                print(f"round {rnd + 1}/{a.repeats}: {name} starting", flush=True)
                tag = f"{kind}-{setting.replace('/', '_')}-{rnd}"  # a file name
                with server(kind, setting, a, model_dir, workdir) as srv:
                    run_ours_client(srv["url"], files[0], a, workdir / f"{tag}-warmup.json")
                    passes = []
                    for j in range(a.passes):
                        passes.append(measured_pass(srv, "serve.bench", files[1 + 2 * j], a, model_dir, workdir,
                                                    f"{tag}-{j}-ours"))
                        if a.vllm_python:
                            passes.append(measured_pass(srv, "vllm bench serve", files[2 + 2 * j], a, model_dir,
                                                        workdir, f"{tag}-{j}-vllm"))
                    entry = {"round": rnd, "startup_s": srv["startup_s"], "passes": passes}
                    if a.vllm_python:
                        entry["vllm_bench_over_serve_bench"] = [
                            agreement(passes[i]["summary"], passes[i + 1]["summary"]) for i in range(0, len(passes), 2)]
                    runs[name].append(entry)
                    print(f"  {name}: " + "; ".join(_line(p) for p in passes), flush=True)
                if on_entry is not None:
                    on_entry(runs)
    return {"runs": runs, "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()]}


def _line(p: dict) -> str:
    s = p["summary"]
    return (f"{p['client']}: {s['output_throughput_tok_s']:.1f} tok/s, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
            f"ITL p50/p99 {s['itl_ms']['p50']:.0f}/{s['itl_ms']['p99']:.0f} ms, "
            f"{p['server_cpu_ms_per_output_token']:.1f} CPU-ms/token, load {p['load_average'][0]}")


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per server and client: the median over rounds of each metric, and of CPU-ms per output token."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, entries in runs.items():
        by_client: dict[str, list[dict]] = {}
        for e in entries:
            for p in e["passes"]:
                by_client.setdefault(p["client"], []).append(p)
        out[name] = {c: {".".join(k): round(float(np.median([_get(p["summary"], k) for p in ps])), 1)
                         for k in METRICS} | {"server_cpu_ms_per_output_token": round(float(np.median(
                             [p["server_cpu_ms_per_output_token"] for p in ps])), 2)}
                     for c, ps in by_client.items()}
    return out


def figure(result: dict, path: Path) -> Path:
    """Output tok/s, TTFT p50, ITL p99 and CPU-ms per token of each server (medians), one bar per client."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = result["median"]
    names = list(med)
    clients = sorted({c for m in med.values() for c in m})
    panels = [("output_throughput_tok_s", "output tok/s"), ("ttft_ms.p50", "TTFT p50 (ms)"),
              ("itl_ms.p99", "ITL p99 (ms)"), ("server_cpu_ms_per_output_token", "server CPU-ms / output token")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    width = 0.8 / max(1, len(clients))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for j, c in enumerate(clients):
            xs = [i + j * width for i, n in enumerate(names) if c in med[n]]
            ys = [med[n][c][key] for n in names if c in med[n]]
            ax.bar(xs, ys, width, label=c)
        ax.set_xticks([i + width * (len(clients) - 1) / 2 for i in range(len(names))], names, rotation=30,
                      ha="right", fontsize=8)
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    loads = [x for es in result["runs"].values() for e in es for p in e["passes"] for x in p["load_average"]]
    fig.suptitle(f"{result['setup']['workload']}; servers on cores {result['setup']['servers_on_cpus']}; medians of "
                 f"{result['setup']['repeats']} rounds; load average {min(loads):.0f}-{max(loads):.0f}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def resolve_cpus(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``--cpus`` checked; ``--client-cpus`` defaulted to the machine's cores not in ``--cpus`` (else ``--cpus``)."""
    try:
        cpus = {int(c) for c in a.cpus.split(",")}
    except ValueError:
        p.error(f"--cpus {a.cpus!r}: a comma-separated list of core numbers")
    if a.client_cpus is None:
        rest = sorted(set(os.sched_getaffinity(0)) - cpus)
        a.client_cpus = ",".join(map(str, rest)) if rest else a.cpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.engine.bench_serve_vllm",
                                description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", default=os.environ.get("UNFIRE_VLLM_PYTHON"),
                   help="python of an environment with vllm-cpu (default $UNFIRE_VLLM_PYTHON; without it only our "
                        "server runs, under serve.bench)")
    p.add_argument("--cpus", default="0", help="cores both servers are pinned to (taskset), e.g. 0 or 0,1 (default 0)")
    p.add_argument("--client-cpus", default=None,
                   help="cores the load generators run on (default: the machine's cores not in --cpus, else --cpus)")
    p.add_argument("--ours", default="256,2048,2048/256",
                   help="our server's settings, comma-separated: B (--max-num-batched-tokens B) or B/C (and "
                        "--max-prefill-tokens-with-decodes C), B/C/S or B//S (and --decode-stall-budget S), "
                        "any of them +gMS (and --burst-gather-ms MS); default 256,2048,2048/256")
    p.add_argument("--vllm-budget", type=int, default=2048,
                   help="vLLM's --max-num-batched-tokens (default 2048: its own default for a CPU server)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences per step, both servers (default 32)")
    p.add_argument("--vllm-memory-fraction", type=float, default=0.12,
                   help="vLLM's --gpu-memory-utilization: the share of RAM its CPU build keeps for KV (default 0.12)")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per pass, all sent at once (default 16)")
    p.add_argument("--input-len", type=int, default=128, help="random token ids per prompt (default 128)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="output tokens per request, end token ignored (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (passes use seed, seed+1, seed+2)")
    p.add_argument("--repeats", type=int, default=1, help="rounds over every server, alternating order (default 1)")
    p.add_argument("--passes", type=int, default=1,
                   help="measured passes of each client per server start, the clients taking turns (default 1)")
    p.add_argument("--no-vllm-server", action="store_true",
                   help="with --vllm-python: run vLLM's client against our server only, not vLLM's server")
    p.add_argument("--nice", type=int, default=10, help="niceness of both servers (default 10: a shared machine)")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds a server may take to start (default 900: vLLM compiles at start-up)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_serve_vllm.json",
                   help="results file (default experiments/results/bench_serve_vllm.json; the figure beside it)")
    a = p.parse_args(argv)
    try:
        settings = [s.strip() for s in a.ours.split(",") if s.strip()]
        for s in settings:
            parse_setting(split_gather(s)[0])
    except ValueError:
        p.error(f"--ours {a.ours!r}: settings are B, B/C, B/C/S or B//S with integers >= 1, "
                "each optionally +gMS (0 < MS <= 1000), comma-separated")
    a.ours = settings
    for name in ("num_prompts", "input_len", "max_tokens", "repeats", "passes", "max_num_seqs", "vllm_budget"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    resolve_cpus(p, a)
    if a.vllm_python is not None and not Path(a.vllm_python).exists():
        p.error(f"--vllm-python {a.vllm_python}: no such file")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)

    def partial(runs: dict[str, list[dict]]) -> None:  # a crash later keeps what was measured
        write_text(a.out.with_suffix(".partial.json"), json.dumps({"setup": setup, "runs": runs}, indent=1) + "\n")

    setup = {"weights": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized; bf16 in both servers)",
             "workload": (f"{a.num_prompts} prompts of {a.input_len} random token ids, {a.max_tokens} output tokens "
                          "each (ignore_eos, greedy), all at once, /v1/completions, streamed"),
             "servers_on_cpus": a.cpus, "clients_on_cpus": a.client_cpus, "nice": a.nice,
             "ours": {s: dict(zip(("max_num_batched_tokens", "max_prefill_tokens_with_decodes",
                                   "decode_stall_budget"), parse_setting(split_gather(s)[0]), strict=True))
                       | {"burst_gather_ms": split_gather(s)[1]} for s in a.ours},
             "vllm": {"max_num_batched_tokens": a.vllm_budget, "python": a.vllm_python,
                      "server": not a.no_vllm_server} if a.vllm_python else None,
             "max_num_seqs": a.max_num_seqs, "repeats": a.repeats, "passes": a.passes, "machine": setup_info.machine(),
             "commit": setup_info.commit(), "date": setup_info.now()}
    measured = run(a, partial)
    result = {"experiment": "bench_serve_vllm", "setup": setup, **measured, "median": medians(measured["runs"])}
    result["figures"] = [figure(result, a.out.with_suffix(".png")).name]
    write_text(a.out, json.dumps(result, indent=1) + "\n")
    a.out.with_suffix(".partial.json").unlink(missing_ok=True)
    print(json.dumps(result["median"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
