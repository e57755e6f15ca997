"""Unweight on the CPU: every projection product of a model, plain vs compressed, at every batch size.

    python -m experiments.unweight.bench_fused_cpu [--model smollm2] [--threads 1 2] [--repeats 5] [--quick]

For each number of rows M (1, 2, 4, 8, 16, 32, 64 and a 256-row prefill chunk) and each thread
count, the model's four projections of every layer are multiplied by random bf16 rows, alternating
within each repeat, each repeat starting at another way (the machine's noise falls on every way alike):

* ``onednn``: torch's oneDNN product on the packed weight (the plain engine with ``UNFIRE_TILE_MATMUL=0``,
  and on CPUs without AMX);
* ``engine_plain`` / ``engine_compressed``: the fast engine's matrices as they serve
  (``fast/engine/linear.py``: the C tile products at every M, AMX, batch-invariant; the compressed tiles
  decoded inside the product);
* ``avx512_plain`` / ``avx512_compressed`` (M <= 4 only): the AVX-512 BF16 tile products, which decode in
  registers; the faster at one or two rows, but not the same bits as AMX on every output, so the engine
  does not take them where AMX runs.

Also measured in the same run: this core's read bandwidth (a 512 MiB float32 sum, one thread), the
weight bytes each way streams per product set (so GB/s beside the bandwidth), and the resident
weight bytes of the plain and compressed models. Every ratio is a median over the repeats of the
per-repeat ratio. Results: experiments/results/bench_fused_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROWS = (1, 2, 4, 8, 16, 32, 64, 256)
WAYS = ("onednn", "engine_plain", "engine_compressed", "avx512_plain", "avx512_compressed")
AVX512_ROWS = 4  # the AVX-512 products take at most this many rows
RESULTS = Path(__file__).resolve().parents[1] / "results"


def read_bandwidth(repeats: int = 5) -> float:
    """GB/s of one thread summing a 512 MiB float32 array (best of ``repeats``)."""
    a = torch.ones(128 << 20, dtype=torch.float32)
    best = 1e9
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def projections(model: str, limit: int | None) -> list[torch.Tensor]:
    """The model's fused projections (qkv, o, gate_up, down of every layer) as bf16 [out, in]."""
    from reference.model.loader import load_llama
    from reference.model.weights import open_weights

    _, weights = load_llama(open_weights(model))
    out = []
    for lw in weights.layers[:limit]:
        for parts in ((lw.wq, lw.wk, lw.wv), (lw.wo,), (lw.w_gate, lw.w_up), (lw.w_down,)):
            out.append(torch.from_numpy(np.concatenate(parts).astype(np.float32)).to(torch.bfloat16))
    return out


def build(mats: list[torch.Tensor]) -> dict[str, list[Any]]:
    from fast.codec.encode import encode
    from fast.codec.matmul_c import TileWeight
    from fast.engine.linear import DenseLinear, compress, cpu_packed

    ways: dict[str, list[Any]] = {w: [] for w in WAYS}
    for w in mats:
        _, form = encode(w.contiguous(), with_palette_form=True)
        ways["onednn"].append(cpu_packed(w))
        ways["engine_plain"].append(DenseLinear(w))
        ways["engine_compressed"].append(compress(w, torch.bfloat16))
        ways["avx512_plain"].append(TileWeight.from_dense(w))
        ways["avx512_compressed"].append(TileWeight.from_palette(form))
    return ways


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m experiments.unweight.bench_fused_cpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a packaged name or checkpoint path (default smollm2)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to measure (1 2)")
    p.add_argument("--repeats", type=int, default=5, help="alternating repeats per batch size (5)")
    p.add_argument("--quick", action="store_true", help="4 layers, 3 repeats, one thread (about a minute)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_fused_cpu.json", help="the JSON to write")
    args = p.parse_args(argv)
    from fast.codec import matmul_c

    if not matmul_c.available():
        raise SystemExit("bench_fused_cpu: this CPU lacks AVX-512 BF16 or AMX (or no C compiler): the tile "
                         "products do not run here")
    out = measure(args.model, 4 if args.quick else None, [1] if args.quick else args.threads,
                  3 if args.quick else args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    plot(out, args.out.with_suffix(".png"))
    print(f"read bandwidth (one thread) {out['read_bandwidth_gbps_one_thread']:.1f} GB/s; wrote {args.out}")
    return out


def measure(model: str, limit: int | None, threads: list[int], repeats: int, rows_list: tuple[int, ...] = ROWS,
            verbose: bool = True) -> dict[str, Any]:
    """The benchmark's record (see the module docstring); ``limit`` layers (None: all)."""
    from fast.codec.matmul_c import GEMV
    from fast.engine.linear import _packed_linear
    from reference.provenance import commit, machine

    torch.set_num_threads(1)
    bandwidth = read_bandwidth()
    mats = projections(model, limit)
    ways = build(mats)
    nbytes = {"plain_bf16": sum(w.numel() * 2 for w in mats),
              "engine_plain": sum(d.nbytes() for d in ways["engine_plain"]),
              "engine_compressed": sum(c.nbytes() for c in ways["engine_compressed"])}
    widths = sorted({w.shape[1] for w in mats})
    rows: list[dict[str, Any]] = []
    for nt in threads:
        torch.set_num_threads(nt)
        for m in rows_list:
            xs = {k: torch.randn((m, k)).to(torch.bfloat16) for k in widths}
            keyed = {way: [(o, w.shape[1]) for o, w in zip(objs, mats, strict=True)] for way, objs in ways.items()}
            now = [w for w in WAYS if m <= AVX512_ROWS or not w.startswith("avx512")]
            times: dict[str, list[float]] = {w: [] for w in now}
            for r in range(repeats + 1):  # the first pass warms caches and buffers, not recorded
                # each repeat starts at another way: none always runs right after oneDNN, whose OpenMP
                # threads spin for a while after each call (with 2 threads they would slow the next way)
                for way in now[r % len(now):] + now[:r % len(now)]:
                    t = time.perf_counter()
                    for o, k in keyed[way]:
                        x = xs[k]
                        if way == "onednn":
                            _packed_linear(x, o)
                        elif way.startswith("avx512"):
                            o.matmul(x, path=GEMV, threads=nt)
                        else:
                            o(x)
                    if r:
                        times[way].append(time.perf_counter() - t)
            row = {"threads": nt, "rows": m, "ms": {w: 1e3 * statistics.median(v) for w, v in times.items()},
                   "ms_min": {w: 1e3 * min(v) for w, v in times.items()}}
            pairs = [("engine_compressed", "engine_plain"), ("engine_plain", "onednn"), ("engine_compressed", "onednn")]
            if m <= AVX512_ROWS:
                pairs += [("avx512_compressed", "onednn"), ("avx512_compressed", "avx512_plain")]
            for a, b in pairs:
                row[f"{a}_vs_{b}"] = statistics.median(y / x for x, y in zip(times[a], times[b], strict=True))
            row["gbps_engine_compressed"] = (nbytes["engine_compressed"] / (row["ms_min"]["engine_compressed"] / 1e3)
                                             / 1e9)
            row["gbps_onednn"] = nbytes["plain_bf16"] / (row["ms_min"]["onednn"] / 1e3) / 1e9
            rows.append(row)
            if verbose:
                print(f"threads {nt} rows {m:3d}: " + "  ".join(f"{w} {row['ms'][w]:.1f}" for w in now)
                  + f"  | engine comp/plain speed {row['engine_compressed_vs_engine_plain']:.2f}x"
                      + f"  plain/onednn {row['engine_plain_vs_onednn']:.2f}x"
                      + f"  compressed GB/s {row['gbps_engine_compressed']:.1f}", flush=True)
    return {"what": "projection products of every layer, plain vs compressed (speed ratios: >1 = faster)",
            "model": model, "layers": limit or "all", "matrices": len(mats), "repeats": repeats,
            "read_bandwidth_gbps_one_thread": bandwidth, "weight_bytes": nbytes, "rows": rows,
            "commit": commit(), "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "note": "ratio a_vs_b = time(b) / time(a), the median over repeats of the per-repeat ratio"}


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for nt in sorted({r["threads"] for r in out["rows"]}):
        rs = [r for r in out["rows"] if r["threads"] == nt]
        ms = [r["rows"] for r in rs]
        for way, style in (("onednn", "k-"), ("engine_plain", "b-"), ("engine_compressed", "r-"),
                           ("avx512_compressed", "r:")):
            have = [r for r in rs if way in r["ms"]]
            axes[0].plot([r["rows"] for r in have], [r["ms"][way] for r in have], style, marker="o",
                         alpha=1 if nt == 1 else 0.5, label=f"{way}, {nt} thr")
        axes[1].plot(ms, [r["engine_compressed_vs_engine_plain"] for r in rs], "r-", marker="o",
                     label=f"engine compressed / plain speed, {nt} thr")
        axes[1].plot(ms, [r["engine_plain_vs_onednn"] for r in rs], "b-", marker="o",
                     label=f"engine plain / oneDNN speed, {nt} thr")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows per product (batch)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("ms per product set (every projection)")
    axes[1].axhline(1, color="gray", lw=0.5)
    axes[1].set_ylabel("speed ratio")
    fig.suptitle(f"{out['model']}: {out['matrices']} matrices; one-thread read bandwidth "
                 f"{out['read_bandwidth_gbps_one_thread']:.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
