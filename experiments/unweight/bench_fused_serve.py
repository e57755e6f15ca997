"""Compressed vs plain weights served: ``python -m serve --compressed`` against ``python -m serve``.

    python -m experiments.unweight.bench_fused_serve [--batches 1 2 4 8 16 32 64] [--prefill 16] [--repeats 3]

Three servers of the fast engine on SmolLM2, each pinned to core 0 (``taskset``) with one thread:
``plain`` and ``compressed`` (every projection in the palette form in tile order), both served by the C
tile products (``fast/engine/linear.py``), and ``onednn``: plain weights through torch's oneDNN
(``UNFIRE_TILE_MATMUL=0``, the engine before the tile products). For each batch size B,
``serve.bench`` sends B ShareGPT prompts at once (streamed chat completions, greedy, exactly
``--max-tokens`` each), so after the prefills the engine decodes B sequences per step. The servers
alternate within each repeat. Reported per
server and B: output tok/s, TPOT and ITL p50, and the ratios of output tok/s (median over repeats);
each server's resident memory (VmRSS) and peak (VmHWM) after the runs; and whether plain and
compressed answered the batch's first 8 prompts, sent together, with the same text (greedy;
compression is lossless, both take the same products, and those are batch-invariant, so they must).
Prefill (``--prefill P``): P longer ShareGPT prompts (up to 2,000 characters) at once, one token each,
so the time is the prefill chunks' products; reported are the burst's wall seconds, TTFT p50 and
the ratio of plain's seconds to compressed's (higher: compressed faster). Results:
experiments/results/bench_fused_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"


SERVERS = ("plain", "compressed", "onednn")


def start(model: str, name: str, isa: str | None = None) -> tuple[subprocess.Popen, str]:
    """``python -m serve`` as the server ``name`` (one of SERVERS), as a CPU whose best instruction set is
    ``isa`` would serve (None: this CPU's best); returns the process and its URL."""
    import os

    from fast import cpu_isa

    compressed = name == "compressed"
    cmd = [sys.executable, "-m", "serve", "--model", model, "--port", "0", "--threads", "1",
           "--served-model-name", "m", "--log-level", "error", "--max-num-seqs", "64"]
    if compressed:
        cmd.append("--compressed")
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    env = dict(os.environ, UNFIRE_TILE_MATMUL="0" if name == "onednn" else "1")
    if isa:
        env |= cpu_isa.emulation_env(isa)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ready, _, _ = select.select([proc.stdout], [], [], 600)
    line = proc.stdout.readline() if ready else ""
    if " on http://" not in line:
        proc.kill()
        raise SystemExit(f"bench_fused_serve: the server did not start: {line}{proc.stderr.read()[-2000:]}")
    return proc, line.split(" on ")[1].split()[0]


def memory(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1]) / 1024  # MiB
    return out


PREFILL_CHARS = 2000  # the prefill row's prompts: ShareGPT first turns of at least 1,000 characters, cut here


def long_prompts(n: int, chars: int = PREFILL_CHARS) -> list[str]:
    """The first ``n`` ShareGPT first turns of at least ``chars // 2`` characters, cut at ``chars``."""
    from reference.workload import iter_sharegpt

    out = []
    for c in iter_sharegpt(limit=20000):
        if len(c.prompt) >= chars // 2:
            out.append(c.prompt[:chars])
            if len(out) == n:
                return out
    raise SystemExit(f"bench_fused_serve: ShareGPT has only {len(out)} prompts of {chars // 2}+ characters")


def run(url: str, batch: int, max_tokens: int, prompts: list[str] | None = None) -> dict[str, Any]:
    from serve.bench import BenchConfig, run_bench, sharegpt_prompts

    prompts = prompts or sharegpt_prompts(batch, 400)
    cfg = BenchConfig(url=url, num_prompts=len(prompts), burst=True, max_tokens=max_tokens, ignore_eos=True,
                      max_prompt_chars=max(len(q) for q in prompts))
    return asyncio.run(run_bench(cfg, prompts, None))


def answers(url: str, batch: int, max_tokens: int) -> list[str]:
    """The texts the server gives the batch's first 8 prompts, sent together (not streamed, greedy).

    Together: which rows a step multiplies then depends on arrival timing, which the tile products'
    results do not (batch-invariant); oneDNN's do (its blocking changes with the row count)."""
    import httpx

    from serve.bench import sharegpt_prompts

    async def go() -> list[str]:
        async with httpx.AsyncClient(base_url=url.rstrip("/").removesuffix("/v1") + "/v1", timeout=600) as client:
            async def one(prompt: str) -> str:
                r = await client.post("/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0})
                r.raise_for_status()
                return r.json()["choices"][0]["message"]["content"]

            return list(await asyncio.gather(*(one(q) for q in sharegpt_prompts(min(batch, 8), 400))))

    return asyncio.run(go())


def rotated(r: int) -> tuple[str, ...]:
    """The servers in the order of repeat ``r``: each repeat starts at another one."""
    return SERVERS[r % len(SERVERS):] + SERVERS[:r % len(SERVERS)]


def speed_ratios(speeds: dict[str, list[float]]) -> dict[str, float]:
    """``a_vs_b``: the median over repeats of a's speed / b's in the same repeat, for the three pairs."""
    return {f"{a}_vs_{b}": statistics.median(x / y for x, y in zip(speeds[a], speeds[b], strict=True))
            for a, b in (("compressed", "plain"), ("plain", "onednn"), ("compressed", "onednn"))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m experiments.unweight.bench_fused_serve",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a packaged name or checkpoint path (default smollm2)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                   help="streams sent at once (1 2 4 8 16 32 64)")
    p.add_argument("--prefill", type=int, default=16,
                   help="prompts of the prefill row, one token each (16; 0: no prefill row)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens each stream generates (48)")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats per batch (3)")
    p.add_argument("--isa", choices=("amx", "avx512", "avx2", "neon", "scalar"), default=None,
                   help="serve as a CPU whose best instruction set is this (UNFIRE_CPU_ISA for our kernels, "
                        "ONEDNN_MAX_CPU_ISA for oneDNN's; default: this CPU's best)")
    p.add_argument("--out", type=Path, default=None,
                   help="the JSON to write (default experiments/results/bench_fused_serve[_ISA].json)")
    args = p.parse_args(argv)
    from fast import cpu_isa
    from reference.provenance import commit, machine

    try:
        isa = cpu_isa.check(args.isa) if args.isa else cpu_isa.best()
    except cpu_isa.CpuIsaError as e:
        raise SystemExit(f"bench_fused_serve: {e}") from None
    if args.out is None:
        args.out = RESULTS / ("bench_fused_serve.json" if args.isa is None else f"bench_fused_serve_{args.isa}.json")
    print(f"bench_fused_serve: {cpu_isa.describe_cpu()}; serving as {isa} "
          f"({cpu_isa.emulation_env(isa) if args.isa else 'no cap'})", flush=True)
    servers = {name: start(args.model, name, args.isa) for name in SERVERS}
    rows, texts = [], {}
    try:
        for b in args.batches:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SERVERS}
            for r in range(args.repeats):
                for name in rotated(r):
                    runs[name].append(run(servers[name][1], b, args.max_tokens))
            row: dict[str, Any] = {"batch": b}
            for name, rs in runs.items():
                s = [r["summary"] for r in rs]
                row[name] = {"output_tok_s": statistics.median(x["output_throughput_tok_s"] for x in s),
                             "tpot_p50_ms": statistics.median(x["tpot_ms"]["p50"] for x in s),
                             "itl_p50_ms": statistics.median(x["itl_ms"]["p50"] for x in s),
                             "runs_tok_s": [x["output_throughput_tok_s"] for x in s]}
                texts[(name, b)] = answers(servers[name][1], b, args.max_tokens)
            row |= speed_ratios({n: [x["summary"]["output_throughput_tok_s"] for x in rs] for n, rs in runs.items()})
            row["same_text"] = texts[("plain", b)] == texts[("compressed", b)]
            rows.append(row)
            print(f"batch {b:3d}: " + ", ".join(f"{n} {row[n]['output_tok_s']:.1f} tok/s" for n in SERVERS)
                  + f"; compressed/plain {row['compressed_vs_plain']:.2f}x, plain/onednn "
                  f"{row['plain_vs_onednn']:.2f}x, compressed/onednn {row['compressed_vs_onednn']:.2f}x; "
                  f"same text: {row['same_text']}", flush=True)
        prefill = None
        if args.prefill:
            long = long_prompts(args.prefill)
            pruns: dict[str, list[dict[str, Any]]] = {name: [] for name in SERVERS}
            for r in range(args.repeats):
                for name in rotated(r):
                    pruns[name].append(run(servers[name][1], args.prefill, 1, long)["summary"])
            prefill = {"prompts": args.prefill, "max_prompt_chars": PREFILL_CHARS, "max_tokens": 1}
            for name, s in pruns.items():
                prefill[name] = {"seconds": statistics.median(x["duration_s"] for x in s),
                                 "ttft_p50_ms": statistics.median(x["ttft_ms"]["p50"] for x in s),
                                 "runs_s": [x["duration_s"] for x in s]}
            prefill |= speed_ratios({n: [1 / x["duration_s"] for x in rs] for n, rs in pruns.items()})
            print(f"prefill of {args.prefill} prompts: " + ", ".join(f"{n} {prefill[n]['seconds']:.2f} s"
                  for n in SERVERS) + f"; compressed/plain {prefill['compressed_vs_plain']:.2f}x, plain/onednn "
                  f"{prefill['plain_vs_onednn']:.2f}x (speed)", flush=True)
        mem = {name: memory(proc.pid) for name, (proc, _) in servers.items()}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    out = {"what": "python -m serve: plain and --compressed (tile products) and plain through oneDNN, one thread "
                   "pinned to core 0, burst of B greedy streams",
           "cpu": cpu_isa.describe_cpu(), "isa": isa, "emulated": args.isa is not None,
           "model": args.model, "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows,
           "prefill": prefill, "memory_mib": mem, "commit": commit(), "machine": machine(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"memory (MiB): {mem}; wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
