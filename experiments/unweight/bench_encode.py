"""Encoder speed: our encoders vs ZipNN, same tensors, same threads, alternating.

For every floating-point tensor of a checkpoint (cast to bf16 with round-to-nearest-even, at least
``--min-elements`` weights), three compressors run in turn ``--repeats`` times and each keeps its
fastest time per tensor (the machine may be shared: the minimum is the least disturbed run):
``encode()`` as a user gets it (on the CPU the C encoder of fast/codec/native when a C compiler is
there, else torch), the torch encoder alone (``native=False``; its quad-table cache is cleared
before every call, as if each tensor were new), and ZipNN. The throughput is the checkpoint's bf16
bytes over the sum of those minima. All use ``--threads`` threads (``torch.set_num_threads`` and
ZipNN's ``threads``; the C encoder uses one). The reference NumPy encoder is timed once per tensor
for scale. The output of both of our encoders is checked against the reference encoder's bytes.

    python -m experiments.unweight.bench_encode [--weights minilm] [--threads 1 2] [--repeats 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from reference.safe_write import write_text

RESULTS = Path(__file__).resolve().parents[1] / "results"


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
    from fast.codec import encode_c, encode_words
    from fast.codec.convert import huffman_arrays
    from fast.codec.encode import encode

    def encode_torch(x: Any) -> Any:
        encode_words._quad_table_cpu.cache_clear()  # each tensor as if new
        return encode(x, native=False)

    tensors = load_tensors(source, min_elements, limit)
    total_bytes = sum(2 * a.size for _, a in tensors)
    results: dict[str, Any] = {"weights": source, "tensors": len(tensors), "bf16_bytes": total_bytes,
                               "repeats": repeats, "c_encoder": encode_c.library() is not None,
                               "by_threads": {}}
    ours_bytes = 0
    t_ref = 0.0
    for i, (name, bits) in enumerate(tensors):
        start = time.perf_counter()
        ct = rc.encode(bits)
        t_ref += time.perf_counter() - start
        if check:
            ref = huffman_arrays(ct)
            for fn in (encode, encode_torch):
                mine = huffman_arrays(fn(from_numpy_bits(bits)))
                if not all(np.array_equal(mine[k], ref[k]) for k in ref):
                    raise AssertionError(f"{name}: {fn.__name__}'s bytes differ from the reference encoder's")
        ours_bytes += ct.nbytes
        if i == 0:
            results["first_tensor"] = name
    saved_threads = torch.get_num_threads()
    for th in threads:
        torch.set_num_threads(th)
        z = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=th)
        seconds = {"ours": 0.0, "ours_torch": 0.0, "zipnn": 0.0}
        zipnn_bytes = 0
        for _, bits in tensors:
            x = from_numpy_bits(bits)
            raw = bits.tobytes()
            calls = {"ours": lambda x=x: encode(x), "ours_torch": lambda x=x: encode_torch(x),
                     "zipnn": lambda raw=raw, z=z: z.compress(raw)}
            for fn in calls.values():  # warm-up: caches, allocator
                fn()
                fn()
            best = dict.fromkeys(calls, float("inf"))
            for _ in range(repeats):  # alternate, so all see the same background load
                for key, fn in calls.items():
                    best[key] = min(best[key], best_time(fn, 1))
            for key in seconds:
                seconds[key] += best[key]
            zipnn_bytes += len(z.compress(raw))
        results["by_threads"][str(th)] = {
            "ours_MBps": total_bytes / seconds["ours"] / 1e6,
            "ours_torch_MBps": total_bytes / seconds["ours_torch"] / 1e6,
            "zipnn_MBps": total_bytes / seconds["zipnn"] / 1e6,
            "ours_over_zipnn": seconds["zipnn"] / seconds["ours"],
            "ours_torch_over_zipnn": seconds["zipnn"] / seconds["ours_torch"],
            "ours_seconds": seconds["ours"], "ours_torch_seconds": seconds["ours_torch"],
            "zipnn_seconds": seconds["zipnn"],
            "zipnn_ratio": total_bytes / zipnn_bytes,  # ZipNN's output can depend on its thread count
        }
    torch.set_num_threads(saved_threads)
    results["reference_numpy_MBps"] = total_bytes / t_ref / 1e6
    results["ratio_ours"] = total_bytes / ours_bytes
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.unweight.bench_encode", description=__doc__.splitlines()[0])
    p.add_argument("--weights", default="minilm", help="minilm, smollm2, or a checkpoint path (default minilm)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to measure (default 1 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each encoder (default 5)")
    p.add_argument("--min-elements", type=int, default=4096, help="smaller tensors are skipped (default 4096)")
    p.add_argument("--limit", type=int, default=None, help="only the first N tensors")
    p.add_argument("--json", type=Path, default=None, help=f"write results here (e.g. {RESULTS}/bench_encode.json)")
    args = p.parse_args(argv)
    from reference.provenance import commit, machine

    res = run(args.weights, args.threads, args.repeats, args.min_elements, args.limit)
    res["machine"], res["commit"] = machine(), commit()
    res["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"{res['weights']}: {res['tensors']} tensors, {res['bf16_bytes'] / 1e6:.1f} MB of bf16; ratio ours "
          f"{res['ratio_ours']:.3f}; reference NumPy encoder {res['reference_numpy_MBps']:.0f} MB/s")
    which = "the C encoder" if res["c_encoder"] else "torch (no C compiler)"
    for th, r in res["by_threads"].items():
        print(f"  {th} thread(s): encode() [{which}] {r['ours_MBps']:.0f} MB/s = {r['ours_over_zipnn']:.2f}x ZipNN; "
              f"torch encoder {r['ours_torch_MBps']:.0f} MB/s = {r['ours_torch_over_zipnn']:.2f}x; "
              f"ZipNN {r['zipnn_MBps']:.0f} MB/s (ratio {r['zipnn_ratio']:.3f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_text(args.json, json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
