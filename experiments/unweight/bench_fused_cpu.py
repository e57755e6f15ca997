"""Unweight on the CPU: every projection product of a model, plain vs compressed, at every batch size, on
every instruction set this CPU can execute.

    python -m experiments.unweight.bench_fused_cpu [--model smollm2] [--threads 1 2] [--repeats 5] [--quick]
                                                   [--isas amx avx512 avx2]

For each number of rows M (1, 2, 4, 8, 16, 32, 64 and a 256-row prefill chunk) and each thread
count, the model's four projections of every layer are multiplied by random bf16 rows, alternating
within each repeat, each repeat starting at another way (the machine's noise falls on every way alike):

* ``onednn``: torch's oneDNN product on the packed weight (the plain engine with ``UNFIRE_TILE_MATMUL=0``);
* ``engine_plain`` / ``engine_compressed``: the fast engine's matrices as they serve (``fast/engine/linear.py``:
  the C tile products of the instruction set in force, ``UNFIRE_CPU_ISA`` or the best this CPU has, at every M;
  the compressed tiles decoded inside the product);
* ``<isa>_plain`` / ``<isa>_compressed`` for every other instruction set of ``--isas`` (default: every one this
  CPU can execute but scalar): the same products forced to that ISA's path, so one run on an AMX machine also
  measures what an AVX-512 BF16 machine (AMD Zen 4/5) and an AVX2 laptop would serve with.

Also measured in the same run: this core's read bandwidth (a 512 MiB float32 sum, one thread), the
weight bytes each way streams per product set (so GB/s beside the bandwidth), and the resident
weight bytes of the plain and compressed models. Every ratio is a median over the repeats of the
per-repeat ratio. The record names the CPU and the ISA of every way. Results:
experiments/results/bench_fused_cpu.json and .png.
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


def build(mats: list[torch.Tensor], isas: list[str]) -> dict[str, list[Any]]:
    """Each way's matrices: oneDNN's packed weights, the engine's, and the tile weights of every other ISA."""
    from fast.codec.encode import encode
    from fast.codec.matmul_c import TileWeight
    from fast.engine.linear import DenseLinear, compress, cpu_packed

    ways: dict[str, list[Any]] = {"onednn": [], "engine_plain": [], "engine_compressed": []}
    for isa in isas:
        ways[f"{isa}_plain"], ways[f"{isa}_compressed"] = [], []
    for w in mats:
        packed = cpu_packed(w)  # None where oneDNN cannot pack bf16 (no AVX-512): the engine's F.linear then
        ways["onednn"].append(("packed", packed) if packed is not None else ("linear", w))
        ways["engine_plain"].append(DenseLinear(w))
        ways["engine_compressed"].append(compress(w, torch.bfloat16))
        if isas:
            _, form = encode(w.contiguous(), with_palette_form=True)
            plain, compressed = TileWeight.from_dense(w), TileWeight.from_palette(form)
            for isa in isas:
                ways[f"{isa}_plain"].append(plain)
                ways[f"{isa}_compressed"].append(compressed)
    return ways


def default_isas() -> list[str]:
    """Every instruction set this CPU can execute but scalar (the conformance anchor, not a server)."""
    from fast import cpu_isa

    return [name for name in reversed(cpu_isa.supported()) if name != "scalar"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from fast import cpu_isa

    p = argparse.ArgumentParser(prog="python -m experiments.unweight.bench_fused_cpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a packaged name or checkpoint path (default smollm2)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to measure (1 2)")
    p.add_argument("--repeats", type=int, default=5, help="alternating repeats per batch size (5)")
    p.add_argument("--quick", action="store_true", help="4 layers, 3 repeats, one thread (about a minute)")
    p.add_argument("--isas", nargs="+", choices=cpu_isa.ALL, default=None,
                   help="instruction sets to measure (default: every one this CPU can execute but scalar)")
    p.add_argument("--as-isa", choices=cpu_isa.ALL, default=None,
                   help="measure as a CPU whose best instruction set is this: the engine and oneDNN both capped "
                        "(UNFIRE_CPU_ISA, ONEDNN_MAX_CPU_ISA; the command runs again in a process with them set), "
                        "only that set's products; default out: experiments/results/bench_fused_cpu_ISA.json")
    p.add_argument("--out", type=Path, default=None, help="the JSON to write (default "
                   "experiments/results/bench_fused_cpu.json)")
    args = p.parse_args(argv)
    from fast.codec import matmul_c

    if args.as_isa:
        return _as_isa(args, argv)
    if args.out is None:
        args.out = RESULTS / "bench_fused_cpu.json"

    try:
        isas = [cpu_isa.check(name) for name in (args.isas or default_isas())]
        engine_isa = cpu_isa.selected()
    except cpu_isa.CpuIsaError as e:
        raise SystemExit(f"bench_fused_cpu: {e}") from None
    if matmul_c.library() is None:
        raise SystemExit("bench_fused_cpu: no C compiler (set CC) or UNFIRE_NATIVE=0: the tile products are not built")
    print(f"bench_fused_cpu: {cpu_isa.summary()}; measuring {', '.join(isas)}", flush=True)
    out = measure(args.model, 4 if args.quick else None, [1] if args.quick else args.threads,
                  3 if args.quick else args.repeats, isas=[i for i in isas if i != engine_isa])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    plot(out, args.out.with_suffix(".png"))
    print(f"read bandwidth (one thread) {out['read_bandwidth_gbps_one_thread']:.1f} GB/s; wrote {args.out}")
    return out


def _as_isa(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """The benchmark again in a process capped to ``args.as_isa`` (oneDNN reads its cap once, at start)."""
    import os
    import subprocess
    import sys

    from fast import cpu_isa

    try:
        caps = cpu_isa.emulation_env(args.as_isa)
    except cpu_isa.CpuIsaError as e:
        raise SystemExit(f"bench_fused_cpu: {e}") from None
    env = dict(os.environ, **caps)
    out = args.out or RESULTS / f"bench_fused_cpu_{args.as_isa}.json"
    rest, skip = [], False
    for a in sys.argv[1:] if argv is None else argv:  # the same options, without --as-isa / --isas / --out
        if skip and not a.startswith("--"):
            continue
        skip = a in ("--as-isa", "--isas", "--out")
        if not skip:
            rest.append(a)
    cmd = [sys.executable, "-m", "experiments.unweight.bench_fused_cpu", *rest, "--isas", args.as_isa,
           "--out", str(out)]
    print(f"bench_fused_cpu: as {args.as_isa}: {' '.join(f'{k}={v}' for k, v in caps.items())}", flush=True)
    if subprocess.run(cmd, env=env).returncode:
        raise SystemExit("bench_fused_cpu: the capped run failed")
    doc = json.loads(out.read_text())
    doc["emulated"] = caps
    out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out.with_suffix(".png"))
    return doc


def measure(model: str, limit: int | None, threads: list[int], repeats: int, rows_list: tuple[int, ...] = ROWS,
            verbose: bool = True, isas: list[str] | None = None) -> dict[str, Any]:
    """The benchmark's record (see the module docstring); ``limit`` layers (None: all); ``isas``: the other
    instruction sets to measure beside the engine's (None: none)."""
    from fast import cpu_isa
    from fast.codec.matmul_c import PATH_OF_ISA
    from fast.engine.linear import _packed_linear, tile_products
    from reference.provenance import commit, machine

    isas = list(isas or [])
    engine_isa = cpu_isa.selected() if tile_products() else "onednn"
    torch.set_num_threads(1)
    bandwidth = read_bandwidth()
    mats = projections(model, limit)
    ways = build(mats, isas)
    names = list(ways)
    nbytes = {"plain_bf16": sum(w.numel() * 2 for w in mats),
              "engine_plain": sum(d.nbytes() for d in ways["engine_plain"]),
              "engine_compressed": sum(c.nbytes() for c in ways["engine_compressed"])}
    for isa in isas:
        nbytes[f"{isa}_plain"] = sum(t.nbytes() for t in ways[f"{isa}_plain"])
        nbytes[f"{isa}_compressed"] = sum(t.nbytes() for t in ways[f"{isa}_compressed"])
    widths = sorted({w.shape[1] for w in mats})
    rows: list[dict[str, Any]] = []
    for nt in threads:
        torch.set_num_threads(nt)
        for m in rows_list:
            xs = {k: torch.randn((m, k)).to(torch.bfloat16) for k in widths}
            keyed = {way: [(o, w.shape[1]) for o, w in zip(objs, mats, strict=True)] for way, objs in ways.items()}
            times: dict[str, list[float]] = {w: [] for w in names}
            for r in range(repeats + 1):  # the first pass warms caches and buffers, not recorded
                # each repeat starts at another way: none always runs right after oneDNN, whose OpenMP
                # threads spin for a while after each call (with 2 threads they would slow the next way)
                for way in names[r % len(names):] + names[:r % len(names)]:
                    path = PATH_OF_ISA.get(way.rsplit("_", 1)[0])
                    t = time.perf_counter()
                    for o, k in keyed[way]:
                        x = xs[k]
                        if way == "onednn":
                            kind, weight = o
                            _packed_linear(x, weight) if kind == "packed" else torch.nn.functional.linear(x, weight)
                        elif path is not None:
                            o.matmul(x, path=path, threads=nt)
                        else:
                            o(x)
                    if r:
                        times[way].append(time.perf_counter() - t)
            row = {"threads": nt, "rows": m, "ms": {w: 1e3 * statistics.median(v) for w, v in times.items()},
                   "ms_min": {w: 1e3 * min(v) for w, v in times.items()}}
            pairs = [("engine_compressed", "engine_plain"), ("engine_plain", "onednn"), ("engine_compressed", "onednn")]
            for isa in isas:
                pairs += [(f"{isa}_compressed", f"{isa}_plain"), (f"{isa}_plain", "onednn"),
                          (f"{isa}_compressed", "onednn")]
            for a, b in pairs:
                row[f"{a}_vs_{b}"] = statistics.median(y / x for x, y in zip(times[a], times[b], strict=True))
            for way in names:
                streamed = nbytes.get(way, nbytes["plain_bf16"])
                row[f"gbps_{way}"] = streamed / (row["ms_min"][way] / 1e3) / 1e9
            rows.append(row)
            if verbose:
                print(f"threads {nt} rows {m:3d}: " + "  ".join(f"{w} {row['ms'][w]:.1f}" for w in names)
                      + f"  | engine ({engine_isa}) comp/plain {row['engine_compressed_vs_engine_plain']:.2f}x"
                      + f" plain/onednn {row['engine_plain_vs_onednn']:.2f}x"
                      + "".join(f" | {i} comp/plain {row[f'{i}_compressed_vs_{i}_plain']:.2f}x"
                                f" plain/onednn {row[f'{i}_plain_vs_onednn']:.2f}x" for i in isas), flush=True)
    return {"what": "projection products of every layer, plain vs compressed (speed ratios: >1 = faster)",
            "model": model, "layers": limit or "all", "matrices": len(mats), "repeats": repeats,
            "cpu": cpu_isa.describe_cpu(), "cpu_isas": list(cpu_isa.supported()), "engine_isa": engine_isa,
            "isas": isas, "read_bandwidth_gbps_one_thread": bandwidth, "weight_bytes": nbytes, "rows": rows,
            "commit": commit(), "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "note": "ratio a_vs_b = time(b) / time(a), the median over repeats of the per-repeat ratio; "
                    "<isa>_* ways are the tile products forced to that instruction set's path"}


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    kinds = [("engine", out.get("engine_isa", "engine"))] + [(i, i) for i in out.get("isas", [])]
    colors = ["tab:red", "tab:blue", "tab:green", "tab:purple"]
    for nt in sorted({r["threads"] for r in out["rows"]}):
        rs = [r for r in out["rows"] if r["threads"] == nt]
        ms = [r["rows"] for r in rs]
        alpha = 1 if nt == 1 else 0.5
        axes[0].plot(ms, [r["ms"]["onednn"] for r in rs], "k-", marker="o", alpha=alpha, label=f"oneDNN, {nt} thr")
        for (way, label), color in zip(kinds, colors, strict=False):
            axes[0].plot(ms, [r["ms"][f"{way}_compressed"] for r in rs], "-", color=color, marker="o", alpha=alpha,
                         label=f"{label} compressed, {nt} thr")
            axes[0].plot(ms, [r["ms"][f"{way}_plain"] for r in rs], ":", color=color, alpha=alpha,
                         label=f"{label} plain, {nt} thr")
            axes[1].plot(ms, [r[f"{way}_compressed_vs_{way}_plain"] for r in rs], "-", color=color, marker="o",
                         alpha=alpha, label=f"{label}: compressed / plain speed, {nt} thr")
            if way == "engine":  # other ISAs against this CPU's oneDNN say nothing: see their --as-isa runs
                axes[1].plot(ms, [r[f"{way}_plain_vs_onednn"] for r in rs], ":", color=color, marker="x",
                             alpha=alpha, label=f"{label}: plain / oneDNN speed, {nt} thr")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows per product (batch)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("ms per product set (every projection)")
    axes[1].axhline(1, color="gray", lw=0.5)
    axes[1].set_ylabel("speed ratio")
    capped = out.get("emulated")
    as_isa = f" as a {out.get('engine_isa')} CPU ({', '.join(f'{k}={v}' for k, v in capped.items())})" if capped else ""
    fig.suptitle(f"{out['model']}: {out['matrices']} matrices on {out.get('cpu', 'this CPU')}{as_isa}; one-thread "
                 f"read bandwidth {out['read_bandwidth_gbps_one_thread']:.0f} GB/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
