"""Encoder speed: the vectorised torch encoder (fast.codec.encode) vs ZipNN, same tensors, same threads.

For every floating-point tensor of a checkpoint (cast to bf16 with round-to-nearest-even, at least
``--min-elements`` weights), both compressors run alternately ``--repeats`` times and each keeps its
fastest time per tensor (the machine may be shared: the minimum is the least disturbed run). The
throughput is the checkpoint's bf16 bytes over the sum of those minima. Both use ``--threads``
threads (``torch.set_num_threads`` and ZipNN's ``threads``). The reference NumPy encoder is timed
once per tensor for scale. Our output is checked against the reference encoder's bytes on the way.

    python -m experiments.bench_encode [--weights minilm] [--threads 1 2] [--repeats 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def load_tensors(source: str, min_elements: int, limit: int | None) -> list[tuple[str, np.ndarray]]:
    """(name, bf16 bits) of every floating-point tensor with at least ``min_elements`` weights."""
    from reference.bf16 import float32_to_bf16
    from reference.model.weights import open_weights

    w = open_weights(source)
    out = []
    for name in w.names():
        dtype = w.dtype(name)
        if dtype not in ("BF16", "F32", "F16", "F64"):
            continue
        a = w.get(name)
        if a.size < min_elements:
            continue
        out.append((name, np.asarray(a) if dtype == "BF16" else float32_to_bf16(np.ascontiguousarray(a, np.float32))))
        if limit and len(out) >= limit:
            break
    return out


def best_time(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(source: str, threads: list[int], repeats: int, min_elements: int, limit: int | None,
        check: bool = True) -> dict[str, Any]:
    import torch
    import zipnn

    import reference.codec as rc
    from fast.bf16 import from_numpy_bits
    from fast.codec.convert import huffman_arrays
    from fast.codec.encode import encode

    tensors = load_tensors(source, min_elements, limit)
    total_bytes = sum(2 * a.size for _, a in tensors)
    results: dict[str, Any] = {"weights": source, "tensors": len(tensors), "bf16_bytes": total_bytes,
                               "repeats": repeats, "by_threads": {}}
    ours_bytes = 0
    t_ref = 0.0
    for i, (name, bits) in enumerate(tensors):
        start = time.perf_counter()
        ct = rc.encode(bits)
        t_ref += time.perf_counter() - start
        if check:
            mine = huffman_arrays(encode(from_numpy_bits(bits)))
            ref = huffman_arrays(ct)
            if not all(np.array_equal(mine[k], ref[k]) for k in ref):
                raise AssertionError(f"{name}: the torch encoder's bytes differ from the reference encoder's")
        ours_bytes += ct.nbytes
        if i == 0:
            results["first_tensor"] = name
    saved_threads = torch.get_num_threads()
    for th in threads:
        torch.set_num_threads(th)
        z = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=th)
        t_ours = t_zip = 0.0
        zipnn_bytes = 0
        for _, bits in tensors:
            x = from_numpy_bits(bits)
            raw = bits.tobytes()
            for _ in range(2):  # warm-up: caches, allocator, table caches
                encode(x)
                z.compress(raw)
            best_ours = best_zip = float("inf")
            for _ in range(repeats):  # alternate, so both see the same background load
                best_ours = min(best_ours, best_time(lambda x=x: encode(x), 1))
                best_zip = min(best_zip, best_time(lambda raw=raw, z=z: z.compress(raw), 1))
            t_ours += best_ours
            t_zip += best_zip
            zipnn_bytes += len(z.compress(raw))
        results["by_threads"][str(th)] = {
            "ours_MBps": total_bytes / t_ours / 1e6, "zipnn_MBps": total_bytes / t_zip / 1e6,
            "ours_over_zipnn": t_zip / t_ours, "ours_seconds": t_ours, "zipnn_seconds": t_zip,
            "zipnn_ratio": total_bytes / zipnn_bytes,  # ZipNN's output can depend on its thread count
        }
    torch.set_num_threads(saved_threads)
    results["reference_numpy_MBps"] = total_bytes / t_ref / 1e6
    results["ratio_ours"] = total_bytes / ours_bytes
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_encode", description=__doc__.splitlines()[0])
    p.add_argument("--weights", default="minilm")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-elements", type=int, default=4096)
    p.add_argument("--limit", type=int, default=None, help="only the first N tensors")
    p.add_argument("--json", type=Path, default=None, help=f"write results here (e.g. {RESULTS}/bench_encode.json)")
    args = p.parse_args(argv)
    from experiments.setup_info import commit, machine

    res = run(args.weights, args.threads, args.repeats, args.min_elements, args.limit)
    res["machine"], res["commit"] = machine(), commit()
    res["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"{res['weights']}: {res['tensors']} tensors, {res['bf16_bytes'] / 1e6:.1f} MB of bf16; ratio ours "
          f"{res['ratio_ours']:.3f}; reference NumPy encoder {res['reference_numpy_MBps']:.0f} MB/s")
    for th, r in res["by_threads"].items():
        print(f"  {th} thread(s): ours {r['ours_MBps']:.0f} MB/s, ZipNN {r['zipnn_MBps']:.0f} MB/s (ratio "
              f"{r['zipnn_ratio']:.3f}) -> ours is {r['ours_over_zipnn']:.2f}x ZipNN's speed")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
