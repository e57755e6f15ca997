"""The KV handoff over the two carriers, NIXL vs TCP: how long until a prompt's KV is all at the decode worker.

One prefill and one decode worker process (``ProcessPool``, the workers of ``python -m serve --prefill-workers 1
--decode-workers 1``: the fast engine's torch runner, ``--dtype``, one thread each), the coordinator in this
process, SmolLM2. For each carrier (``--kv-carrier tcp``: the KV values inside the frames, relayed by the
coordinator; ``nixl``: the decode worker reads them from the prefill worker's registered arena with NIXL/UCX,
the frames carry descriptors), the same prompts are sent one at a time (random token ids, a fresh prompt per
request so that no prefix cache skips any KV; the same prompts on both carriers), each with ``max_tokens`` 2.
The coordinator sees every handoff frame (prefill -> decode and back), so it timestamps, per request:

* ``handoff_s``: prompt submitted -> the decode worker's ACK(done) passes the coordinator. The decode worker
  sends it once every KV byte of the prompt is in its process: with TCP when DONE arrives (the link is
  ordered: every KV frame came before it), with NIXL once every READ has finished. It includes the prefill
  computation, which the layer-by-layer transfer overlaps.
* ``tail_s``: DONE (the prefill worker finished) -> that ACK: the transfer time left exposed after the prefill.
* ``kv_bytes`` (payload bytes of the prompt's KV on the wire dtype) and ``bytes_per_s`` = kv_bytes / (first KV
  frame or descriptor seen -> ACK(done)): the rate at which the KV reached the decode worker.

The carriers alternate ``--repeats`` times (each round starts fresh workers: tcp, nixl, then nixl, tcp, ...),
so other jobs' load falls on both alike; each round's first request (NIXL: the UCX connection is set up on the
first READ) is a warm-up, reported apart. Medians per (carrier, prompt length) across repeats and prompts.

Writes ``experiments/results/kv_carrier.json`` (with machine, date, commit).

    python -m experiments.disagg.bench_kv_carrier [--lengths 128,512,1536] [--prompts 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from reference.disagg import messages
from reference.disagg.accounting import kv_payload_size
from reference.disagg.batch import run_requests
from reference.disagg.frames import Kind
from reference.disagg.nixl_carrier import CarrierError, require_nixl
from reference.disagg.pool import ProcessPool, WorkerOptions
from reference.provenance import commit, machine, now
from reference.safe_write import write_text

RESULTS = Path(__file__).resolve().parents[1] / "results"
VOCAB = 49152  # SmolLM2's


def prompts(lengths: list[int], per_length: int, seed: int) -> list[list[int]]:
    """``per_length`` random prompts of each length (ids 1..VOCAB-1), the same for a seed."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=n).tolist() for n in lengths for _ in range(per_length)]


def run_carrier(carrier: str, todo: list[list[int]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start fresh workers on ``carrier``, send the prompts one at a time, return one timing row each."""
    opts = WorkerOptions(num_blocks=args.num_blocks, block_size=16, wire=args.wire, kv_dtype=args.dtype,
                         max_num_batched_tokens=args.max_num_batched_tokens, kv_carrier=carrier,
                         nixl_arena_mb=args.arena_mb)
    command = [sys.executable, "-m", "fast.disagg.worker", "--dtype", args.dtype, "--threads", "1"]
    pool = ProcessPool(args.model, 1, 1, opts=opts, worker_command=command, ready_timeout=300.0, lease_s=60.0)
    rows: list[dict[str, Any]] = []
    try:
        seen: dict[str, float] = {}
        size = [0]
        original = pool.coordinator.accounting.count

        def count(sender: Any, decode_node: int | None, frame: Any, when: float) -> None:
            t = time.monotonic()
            if sender.role == "prefill" and frame.kind is Kind.KV:
                seen.setdefault("first_kv", t)
                size[0] += kv_payload_size(frame.payload)[0]
            elif sender.role == "prefill" and frame.kind is Kind.DONE:
                seen.setdefault("done", t)
            elif sender.role == "decode" and frame.kind is Kind.ACK:
                if messages.load(Kind.ACK, frame.payload)["of"] == "done":
                    seen.setdefault("ack_done", t)
            original(sender, decode_node, frame, when)

        pool.coordinator.accounting.count = count  # type: ignore[method-assign]
        for i, prompt in enumerate(todo):
            seen.clear()
            size[0] = 0
            start = time.monotonic()
            result = run_requests(pool, [{"id": f"{carrier}-{i}", "prompt_token_ids": prompt, "max_tokens": 2}],
                                  timeout=600.0)[0]
            ok = result["error"] is None and {"first_kv", "done", "ack_done"} <= set(seen)
            row: dict[str, Any] = {"carrier": carrier, "prompt_tokens": len(prompt), "warmup": i == 0, "ok": ok,
                                   "error": result["error"], "kv_bytes": size[0]}
            if ok:
                row.update(first_kv_s=seen["first_kv"] - start, done_s=seen["done"] - start,
                           handoff_s=seen["ack_done"] - start, tail_s=seen["ack_done"] - seen["done"],
                           at=start,
                           bytes_per_s=size[0] / max(seen["ack_done"] - seen["first_kv"], 1e-9))
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        pool.close()
    return rows


def medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{carrier: {prompt_tokens: median handoff_s, tail_s, bytes_per_s, kv_bytes, n}} over the timed rows."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["warmup"] or not r["ok"]:
            continue
        out.setdefault(r["carrier"], {}).setdefault(str(r["prompt_tokens"]), []).append(r)
    return {c: {n: {"handoff_ms": round(1e3 * statistics.median(x["handoff_s"] for x in rs), 2),
                    "tail_ms": round(1e3 * statistics.median(x["tail_s"] for x in rs), 2),
                    "MB_per_s": round(statistics.median(x["bytes_per_s"] for x in rs) / 1e6, 1),
                    "kv_bytes": rs[0]["kv_bytes"], "n": len(rs)} for n, rs in by.items()}
            for c, by in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.disagg.bench_kv_carrier",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="the workers' model")
    p.add_argument("--lengths", default="128,512,1536", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--prompts", type=int, default=3, help="prompts per length per round")
    p.add_argument("--repeats", type=int, default=2, help="rounds; the carriers alternate within each")
    p.add_argument("--wire", default="fp32", choices=["fp32", "bf16", "fp8"], help="KV dtype on the wire")
    p.add_argument("--dtype", default="float32", help="the workers' torch dtype (and the decode cache's)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="the prefill chunk (a longer prompt is computed in several)")
    p.add_argument("--arena-mb", type=int, default=128, help="each worker's NIXL-registered arena")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--out", type=Path, default=RESULTS / "kv_carrier.json", help="the JSON written")
    a = p.parse_args(argv)
    try:
        require_nixl()
    except CarrierError as e:
        print(f"bench_kv_carrier: {e}", file=sys.stderr)
        return 2
    lengths = [int(x) for x in a.lengths.split(",") if x]
    rows: list[dict[str, Any]] = []
    for round_ in range(a.repeats):
        # a warm-up prompt first, then fresh prompts for this round (the same on both carriers)
        todo = prompts([16], 1, 10_000 + round_) + prompts(lengths, a.prompts, a.seed + round_)
        order = ("tcp", "nixl") if round_ % 2 == 0 else ("nixl", "tcp")
        for carrier in order:
            for r in run_carrier(carrier, todo, a):
                rows.append({**r, "round": round_})
    result = {
        "what": "KV handoff latency and rate, --kv-carrier nixl vs tcp (experiments/disagg/bench_kv_carrier.py)",
        "commit": commit(), "machine": machine(), "when": now(),
        "config": {"model": a.model, "lengths": lengths, "prompts_per_length": a.prompts, "repeats": a.repeats,
                   "wire": a.wire, "dtype": a.dtype, "runner": "fast.disagg.worker (torch), 1 thread per worker",
                   "max_num_batched_tokens": a.max_num_batched_tokens, "arena_mb": a.arena_mb,
                   "max_tokens": 2, "one request at a time": True},
        "medians": medians(rows),
        "rows": rows,
    }
    write_text(a.out, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["medians"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
