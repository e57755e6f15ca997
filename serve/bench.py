"""``python -m serve.bench``: a load generator for any OpenAI-compatible server (ours, vLLM, llama.cpp's).

    python -m serve.bench --url http://127.0.0.1:8000 --dataset sharegpt --num-prompts 100 \\
        --request-rate 4 [--burst] [--max-tokens 64] [--slo-ttft-ms 500 --slo-tpot-ms 100] [--out run.json]

Prompts are ShareGPT first turns (``reference/workload.py``), cut to ``--max-prompt-chars``, or the first
turns of a ShareGPT-format JSON file (``--dataset-path``: the file vLLM's ``bench serve --dataset-name
sharegpt`` reads, so both load generators can send the very same prompts), in file order. Requests
arrive as a Poisson process at ``--request-rate`` per second (``--burst``: all at once), each a
streaming chat completion (or completion) with greedy sampling and ``--max-tokens``. The server's
stream is read as server-sent events: TTFT is send to the first piece of text, ITL the gaps between
pieces, the output token count comes from the server's ``usage`` (asked for with
``stream_options.include_usage``), or else is the number of pieces. See ``serve/latency.py`` for the
summary; ``--out`` writes it as JSON with every request's numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serve.latency import RequestRecord, summarize


@dataclass
class BenchConfig:
    url: str
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "chat"  # "chat" or "completions"
    num_prompts: int = 50
    request_rate: float = float("inf")
    burst: bool = False
    max_tokens: int = 64
    max_prompt_chars: int = 1000
    ignore_eos: bool = False
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float = 600.0


def sharegpt_prompts(n: int, max_chars: int) -> list[str]:
    from reference.workload import iter_sharegpt

    prompts = [c.prompt[:max_chars] for c in iter_sharegpt(limit=n)]
    if len(prompts) < n:
        raise SystemExit(f"error: ShareGPT has only {len(prompts)} usable prompts, asked for {n}")
    return prompts


def file_prompts(path: str | Path, n: int, max_chars: int) -> list[str]:
    """The first ``n`` first turns of a ShareGPT-format JSON file: ``[{"conversations": [{"value": ...}, ...]}]``."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: --dataset-path {path}: {e}") from None
    prompts = []
    for i, entry in enumerate(data if isinstance(data, list) else []):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not (isinstance(turns, list) and turns and isinstance(turns[0], dict)
                and isinstance(turns[0].get("value"), str)):
            raise SystemExit(f"error: --dataset-path {path}: entry {i} has no conversations[0].value string")
        prompts.append(turns[0]["value"][:max_chars])
    if not isinstance(data, list) or len(prompts) < n:
        raise SystemExit(f"error: --dataset-path {path}: {len(prompts)} prompts (a JSON list of ShareGPT "
                         f"conversations), asked for {n}")
    return prompts[:n]


def arrival_times(n: int, rate: float, burst: bool, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson arrivals, or all at 0."""
    if burst or rate == float("inf"):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return list(np.cumsum(gaps) - gaps[0])


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def one_request(client: Any, cfg: BenchConfig, model: str, prompt: str) -> RequestRecord:
    body: dict[str, Any] = {"model": model, "max_tokens": cfg.max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"
    rec, times, usage = RequestRecord(), [], None
    sent = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:200]
                rec.error = f"HTTP {r.status_code}: {text}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {chunk['error'].get('message')}"
                    return rec
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if cfg.endpoint == "chat" else choice.get("text")
                    if piece:
                        times.append(time.perf_counter())
    except Exception as e:  # connection refused, reset, timeout, bad JSON: the request failed
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    end = time.perf_counter()
    if not times:
        rec.error = "no text in the answer"
        return rec
    rec.ok, rec.ttft, rec.e2e = True, times[0] - sent, end - sent
    rec.itl = list(np.diff(times))
    rec.output_tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else len(times)
    return rec


async def run_bench(cfg: BenchConfig, prompts: list[str], progress: Any = None) -> dict:
    """Send every prompt at its arrival time; return the summary, the config and per-request numbers."""
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url(cfg.url), headers=headers, timeout=cfg.timeout_s,
                                 limits=limits) as client:
        model = cfg.model
        if model is None:
            r = await client.get("/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        starts = arrival_times(len(prompts), cfg.request_rate, cfg.burst, cfg.seed)
        task = progress.add_task("requests", total=len(prompts)) if progress is not None else None
        t0 = time.perf_counter()

        async def at(start: float, prompt: str) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
            rec = await one_request(client, cfg, model, prompt)
            if progress is not None:
                progress.advance(task)
            return rec

        records = await asyncio.gather(*(at(s, p) for s, p in zip(starts, prompts, strict=True)))
        duration = time.perf_counter() - t0
    summary = summarize(records, duration, cfg.slo_ttft_ms, cfg.slo_tpot_ms)
    rate = None if cfg.request_rate == float("inf") else cfg.request_rate  # JSON has no infinity
    return {"config": {**asdict(cfg), "api_key": None, "model": model, "request_rate": rate}, "summary": summary,
            "requests": [{**asdict(r), "tpot": r.tpot} for r in records]}


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="serving benchmark")
    for col in ("metric", "mean", "p50", "p90", "p99"):
        table.add_column(col, justify="right")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row = summary[key]
        table.add_row(key, *("-" if row[k] is None else f"{row[k]:.1f}" for k in ("mean", "p50", "p90", "p99")))
    console = Console()
    console.print(table)
    console.print(f"completed {summary['completed']} failed {summary['failed']} in {summary['duration_s']:.1f} s: "
                  f"{summary['request_throughput_rps']:.2f} req/s, {summary['output_throughput_tok_s']:.1f} output "
                  f"tok/s, goodput {summary['goodput_rps']:.2f} req/s (SLO {summary['slo']})")
    for err in summary["errors"]:
        console.print(f"[red]error:[/red] {err}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve.bench", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="server address, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="chat: /v1/chat/completions (default); completions: /v1/completions")
    p.add_argument("--dataset", choices=["sharegpt"], default="sharegpt",
                   help="the packaged ShareGPT sample (default), unless --dataset-path is given")
    p.add_argument("--dataset-path", help="a ShareGPT-format JSON file whose first turns are the prompts, in order")
    p.add_argument("--num-prompts", type=int, default=50, help="requests to send (default 50)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (Poisson)")
    p.add_argument("--burst", action="store_true", help="send every request at once")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument("--max-prompt-chars", type=int, default=1000,
                   help="prompts are cut to this many characters (default 1000)")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens (vLLM's ignore_eos)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--slo-ttft-ms", type=float, help="count requests whose time to first token is within this")
    p.add_argument("--slo-tpot-ms", type=float, help="count requests whose time per output token is within this")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.num_prompts < 1 or a.max_tokens < 1 or a.max_prompt_chars < 1 or not a.request_rate > 0:
        p.error("--num-prompts, --max-tokens, --max-prompt-chars and --request-rate must be > 0")
    cfg = BenchConfig(url=a.url, model=a.model, api_key=a.api_key, endpoint=a.endpoint, num_prompts=a.num_prompts,
                      request_rate=a.request_rate, burst=a.burst, max_tokens=a.max_tokens,
                      max_prompt_chars=a.max_prompt_chars, ignore_eos=a.ignore_eos, seed=a.seed,
                      slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms, timeout_s=a.timeout)
    if a.dataset_path:
        prompts = file_prompts(a.dataset_path, a.num_prompts, a.max_prompt_chars)
    else:
        prompts = sharegpt_prompts(a.num_prompts, a.max_prompt_chars)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        try:
            result = asyncio.run(run_bench(cfg, prompts, bar))
        except Exception as e:  # the server is not there, or /v1/models is not OpenAI-shaped
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    print_summary(result["summary"])
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["summary"]["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
