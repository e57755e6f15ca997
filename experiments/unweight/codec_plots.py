"""Figures of the codec experiments. U3: ratio per kind for each codec, the MLP bound check, the sweeps, speeds."""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.registry import Context, pyplot, save_figure

METHOD_LABELS = {"bound": "entropy bound (8+H)/16", "unweight": "Unweight (ours)", "rans": "rANS mode (ours, new)",
                 "full_alphabet": "full-alphabet Huffman", "zipnn": "ZipNN", "zstd3": "zstd-3", "zstd19": "zstd-19"}


def plot(models: list[dict[str, Any]], mlp_check: list[dict[str, Any]], ctx: Context) -> str:
    plt = pyplot()

    fig, axes = plt.subplots(2, 3, figsize=(18, 9.5))
    for ax, m in zip(axes[0, :2], models[:2], strict=False):
        _kinds(ax, m)
    _bound_check(axes[0, 2], mlp_check, models[0]["weights"])
    _sweep(axes[1, 0], models[0])
    _lengths(axes[1, 1], models[0])
    _speeds(axes[1, 2], models[0])
    return save_figure(fig, ctx, "U3.png", dpi=100)


def _kinds(ax: Any, m: dict[str, Any]) -> None:
    groups = [k for k, v in m["per_kind"].items() if not v["passed_through"]]
    rows = [(k, m["per_kind"][k]) for k in groups] + [("MLP", m["mlp"]), ("whole model", m["whole_model"])]
    methods = [k for k in ("bound", "unweight", "rans", "full_alphabet", "zipnn", "zstd3") if k in m["whole_model"]]
    width = 0.8 / len(methods)
    x = np.arange(len(rows))
    for i, method in enumerate(methods):
        ax.bar(x + i * width, [r[method] for _, r in rows], width, label=METHOD_LABELS[method])
    ax.axhline(1.44, color="k", ls="--", lw=0.8, label="article: 1.44x (MLP, Llama-3.1-8B)")
    ax.set_xticks(x + 0.4 - width / 2, [k for k, _ in rows], rotation=30, fontsize=8)
    ax.set_ylim(1.0, max(r["bound"] for _, r in rows) * 1.08)
    ax.set_ylabel("compression ratio (bf16 bytes / compressed)")
    flag = "" if m["representative"] else " (dequantized 4-bit: NOT representative)"
    ax.set_title(f"{m['weights']}: ratio per tensor kind{flag}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")


def _bound_check(ax: Any, checks: list[dict[str, Any]], label: str) -> None:
    gaps = [100 * c["gap_to_bound"] for c in checks]
    ax.bar(range(len(gaps)), gaps, color=["tab:green" if c["within"] else "tab:red" for c in checks])
    ax.axhline(1.5, color="k", ls="--", lw=0.8, label="acceptance: 1.5%")
    ax.set_xticks(range(len(gaps)), [c["name"].replace("encoder.layer.", "L").replace(".weight", "")
                                     for c in checks], rotation=60, fontsize=6)
    ax.set_ylabel("our size above the bound (%)")
    ax.set_title(f"{label}: every MLP tensor vs (8+H)/16, all overheads counted", fontsize=9)
    ax.legend(fontsize=7)


def _sweep(ax: Any, m: dict[str, Any]) -> None:
    grid = m["sweep"]["palette_x_chunk"]
    for p in sorted({g["palette_size"] for g in grid}):
        pts = [g for g in grid if g["palette_size"] == p]
        ax.plot([g["chunk_size"] for g in pts], [g["all"] for g in pts], "o-", label=f"palette {p}")
    ax.axhline(_bound_of_compressed(m), color="k", ls=":", lw=0.8,
               label="entropy bound")
    ax.set_xscale("log", base=2)
    ax.set_xticks([32, 64, 128], ["32", "64", "128"])
    ax.set_xlabel("chunk length (weights per verbatim unit)")
    ax.set_ylabel("ratio over the compressed tensors")
    ax.set_title(f"{m['weights']}: palette size x chunk length", fontsize=9)
    ax.legend(fontsize=7)


def _bound_of_compressed(m: dict[str, Any]) -> float:
    ts = [t for t in m["tensors"] if t["compressed"]]
    return sum(t["bf16_bytes"] for t in ts) / sum(t["bound_bytes"] for t in ts)


def _lengths(ax: Any, m: dict[str, Any]) -> None:
    rows = m["sweep"]["max_code_length"]
    ax.plot([r["max_code_length"] for r in rows], [r["all"] for r in rows], "o-", label="all compressed tensors")
    ax.plot([r["max_code_length"] for r in rows], [r["mlp"] for r in rows], "s-", label="MLP tensors")
    ax.set_xlabel("max code length L (decoder table: 2^L entries)")
    ax.set_ylabel("ratio")
    ax.set_title(f"{m['weights']}: cost of limiting code lengths (palette 16, chunks of 64)", fontsize=9)
    ax.legend(fontsize=7)


def _speeds(ax: Any, m: dict[str, Any]) -> None:
    methods = list(m["speed_mbps"])
    x = np.arange(len(methods))
    ax.bar(x - 0.2, [m["speed_mbps"][k]["encode_mbps"] for k in methods], 0.4, label="encode")
    ax.bar(x + 0.2, [m["speed_mbps"][k]["decode_mbps"] for k in methods], 0.4, label="decode")
    ax.axhline(100, color="k", ls="--", lw=0.8, label="target: decode >= 100 MB/s")
    ax.set_yscale("log")
    ax.set_xticks(x, [METHOD_LABELS[k] for k in methods], rotation=20, fontsize=8)
    ax.set_ylabel("MB/s of bf16 data (1 thread, this machine)")
    ax.set_title(f"{m['weights']}: codec speed", fontsize=9)
    ax.legend(fontsize=7)
