"""U1: the BF16 exponent of trained weights carries ~2.6 bits; sign and mantissa are ~incompressible.

For every floating-point tensor of each checkpoint: cast to bf16 (round-to-nearest-even; bf16 kept
as is), count sign / exponent / mantissa values, and report Shannon entropy per field and the share
of elements the 16 most frequent exponents cover (what a 16-entry palette would hold). Pooled over
the whole model and per tensor. MiniLM is the default; SmolLM2 is measured too but flagged: its
weights are dequantized 4-bit values. ``--weights PATH`` adds any checkpoint.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.registry import Context, Experiment, Result, pyplot, save_figure
from reference.bf16 import FieldStats, field_stats, float32_to_bf16
from reference.model.names import MLP_KINDS, tensor_kind
from reference.model.weights import WeightSource, open_weights

ARTICLE_BITS = 2.6
TOLERANCE_BITS = 0.3  # "matches" if the pooled exponent entropy is within this of 2.6 bits
SIGN_MIN, MANTISSA_MIN = 0.99, 6.9  # "close to incompressible": >= 99% of 1 bit, >= 6.9 of 7 bits


def to_bf16_bits(array: np.ndarray, dtype: str) -> np.ndarray | None:
    """bf16 bit patterns of a floating-point tensor (None for integer tensors)."""
    if dtype == "BF16":
        return np.asarray(array)
    if dtype in ("F32", "F16", "F64"):
        return float32_to_bf16(np.ascontiguousarray(array, dtype=np.float32))
    return None


def measure(source: WeightSource, ctx: Context) -> dict[str, Any]:
    """Per-tensor and pooled field statistics of one checkpoint."""
    tensors, pooled, exp_hist = [], FieldStats.empty(), {}
    for name in ctx.track(source.names(), f"{source.label}: field entropy"):
        bits = to_bf16_bits(source.get(name), source.dtype(name))
        if bits is None or bits.size == 0:
            continue
        s = field_stats(bits)
        pooled = pooled + s
        kind = tensor_kind(name)
        tensors.append({
            "name": name, "kind": kind, "shape": list(bits.shape), "n": s.n, "dtype": source.dtype(name),
            "sign_bits": s.sign_entropy, "exponent_bits": s.exponent_entropy,
            "mantissa_bits": s.mantissa_entropy, "top16_coverage": s.top_k_coverage(16),
        })
        exp_hist[name] = s.exponent_counts
    matrices = [t for t in tensors if len(t["shape"]) >= 2]
    n_mat = sum(t["n"] for t in matrices)
    return {
        "weights": source.label,
        "description": source.description,
        "representative": source.representative,
        "note": source.note,
        "elements": pooled.n,
        "pooled": {
            "sign_bits": pooled.sign_entropy,
            "exponent_bits": pooled.exponent_entropy,
            "mantissa_bits": pooled.mantissa_entropy,
            "top16_coverage": pooled.top_k_coverage(16),
            "distinct_exponents": int((pooled.exponent_counts > 0).sum()),
        },
        # what a per-tensor coder sees: the element-weighted mean of per-tensor entropies (matrices)
        "per_tensor_mean_exponent_bits": sum(t["exponent_bits"] * t["n"] for t in matrices) / max(n_mat, 1),
        "tensors": tensors,
        "_exponent_hist": exp_hist,  # for the figure; not written to JSON
    }


def run(ctx: Context) -> Result:
    sources = ["minilm", "smollm2", *ctx.weights]
    results = [measure(open_weights(s), ctx) for s in sources]
    figure = plot(results, ctx)
    for r in results:
        r.pop("_exponent_hist")

    main = results[0]
    p = main["pooled"]
    verdicts = []
    for r in results:
        if not r["representative"]:
            continue
        q = r["pooled"]
        verdicts.append(abs(q["exponent_bits"] - ARTICLE_BITS) <= TOLERANCE_BITS
                        and q["sign_bits"] >= SIGN_MIN and q["mantissa_bits"] >= MANTISSA_MIN)
    verdict = "matches" if all(verdicts) else "differs"
    smol = results[1]["pooled"]
    return Result(
        clock="none",
        measured={"weights": results},
        summary=(f"exponent {p['exponent_bits']:.2f} bits, sign {p['sign_bits']:.3f}, mantissa "
                 f"{p['mantissa_bits']:.2f} of 7; top-16 cover {100 * p['top16_coverage']:.3f}% "
                 f"(MiniLM); SmolLM2* {smol['exponent_bits']:.2f} bits"),
        verdict=verdict,
        why=(f"'matches' means pooled exponent entropy within {TOLERANCE_BITS} bits of {ARTICLE_BITS} "
             f"and sign >= {SIGN_MIN}, mantissa >= {MANTISSA_MIN} bits, on every representative "
             "checkpoint. *SmolLM2 is dequantized 4-bit weights: reported, not judged."),
        setup={"weights": ", ".join(sources), "workload": "every floating-point tensor, cast to bf16 (RNE)"},
        article={"exponent_bits": ARTICLE_BITS, "sign_mantissa": "close to incompressible"},
        figures=[figure],
    )


def plot(results: list[dict[str, Any]], ctx: Context) -> str:
    """Per checkpoint: the exponent histogram of a typical MLP tensor, and entropy per tensor."""
    plt = pyplot()

    fig, axes = plt.subplots(len(results), 2, figsize=(13, 3.6 * len(results)), squeeze=False)
    for row, r in zip(axes, results, strict=True):
        flag = "" if r["representative"] else " (dequantized 4-bit: not representative)"
        mlp = [t for t in r["tensors"] if t["kind"] in MLP_KINDS] or r["tensors"]
        typical = sorted(mlp, key=lambda t: t["exponent_bits"])[len(mlp) // 2]  # median entropy
        counts = r["_exponent_hist"][typical["name"]]
        used = np.nonzero(counts)[0]
        top16 = set(np.argsort(counts)[::-1][:16])
        xs = np.arange(used.min(), used.max() + 1)
        row[0].bar(xs, counts[xs], color=["tab:blue" if x in top16 else "tab:red" for x in xs])
        row[0].set_yscale("log")
        row[0].set_xlabel("biased exponent (bf16)")
        row[0].set_ylabel("count")
        row[0].set_title(f"{r['weights']}: {typical['name']}\nH={typical['exponent_bits']:.2f} bits; "
                         f"blue = top-16 palette ({100 * typical['top16_coverage']:.3f}%)", fontsize=9)
        ts = [t for t in r["tensors"] if len(t["shape"]) >= 2]  # weight matrices
        idx = np.arange(len(ts))
        for field, color in [("exponent_bits", "tab:blue"), ("sign_bits", "tab:gray"),
                             ("mantissa_bits", "tab:orange")]:
            row[1].plot(idx, [t[field] for t in ts], ".", color=color, label=field.replace("_bits", ""))
        row[1].axhline(ARTICLE_BITS, color="k", ls="--", lw=0.8, label="article: 2.6 bits")
        row[1].set_xlabel("weight matrix (file order)")
        row[1].set_ylabel("Shannon entropy (bits)")
        row[1].set_title(f"{r['weights']}: entropy per tensor{flag}", fontsize=9)
        row[1].legend(fontsize=7, loc="center right")
    return save_figure(fig, ctx, "U1.png")


EXPERIMENT = Experiment(claim="U1", title="Entropy of the bf16 sign, exponent and mantissa fields",
                        run=run, quick_minutes=0.25, timed=False)
