"""U3's second figure: the rANS mode's ablation (see ``experiments/unweight/codec_ablation.py``), in bits per weight."""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.registry import Context, pyplot, save_figure


def plot_ablation(ab: dict[str, Any], rans: dict[str, Any], ctx: Context) -> str:
    plt = pyplot()

    fig, axes = plt.subplots(2, 3, figsize=(19, 10))
    _where_the_bits_go(axes[0, 0], ab)
    _ideas(axes[0, 1], ab)
    _coders(axes[0, 2], ab)
    _block_sweep(axes[1, 0], ab)
    _precision_sweeps(axes[1, 1], ab)
    _speed(axes[1, 2], rans)
    fig.suptitle(f"rANS mode ablation on {ab['label']} ({ab['weights'] / 1e6:.1f} M weights of compressed tensors; "
                 "every overhead counted)", fontsize=11)
    return save_figure(fig, ctx, "U3_ablation.png", dpi=100)


def _where_the_bits_go(ax: Any, ab: dict[str, Any]) -> None:
    """Each part of each mode's size, in bits per weight relative to the per-tensor bound 8 + H."""
    bound, r, u = ab["bound_bpw"], ab["where_the_bits_go"]["rans"], ab["where_the_bits_go"]["unweight"]
    rows = [
        ("Unweight: coded exponents - H", u["sign_mantissa"] + u["huffman_stream"] - bound, "tab:blue"),
        ("Unweight: verbatim chunks (exponents + ids)", u["verbatim_exponents"] + u["verbatim_ids"], "tab:blue"),
        ("Unweight: group offsets", u["group_offsets"], "tab:blue"),
        ("Unweight: header, padding", u["header_and_padding"], "tab:blue"),
        ("Unweight: TOTAL", ab["unweight_bpw"] - bound, "navy"),
        ("ZipNN: TOTAL", ab["zipnn_bpw"] - bound, "gray"),
        ("rANS: model (joint mantissa bits, clustered tables)", r["raw_bits"] + r["model"] - bound, "tab:green"),
        ("rANS: coder loss incl. lane states", r["coder_loss"], "tab:green"),
        ("rANS: escaped values", r["escapes"], "tab:green"),
        ("rANS: tables + alphabet", r["tables"], "tab:green"),
        ("rANS: block index, header", r["index"] + r["header"], "tab:green"),
        ("rANS: TOTAL", ab["final_bpw"] - bound, "darkgreen"),
    ]
    y = np.arange(len(rows))[::-1]
    ax.barh(y, [v for _, v, _ in rows], color=[c for _, _, c in rows])
    for yi, (_, v, _) in zip(y, rows, strict=True):
        ax.text(max(v, 0), yi, f" {v:+.4f}", va="center", ha="left", fontsize=7)
    ax.set_yticks(y, [label for label, _, _ in rows], fontsize=7)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel(f"bits per weight above the bound 8 + H = {bound:.3f}")
    ax.set_title("Where the bits go (negative: below the per-tensor bound)", fontsize=9)


def _ideas(ax: Any, ab: dict[str, Any]) -> None:
    kept = [(row["idea"], row["gain_bpw"], "tab:green") for row in ab["leave_one_out"]]
    dropped = [(row["idea"], -row["delta_bpw"], "tab:gray") for row in ab["dropped"]]
    rows = kept + dropped
    y = np.arange(len(rows))[::-1]
    ax.barh(y, [v for _, v, _ in rows], color=[c for _, _, c in rows])
    for yi, (_, v, _) in zip(y, rows, strict=True):
        ax.text(max(v, 0), yi, f" {v:+.4f}", va="center", ha="left", fontsize=7)
    ax.set_yticks(y, [_wrap(label) for label, _, _ in rows], fontsize=6.5)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("bits per weight saved (kept: lost without it; dropped: saved vs the final design)")
    ax.set_title("Each idea's measured gain (green: kept, gray: dropped)", fontsize=9)


def _coders(ax: Any, ab: dict[str, Any]) -> None:
    names = {"huffman": "Huffman (L=16)", "huffman_pairs": "Huffman over pairs", "rans": "rANS + lane states"}
    for i, (model, costs) in enumerate(ab["coders"].items()):
        keys = [k for k in names if k in costs]
        x = np.array([list(names).index(k) for k in keys]) + 0.4 * i
        ax.bar(x, [costs[k] - costs["entropy"] for k in keys], 0.38, label=model)
        for xi, k in zip(x, keys, strict=True):
            ax.text(xi, costs[k] - costs["entropy"], f"{costs[k] - costs['entropy']:.4f}", ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(np.arange(len(names)) + 0.2, list(names.values()), fontsize=8)
    ax.set_ylabel("bits per weight above the symbols' entropy")
    ax.set_title("Whole-bit rounding: same symbols and tables, 3 coders", fontsize=9)
    ax.legend(fontsize=7)


def _block_sweep(ax: Any, ab: dict[str, Any]) -> None:
    rows = ab["sweeps"]["block_size"]
    x = [r["weights_per_lane"] for r in rows]
    ax.plot(x, [r["bpw"] for r in rows], "o-", color="tab:green", label="rANS mode (32 lanes per block)")
    ax.axhline(ab["bound_bpw"], color="k", ls=":", lw=0.8, label="per-tensor bound 8 + H")
    ax.axhline(ab["zipnn_bpw"], color="gray", ls="--", lw=0.8, label="ZipNN")
    ax.axhline(ab["unweight_bpw"], color="tab:blue", ls="--", lw=0.8, label="Unweight mode (2048 weights per group)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("weights per lane (a GPU thread's sequential work) = block size / 32")
    ax.set_ylabel("bits per weight")
    ax.set_title("Decode-unit size: parallelism vs index cost (lane states, offsets)", fontsize=9)
    ax.legend(fontsize=7)


def _precision_sweeps(ax: Any, ab: dict[str, Any]) -> None:
    for key, label in (("prob_bits", "probability bits p (M = 2^p)"), ("mantissa_bits", "mantissa bits m coded")):
        rows = ab["sweeps"][key]
        ax.plot([r[key] for r in rows], [r["bpw"] for r in rows], "o-", label=label)
    ax.axhline(ab["final_bpw"], color="darkgreen", ls=":", lw=0.8, label="final design (p=12, m=2)")
    ax.set_xlabel("parameter value")
    ax.set_ylabel("bits per weight")
    ax.set_title("Table precision and mantissa bits coded with the exponent", fontsize=9)
    ax.legend(fontsize=7)


def _speed(ax: Any, rans: dict[str, Any]) -> None:
    values = [rans["unweight_decode_mbps"], rans["decode_mbps"]]
    ax.bar(["Unweight mode", "rANS mode"], values, color=["tab:blue", "tab:green"])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.0f} MB/s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("decode MB/s of bf16 (1 thread, this machine, best of 3)")
    ax.set_title(f"NumPy decode: rANS mode at {rans['decode_vs_unweight']:.2f}x Unweight's speed", fontsize=9)


def _wrap(text: str, width: int = 48) -> str:
    words, lines, line = text.split(), [], ""
    for w in words:
        if len(line) + len(w) + 1 > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    return "\n".join([*lines, line])
