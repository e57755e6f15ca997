"""GPU benchmark of the paged decode-attention kernel (``fast/kv``) against gather + SDPA.

Decode attention reads every cached K/V byte of every sequence once per step, so it is bound by
memory: we report GB/s of K/V (and fp8 scales) read, beside the copy bandwidth measured in the same
run (``dst.copy_(src)``, the roofline). Shapes are Llama-3.1-8B's attention (32 query heads on 8 kv
heads, head_dim 128), block size 16, ``--context`` tokens cached per sequence, batch 1..256, with a
bf16 cache and an fp8 cache. Three ways per row:

* ``triton``: ``fast.kv.decode_attention`` (the Triton kernel; fp8 dequantized in the kernel);
* ``gather_sdpa``: the torch path of the same API (gather through the block tables, dequantize,
  ``scaled_dot_product_attention`` in float32): the baseline a torch-only engine would have;
* ``contiguous_sdpa`` (bf16 only): SDPA on K/V already contiguous per sequence in bf16, no paging;
  the speed torch reaches when nothing has to be gathered (not a paged-attention implementation).

Each row checks that the Triton output agrees with the torch path (max |difference| recorded).
``--tiny`` runs tiny shapes on the CPU under TRITON_INTERPRET=1: a smoke test of the script, not a
measurement. No GPU was available where this was written, so it has not been measured yet.

    python -m experiments.engine.bench_kv [--json experiments/results/bench_kv.json] [--budget 200] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from experiments.registry import pyplot
from reference.safe_write import write_text

RESULTS = Path(__file__).resolve().parents[1] / "results"
BATCHES = [1, 4, 16, 64, 256]
TINY_BATCHES = [1, 3]
SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16}
TINY_SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 16, "block_size": 16}


def make_step(batch: int, context: int, shape: dict[str, int], dtype: str, device: Any, seed: int) -> tuple:
    """(q, cache, step): ``batch`` sequences of ``context`` cached tokens (the last one just written)."""
    import torch

    from fast.kv import KVStep, PagedKVCache

    gen = torch.Generator(device="cpu").manual_seed(seed)
    bs = shape["block_size"]
    per_seq = -(-context // bs)
    nb = batch * per_seq
    cache = PagedKVCache(num_layers=1, num_blocks=nb, block_size=bs, num_kv_heads=shape["kv_heads"],
                         head_dim=shape["head_dim"], dtype=dtype, device=device)
    blocks = torch.randperm(nb, generator=gen)  # scattered blocks, as after a while of serving
    tables = blocks.reshape(batch, per_seq).tolist()
    fill = KVStep.build(query_lens=[context] * batch, starts=[0] * batch, block_tables=tables, block_size=bs,
                        num_blocks=nb, device=device)
    kv_shape = (batch * context, shape["kv_heads"], shape["head_dim"])
    k = torch.randn(kv_shape, generator=gen).to(device)
    cache.write(0, fill.slots, k, torch.randn(kv_shape, generator=gen).to(device))
    del k
    step = KVStep.build(query_lens=[1] * batch, starts=[context - 1] * batch, block_tables=tables, block_size=bs,
                        num_blocks=nb, device=device)
    q = torch.randn((batch, shape["heads"], shape["head_dim"]), generator=gen).to(device=device,
                                                                                     dtype=torch.bfloat16)
    return q, cache, step, tables


def kv_bytes(batch: int, context: int, shape: dict[str, int], dtype: str) -> int:
    """Bytes of K and V (and fp8 scales) a decode step must read."""
    per_token = 2 * shape["kv_heads"] * shape["head_dim"] * (1 if dtype == "fp8" else 2)
    scales = 2 * shape["kv_heads"] * -(-context // shape["block_size"]) if dtype == "fp8" else 0
    return batch * (context * per_token + scales)


def contiguous_sdpa(q: Any, cache: Any, tables: list[list[int]], context: int) -> Any:
    """A closure running SDPA on per-sequence contiguous bf16 K/V (built once, outside the timing)."""
    import torch
    import torch.nn.functional as F

    t = torch.as_tensor(tables, device=q.device)
    b = t.shape[0]
    k, v = (x[0][t].reshape(b, -1, cache.num_kv_heads, cache.head_dim)[:, :context].transpose(1, 2).contiguous()
            for x in (cache.k, cache.v))
    qq = q[:, :, None, :]
    return lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True)


def measure(batch: int, context: int, shape: dict[str, int], dtype: str, device: Any, timeit: Any,
            bw: float) -> dict[str, Any]:
    """One row: the three ways timed on one batch, and the Triton output checked against the torch path."""
    from fast.kv import decode_attention

    q, cache, step, tables = make_step(batch, context, shape, dtype, device, seed=batch)
    moved = kv_bytes(batch, context, shape, dtype)
    fast = decode_attention(q, cache, 0, step, backend="triton")
    base = decode_attention(q, cache, 0, step)
    row: dict[str, Any] = {"dtype": dtype, "batch": batch, "kv_bytes": moved,
                           "max_abs_diff": float((fast.float() - base.float()).abs().max())}
    row["triton_s"] = timeit(lambda: decode_attention(q, cache, 0, step, backend="triton"))
    row["gather_sdpa_s"] = timeit(lambda: decode_attention(q, cache, 0, step, backend="torch"))
    if dtype == "bfloat16":
        row["contiguous_sdpa_s"] = timeit(contiguous_sdpa(q, cache, tables, context))
    for key in ("triton", "gather_sdpa", "contiguous_sdpa"):
        if f"{key}_s" in row:
            row[f"{key}_GBps"] = moved / row[f"{key}_s"] / 1e9
    row["speedup_vs_gather_sdpa"] = row["gather_sdpa_s"] / row["triton_s"]
    row["of_copy_bandwidth"] = row["triton_GBps"] * 1e9 / bw
    return row


def bench(tiny: bool, budget: float, context: int, log: Any = print) -> dict[str, Any]:
    import torch

    from experiments.unweight.gpu_bench import copy_bandwidth, timer

    t0 = time.perf_counter()
    device = torch.device("cpu" if tiny else "cuda")
    reps = 1 if tiny else 20
    timeit = timer(device, reps, None if tiny else torch.empty(256 << 20, dtype=torch.uint8, device=device))
    shape, batches = (TINY_SHAPE, TINY_BATCHES) if tiny else (SHAPE, BATCHES)
    out: dict[str, Any] = {"tiny": tiny, "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
                           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (interpreter)",
                           "shape": shape, "context": context, "rows": []}
    bw = copy_bandwidth(device, (1 << 20) if tiny else (1 << 30), reps)
    out["copy_bandwidth_GBps"] = bw / 1e9
    log(f"copy bandwidth {bw / 1e9:.1f} GB/s")
    try:
        from rich.progress import track
    except ImportError:  # pragma: no cover - rich is in the experiments extra
        def track(x: Any, **_: Any) -> Any:
            return x
    plan = [(dtype, b) for dtype in ("bfloat16", "fp8") for b in batches]
    for dtype, batch in track(plan, description="decode attention"):
        if time.perf_counter() - t0 > budget:
            out.setdefault("skipped", []).append([dtype, batch])
            continue
        row = measure(batch, context, shape, dtype, device, timeit, bw)
        log(f"{dtype:8s} B={batch:4d}: triton {row['triton_GBps']:8.1f} GB/s, gather+SDPA "
            f"{row['gather_sdpa_GBps']:8.1f} GB/s ({row['speedup_vs_gather_sdpa']:.2f}x), "
            f"{100 * row['of_copy_bandwidth']:.0f}% of copy bandwidth, max diff {row['max_abs_diff']:.2e}")
        out["rows"].append(row)
    out["seconds"] = time.perf_counter() - t0
    return out


def figure(res: dict[str, Any], path: Path) -> None:
    """GB/s against batch, per implementation and cache dtype, with the copy bandwidth as a line."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for dtype, style in (("bfloat16", "-"), ("fp8", "--")):
        rows = [r for r in res["rows"] if r["dtype"] == dtype]
        for key in ("triton", "gather_sdpa", "contiguous_sdpa"):
            pts = [(r["batch"], r[f"{key}_GBps"]) for r in rows if f"{key}_GBps" in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{key} ({dtype} cache)")
    ax.axhline(res["copy_bandwidth_GBps"], color="grey", lw=0.8, label="copy bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("K/V read, GB/s")
    ax.set_title(f"paged decode attention, {res['context']} tokens each, {res['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.engine.bench_kv", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU under the interpreter (smoke test)")
    p.add_argument("--json", type=Path, default=None, help="results file (default experiments/results/bench_kv.json)")
    p.add_argument("--budget", type=float, default=200, help="seconds after which no new row is started")
    p.add_argument("--context", type=int, default=None, help="cached tokens per sequence (default 1024; tiny 40)")
    args = p.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        import torch

        if not torch.cuda.is_available():
            print("bench_kv measures GPU kernels and needs CUDA; use --tiny for a CPU smoke test", file=sys.stderr)
            return 2
    sys.path.insert(0, str(RESULTS.parents[1]))
    from reference.provenance import commit

    res = bench(args.tiny, args.budget, args.context or (40 if args.tiny else 1024))
    res.update({"commit": commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    path = args.json or RESULTS / "bench_kv.json"
    write_text(path, json.dumps(res, indent=1) + "\n")
    if not args.tiny:
        figure(res, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0 if res["rows"] and all(r["max_abs_diff"] < 0.05 for r in res["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
