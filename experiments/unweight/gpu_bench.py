"""GPU benchmark of the Unweight kernels (claim U4): decode throughput and fused matmul vs cuBLAS.

Everything is measured in one run, on one GPU, and reported as ratios beside a roofline floor:
bytes the kernel must move / the copy bandwidth measured in the same run (``dst.copy_(src)``).

* decode: palette form -> bf16 and Huffman form -> bf16, in GB/s of bf16 produced (goal: palette
  decode >= 2 TB/s on an H100/H200), and the Huffman -> palette transcode;
* matmul: ``y = x @ W.T`` on Llama-3.1-8B MLP shapes (W 14336x4096 = gate/up, 4096x14336 = down)
  at batch 1, 2, 4, 8, 16, 32, 64, 256: cuBLAS on bf16 weights (``F.linear``), the fused palette-decode
  kernel (best of a small config sweep), the same Triton kernel on bf16 weights, decode-then-cuBLAS,
  and ``UnweightLinear`` (its own choice). Goal: fused at batch 1 at least as fast as cuBLAS (the
  memory-bound limit is 16/12 = 1.33x faster). The fused result is checked bit for bit against the
  plain kernel on the decoded weights, with the same config.

Weights are random with MiniLM's exponent distribution (sign and mantissa uniform), encoded on the
CPU with the torch encoder. ``--tiny`` runs the same code on tiny shapes under TRITON_INTERPRET=1 on
the CPU (a smoke test: its numbers are not GPU measurements).

    python -m experiments.unweight.gpu_bench [--json experiments/results/gpu_bench.json] [--budget 420] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from reference.safe_write import write_text

RESULTS = Path(__file__).resolve().parents[1] / "results"
SHAPES = [(14336, 4096), (4096, 14336)]  # Llama-3.1-8B: gate/up [14336, 4096], down [4096, 14336]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 256]  # every batch the CPU benchmark measures too
TINY_SHAPES, TINY_BATCHES = [(48, 256)], [1, 5]


def timer(device: Any, reps: int, flush: Any = None):
    """time(fn) -> median seconds of ``reps`` runs after warm-up (CUDA events on a GPU, L2 flushed)."""
    import torch

    def run(fn: Any) -> float:
        for _ in range(2 if device.type == "cuda" else 0):  # (the interpreter has nothing to warm up)
            fn()
        times = []
        for _ in range(reps):
            if flush is not None:
                flush.zero_()
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    return run


def configs_for(batch: int, tiny: bool) -> list[Any]:
    """The fused kernel's configs to try at this batch size (the first is the default heuristic's)."""
    from fast.codec.matmul_triton import MatmulConfig as C

    if tiny:
        return [C(16, 32, 64, 2, 4, 2)]
    if batch <= 16:
        return [C(16, 64, 128, s, 4, 4) for s in (1, 2, 4)] + [C(16, 128, 128, 1, 4, 4), C(16, 32, 256, 1, 4, 3),
                                                                 C(16, 64, 256, 2, 8, 3)]
    if batch <= 64:
        return [C(64, 64, 128, 1, 4, 3), C(64, 128, 64, 1, 4, 3), C(32, 64, 128, 2, 4, 4)]
    return [C(128, 128, 64, 1, 8, 3), C(128, 64, 64, 1, 4, 3), C(64, 128, 64, 1, 4, 4)]


def copy_bandwidth(device: Any, size: int, reps: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` (read + write), the roofline's bandwidth."""
    import torch

    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * size / timer(device, reps)(lambda: dst.copy_(src))


def make_weights(shape: tuple[int, int], seed: int, chunks_per_group: int = 32) -> tuple[Any, Any, Any]:
    """(bf16 weights, Huffman form, palette form), on the CPU, from MiniLM's exponent distribution."""
    import numpy as np

    from fast.bf16 import from_numpy_bits
    from fast.codec.encode import encode
    from reference.synthetic import synthetic_weights

    w = from_numpy_bits(synthetic_weights(shape, np.random.default_rng(seed)))
    hform, pform = encode(w, chunks_per_group=chunks_per_group, with_palette_form=True)
    return w, hform, pform


def bench(tiny: bool, budget: float, log: Any = print) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from fast.codec.decode_triton import decode_huffman, transcode
    from fast.codec.linear import UnweightLinear
    from fast.codec.matmul_triton import default_config, fused_matmul, matmul
    from fast.codec.palette_triton import decode_palette

    t0 = time.perf_counter()
    device = torch.device("cpu" if tiny else "cuda")
    reps = 1 if tiny else 20
    flush = None if tiny else torch.empty(256 << 20, dtype=torch.uint8, device=device)  # > L2 (50 MB on H200)
    timeit = timer(device, reps, flush)
    out: dict[str, Any] = {"tiny": tiny, "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
                           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (interpreter)"}

    bw = copy_bandwidth(device, (1 << 20) if tiny else (1 << 30), reps)
    out["copy_bandwidth_GBps"] = bw / 1e9
    log(f"copy bandwidth {bw / 1e9:.1f} GB/s")

    shapes, batches = (TINY_SHAPES, TINY_BATCHES) if tiny else (SHAPES, BATCHES)
    forms = {}
    for i, shape in enumerate(shapes):
        w, hform, pform = make_weights(shape, seed=i, chunks_per_group=2 if tiny else 32)  # tiny: few steps
        forms[shape] = (w.to(device), hform.to(device), pform.to(device))
        log(f"weights {shape}: palette form {pform.nbytes() / 1e6:.1f} MB ({8 * pform.nbytes() / w.numel():.2f} "
            f"bits/weight), Huffman {hform.nbytes() / 1e6:.1f} MB, {pform.vchunks.numel()} verbatim chunks")

    # decode throughput, on the first shape
    w, hform, pform = forms[shapes[0]]
    n = w.numel()
    dec: dict[str, Any] = {"shape": list(shapes[0])}
    palette_cfgs = [(8, 256, None), (16, 256, None), (4, 512, None), (32, 128, None)] if not tiny else [(16, 64, 1)]
    best = min(((timeit(lambda c=c: decode_palette(pform, *c)), c) for c in palette_cfgs), key=lambda r: r[0])
    moved = pform.nbytes() + 2 * n
    dec["palette"] = {"seconds": best[0], "config": list(best[1]), "out_GBps": 2 * n / best[0] / 1e9,
                      "floor_seconds": moved / bw, "of_floor": (moved / bw) / best[0]}
    assert torch.equal(decode_palette(pform, *best[1]).view(torch.int16), w.view(torch.int16)), "palette decode"
    lanes = (32, 64, 128) if not tiny else (64,)
    best = min(((timeit(lambda b=b: decode_huffman_block(hform, b)), b) for b in lanes), key=lambda r: r[0])
    moved = hform.nbytes() + 2 * n
    dec["huffman"] = {"seconds": best[0], "lanes_per_program": best[1], "out_GBps": 2 * n / best[0] / 1e9,
                      "floor_seconds": moved / bw, "of_floor": (moved / bw) / best[0]}
    assert torch.equal(decode_huffman(hform).view(torch.int16), w.view(torch.int16)), "Huffman decode"
    dec["transcode_seconds"] = timeit(lambda: transcode(hform))
    dec["copy_bf16_out_GBps"] = bw / 2 / 1e9  # a plain copy of bf16 weights: the decode's ceiling
    out["decode"] = dec
    log(f"palette decode {dec['palette']['out_GBps']:.0f} GB/s of bf16 ({100 * dec['palette']['of_floor']:.0f}% of "
        f"floor); Huffman decode {dec['huffman']['out_GBps']:.0f} GB/s; "
        f"transcode {1e3 * dec['transcode_seconds']:.2f} ms")

    rows = []
    for shape in shapes:
        w, _, pform = forms[shape]
        n_out, k = shape
        layer = UnweightLinear(pform)
        for batch in batches:
            if time.perf_counter() - t0 > budget:
                log(f"budget of {budget:.0f} s spent: stopping before {shape} batch {batch}")
                out["stopped_early"] = True
                break
            x = torch.randn(batch, k, device=device).to(torch.bfloat16)
            r: dict[str, Any] = {"shape": list(shape), "batch": batch}
            r["cublas_s"] = timeit(lambda x=x, w=w: F.linear(x, w))
            trials = []
            for cfg in [default_config(batch, n_out, k)] + configs_for(batch, tiny):
                try:
                    trials.append((timeit(lambda x=x, p=pform, cfg=cfg: fused_matmul(x, p, config=cfg)), cfg))
                except Exception as e:  # a config the GPU cannot run (shared memory): skip it, say so
                    log(f"  config {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
            r["fused_s"], cfg = min(trials, key=lambda t: t[0])
            r["fused_config"] = [cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages]
            r["plain_triton_s"] = timeit(lambda x=x, w=w, cfg=cfg: matmul(x, w, config=cfg))
            r["decode_then_cublas_s"] = timeit(lambda x=x, p=pform: F.linear(x, decode_palette(p)))
            r["unweight_linear_s"] = timeit(lambda x=x, f=layer: f(x))
            y_fused = fused_matmul(x, pform, config=cfg)
            r["fused_equals_plain_on_decoded"] = bool(torch.equal(
                y_fused.view(torch.int16), matmul(x, decode_palette(pform), config=cfg).view(torch.int16)))
            act = 2 * batch * k + 2 * batch * n_out
            r["floor_bf16_s"] = (2 * n_out * k + act) / bw
            r["floor_palette_s"] = (pform.nbytes() + act) / bw
            r["fused_speedup_vs_cublas"] = r["cublas_s"] / r["fused_s"]
            r["cublas_of_floor"] = r["floor_bf16_s"] / r["cublas_s"]
            r["fused_of_floor"] = r["floor_palette_s"] / r["fused_s"]
            rows.append(r)
            log(f"{shape} b{batch:>3}: cuBLAS {1e6 * r['cublas_s']:8.1f} us "
                f"({100 * r['cublas_of_floor']:3.0f}% of floor) | fused {1e6 * r['fused_s']:8.1f} us "
                f"({100 * r['fused_of_floor']:3.0f}% of floor) -> "
                f"{r['fused_speedup_vs_cublas']:.2f}x cuBLAS | decode+cuBLAS "
                f"{1e6 * r['decode_then_cublas_s']:8.1f} us")
    out["matmul"] = rows
    b1 = [r["fused_speedup_vs_cublas"] for r in rows if r["batch"] == 1]
    out["goals"] = {
        "palette_decode_TBps": dec["palette"]["out_GBps"] / 1e3, "palette_decode_goal_TBps": 2.0,
        "fused_b1_speedup_vs_cublas": min(b1) if b1 else None, "fused_b1_goal": 1.0,
        "memory_bound_limit": 16 / 12,
    }
    out["seconds"] = time.perf_counter() - t0
    return out


def decode_huffman_block(form: Any, block: int) -> Any:
    from fast.codec.decode_triton import _run

    return _run(form, mode=0, block=block)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.unweight.gpu_bench", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1 (smoke test)")
    p.add_argument("--json", type=Path, default=None, help="where to write the results (default: "
                   "experiments/results/gpu_bench.json on a GPU, nothing with --tiny)")
    p.add_argument("--budget", type=float, default=420.0, help="stop starting new matmul rows after this many seconds")
    args = p.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before fast/ (and triton) are imported
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device; use --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    from reference.provenance import commit, machine

    res = bench(args.tiny, args.budget)
    res.update({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit(), "machine": machine()})
    path = args.json or (None if args.tiny else RESULTS / "gpu_bench.json")
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(res, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
