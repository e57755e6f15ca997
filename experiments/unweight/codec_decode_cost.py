"""What the rANS encoder's ``decode_cost`` trades: coded size against one-core decoding time, next to ZipNN.

    python -m experiments.unweight.codec_decode_cost [--weights minilm smollm2] [--costs 0 0.1 0.2 0.3 0.5]
        [--repeat 11] [--json PATH] [--png PATH]

The encoder charges each form (one or two stages, tables by block, column or row, second-stage classes) its
modelled decoding time at ``decode_cost`` bits a nanosecond (FORMAT.md 9.5). For each model (every floating-point
tensor the container compresses, cast to bf16) and each cost, this encodes the tensors
(``encode_rans_many(..., decode_cost=c)``), checks that the C decoder gives every tensor back bit for bit, and
measures, on one core (the process pinned):

* **ratio**: bf16 bytes over the rANS tensors' bytes (arrays only: the container adds the same few headers to each);
* **decode speed**, as ``bench_codec --zipnn-only`` measures it (a checkpoint decompressed end to end): in each
  of ``--repeat`` rounds every encoding's pass over all the tensors (``decode_rans_cpu(t, threads=1)`` each) and
  ZipNN's (``ZipNN.decompress`` of each tensor, byte-grouped bf16, ``threads=1``), one after the other, who goes
  first moving from round to round; reported: the median pass and the median over rounds of ZipNN's pass time
  over the encoding's in the same round (the machine's speed drifts; within a round it drifts for all alike).
  Decoding each tensor by every decoder back to back instead flattered ours by ~1.2x (CHANGELOG.md).

The figure: ratio against decode speed relative to ZipNN's, one line per model, each point a cost.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT_JSON, DEFAULT_PNG = RESULTS / "codec_decode_cost.json", RESULTS / "codec_decode_cost.png"


def measure(weights: str, costs: list[float], repeat: int) -> dict[str, Any]:
    """One model: ratio and median pass time for each cost, and ZipNN's on the same tensors, same rounds."""
    import zipnn
    from tqdm import tqdm

    from experiments.unweight.bench_encode import load_tensors
    from fast.codec.decode_rans_c import decode_rans_cpu, library
    from reference.codec.container_write import MIN_ELEMENTS
    from reference.codec.rans import encode_rans_many

    if library() is None:
        raise SystemExit("the C rANS decoder did not build: this experiment times it")
    tensors = load_tensors(weights, MIN_ELEMENTS, None)
    names, bits = [n for n, _ in tensors], [b for _, b in tensors]
    raw = sum(b.nbytes for b in bits)
    encoded = {}
    for c in tqdm(costs, desc=f"{weights}: encode at each cost", unit="cost"):
        start = time.perf_counter()
        ts = encode_rans_many(bits, names=names, decode_cost=c)
        encode_s = time.perf_counter() - start
        for t, b in zip(ts, bits, strict=True):
            if not np.array_equal(decode_rans_cpu(t, threads=1), b):
                raise AssertionError(f"{weights} {t.name}: the C decoder did not give back the tensor")
        encoded[c] = (ts, encode_s)
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1)
    packed = [z.compress(b.tobytes()) for b in bits]
    if any(z.decompress(p) != b.tobytes() for p, b in zip(packed, bits, strict=True)):
        raise AssertionError(f"{weights}: ZipNN did not give back a tensor")
    keys = [*costs, "zipnn"]
    passes = {k: [] for k in keys}  # each round, each decoder's pass over every tensor, seconds
    for r in tqdm(range(repeat), desc=f"{weights}: timed rounds", unit="round"):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:  # who goes first moves round by round
            start = time.perf_counter()
            if k == "zipnn":
                for p in packed:
                    z.decompress(p)
            else:
                for t in encoded[k][0]:
                    decode_rans_cpu(t, threads=1)
            passes[k].append(time.perf_counter() - start)
    zipnn_s = float(np.median(passes["zipnn"]))
    rows = []
    for c in costs:
        ts, encode_s = encoded[c]
        forms: dict[str, int] = {}
        for t in ts:
            key = f"m{t.mantissa_bits}k{t.low_bits}" + ("" if not t.context_period else
                                                        " column" if t.context_stride == 1 else " row")
            forms[key] = forms.get(key, 0) + 1
        decode_s = float(np.median(passes[c]))
        vs = [zt / t for zt, t in zip(passes["zipnn"], passes[c], strict=True)]  # the same round's passes
        rows.append({"decode_cost": c, "ratio": raw / sum(t.nbytes for t in ts), "decode_s": decode_s,
                     "decode_GBps": raw / decode_s / 1e9, "vs_zipnn": float(np.median(vs)),
                     "vs_zipnn_range": [min(vs), max(vs)], "encode_s": encode_s,
                     "forms": dict(sorted(forms.items(), key=lambda kv: -kv[1]))})
    return {"weights": weights, "tensors": len(bits), "bf16_bytes": raw, "zipnn_decode_s": zipnn_s,
            "zipnn_GBps": raw / zipnn_s / 1e9, "zipnn_ratio": raw / sum(len(p) for p in packed), "rows": rows}


def plot(result: dict[str, Any], png: Path) -> None:
    """Ratio against decode speed relative to ZipNN's, a line per model, each point labelled with its cost."""
    from experiments.registry import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for m in result["models"]:
        x = [r["vs_zipnn"] for r in m["rows"]]
        y = [r["ratio"] for r in m["rows"]]
        line, = ax.plot(x, y, "o-", label=f"{m['weights']} (ZipNN {m['zipnn_ratio']:.4f}x)")
        for r in m["rows"]:
            ax.annotate(f"{r['decode_cost']:g}", (r["vs_zipnn"], r["ratio"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8, color=line.get_color())
    ax.axvline(1.0, color="grey", ls="--", lw=1)
    ax.text(1.0, ax.get_ylim()[0], " ZipNN's speed", color="grey", fontsize=8, va="bottom")
    ax.set_xlabel("one-core decode speed, x ZipNN's (same tensors, same run)")
    ax.set_ylabel("ratio (bf16 bytes / rANS bytes)")
    ax.set_title(f"rANS encoder's decode_cost (bits a ns), {result['machine']['cpu']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.unweight.codec_decode_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", nargs="+", default=["minilm", "smollm2"], help="packaged models or paths")
    parser.add_argument("--costs", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3, 0.5],
                        help="decode_cost values, bits a nanosecond (default 0 0.1 0.2 0.3 0.5)")
    parser.add_argument("--repeat", type=int, default=11, help="timed rounds (default 11)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="the results (default %(default)s)")
    parser.add_argument("--png", type=Path, default=DEFAULT_PNG, help="the figure (default %(default)s)")
    args = parser.parse_args(argv)
    if args.repeat < 1 or not args.costs or any(not 0 <= c < float("inf") for c in args.costs):
        parser.error("--repeat must be >= 1 and every --costs value a finite number >= 0")
    from reference.provenance import commit, machine
    from reference.safe_write import write_text

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cores:
        os.sched_setaffinity(0, cores[-1:])  # one core: ZipNN's one thread and ours alike
    result: dict[str, Any] = {"machine": machine(), "commit": commit(),
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "repeat": args.repeat, "cores": cores[-1:],
                              "models": [measure(w, args.costs, args.repeat) for w in args.weights],
                              "zipnn_version": metadata.version("zipnn")}
    write_text(args.json, json.dumps(result, indent=1) + "\n")
    plot(result, args.png)
    for m in result["models"]:
        print(f"{m['weights']}: {m['tensors']} tensors; ZipNN {m['zipnn_ratio']:.4f}x, {m['zipnn_GBps']:.2f} GB/s")
        for r in m["rows"]:
            print(f"  decode_cost {r['decode_cost']:g}: ratio {r['ratio']:.4f}x, {r['decode_GBps']:.2f} GB/s = "
                  f"{r['vs_zipnn']:.2f}x ZipNN; {r['forms']}")
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
