"""``python -m experiments.concepts``: the concept figures of the guides, drawn from the code's own numbers.

    python -m experiments.concepts                  # every figure into paper/figures/
    python -m experiments.concepts --only block_table,e4_phase --out DIR

Each figure explains one idea a guide teaches, and takes its numbers from the code or a stored result where
there are any (the block tables from ``reference.kv.block_manager``, the codes from ``reference.codec.huffman``,
the palette tile from ``reference.codec`` on synthetic weights, the fleet from ``two_regions.toml``, the phase
diagram from ``experiments/results/E4.json``), so a figure changes when the code does:

* ``block_table``: two sequences with a shared 32-token prefix in a paged KV cache (reference/README.md);
* ``huffman_lookup``: decoding by table lookup, one peek of L bits per symbol (reference/codec/README.md);
* ``palette_tile``: a tile in palette form, index nibbles and a verbatim chunk (reference/codec/README.md);
* ``handoff_timeline``: the layer-wise P/D handoff on a time axis, against a bulk transfer
  (reference/README.md, reference/disagg/README.md);
* ``fleet_routing``: residency first, then the nearest tier with room (reference/cluster/README.md);
* ``e4_phase``: where disaggregation cuts p90 ITL, per GPU count, workload and load (experiments/README.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "paper" / "figures"
COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#9d755d", "#bab0ac"]


def _figure(w: float, h: float) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(w, h))


def _box(ax: Any, x: float, y: float, w: float, h: float, text: str, color: str, **kw: Any) -> None:
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", lw=0.8, **kw))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)


def block_table(ax: Any) -> None:
    """Two 40-token prompts whose first 32 tokens agree: the prefix cache gives the second the first's blocks."""
    from reference.kv.block_manager import BlockManager
    from reference.sched.sequence import Sequence

    bm = BlockManager(8, 16)
    a, b = Sequence(list(range(40))), Sequence([*range(32), *range(100, 108)])
    bm.allocate(a)
    a.num_computed_tokens = 40
    bm.cache_full_blocks(a)
    bm.allocate(b)
    shared = set(a.block_table) & set(b.block_table)
    for row, (name, seq) in enumerate([("sequence A", a), ("sequence B", b)]):
        y = 3 - 2 * row
        ax.text(-0.2, y + 0.4, f"{name}\n(40 tokens)", ha="right", va="center", fontsize=9)
        for i, block in enumerate(seq.block_table):
            _box(ax, i * 1.2, y, 1, 0.8, f"logical {i}\n-> {block}", COLORS[0] if block in shared else COLORS[1])
            ax.annotate("", xy=(block * 1.1 + 0.5 + 4.5, 0.8), xytext=(i * 1.2 + 0.5, y),
                        arrowprops={"arrowstyle": "->", "lw": 0.7, "color": "gray"})
    for block in range(8):
        used = block in a.block_table or block in b.block_table
        refs = (block in a.block_table) + (block in b.block_table)
        _box(ax, block * 1.1 + 4.5, 0, 1, 0.8, f"{block}" + (f"\nref {refs}" if used else "\nfree"),
             COLORS[0] if block in shared else COLORS[1] if used else "white")
    ax.text(4.5, -0.5, "physical KV blocks (16 tokens each); blue: the shared prefix, found by its chained hash",
            fontsize=8)
    ax.set_xlim(-2.5, 13.5)
    ax.set_ylim(-0.8, 4.2)
    ax.set_title("A paged KV cache: block tables and a shared prefix")


def huffman_lookup(ax: Any) -> None:
    """Canonical codes of a small alphabet, and the decoding table: peek L bits, one lookup, (symbol, length)."""
    from reference.codec.huffman import canonical_codes, code_lengths

    symbols, counts = [121, 120, 122, 119, 123], [900, 300, 120, 40, 5]
    lengths = code_lengths(counts, max_length=4)
    codes = canonical_codes(lengths)
    ax.text(0, 9.2, "exponent  count  code", fontsize=9, family="monospace", weight="bold")
    for i, (s, c, n, code) in enumerate(zip(symbols, counts, lengths, codes, strict=True)):
        ax.text(0, 8.4 - 0.8 * i, f"{s:8d}  {c:5d}  {code:0{n}b}", fontsize=9, family="monospace")
    max_len = max(lengths)
    ax.text(6, 9.2, f"table of 2^{max_len} entries: index = the next {max_len} bits", fontsize=9, weight="bold")
    for index in range(1 << max_len):
        for s, n, code in zip(symbols, lengths, codes, strict=True):
            if index >> (max_len - n) == code:
                y = 8.4 - 0.5 * index
                ax.text(6, y, f"{index:0{max_len}b} -> exp {s}, {n} bit{'s' if n > 1 else ''}", fontsize=7,
                        family="monospace", color=COLORS[symbols.index(s) % len(COLORS)])
    stream = "".join(f"{codes[symbols.index(s)]:0{lengths[symbols.index(s)]}b}" for s in [121, 120, 121, 122])
    ax.text(0, 3.4, f"stream: {stream}", fontsize=9, family="monospace")
    pos, y = 0, 2.7
    padded = stream + "0" * max_len
    while pos < len(stream):
        window = padded[pos:pos + max_len]
        n, s = next((n, s) for s, n, c in zip(symbols, lengths, codes, strict=True)
                    if int(window, 2) >> (max_len - n) == c)
        ax.text(0, y, f"at bit {pos}: peek {window} -> {s}, advance {n}", fontsize=8, family="monospace")
        pos, y = pos + n, y - 0.6
    ax.set_xlim(-0.5, 13)
    ax.set_ylim(-0.5, 10)
    ax.axis("off")
    ax.set_title("Huffman decoding by lookup: one table read per exponent")


def palette_tile(ax: Any) -> None:
    """A 4 x 16 tile of synthetic weights in palette form: 4-bit indexes into 16 exponents, a verbatim chunk."""
    from reference.codec.codec import encode
    from reference.codec.paletteform import to_palette, unpack_nibbles
    from reference.synthetic import synthetic_weights

    w = synthetic_weights((4, 64), np.random.default_rng(3))
    w[2, :16] = (w[2, :16] & 0x807F) | (0x60 << 7)  # a rare exponent (96): that chunk goes verbatim
    pt = to_palette(encode(w, chunk_size=16))
    idx = unpack_nibbles(pt.idx, 64)[:, :16]
    verbatim = {int(c) for c in pt.vchunks}
    for r in range(4):
        for c in range(16):
            chunk = r * 4 + c // 16
            v = chunk in verbatim
            _box(ax, c, 3 - r, 1, 1, f"{int(w[r, c]) >> 7 & 0xFF}" if v else f"{idx[r, c]:x}",
                 COLORS[3] if v else plt_color(int(idx[r, c])))
    ax.text(0, 4.3, "index nibbles (hex) of a 4 x 16 tile; red: a verbatim chunk, its exponents stored whole",
            fontsize=8)
    for i, e in enumerate(pt.palette[:pt.palette_size]):
        _box(ax, 17.5 + (i % 4), 3 - i // 4, 1, 1, f"{i:x}:{e}", plt_color(i))
    ax.text(17.5, 4.3, "palette: index -> exponent", fontsize=8)
    ax.text(0, -0.8, "bf16 = sign | palette[index] | mantissa: the sign+mantissa byte (sm) is stored beside, one "
            "per weight", fontsize=8)
    ax.set_xlim(-0.5, 22)
    ax.set_ylim(-1.2, 4.8)
    ax.axis("off")
    ax.set_title("The palette form: 4 bits of exponent per weight, decoded in registers")


def plt_color(i: int) -> str:
    import matplotlib

    return matplotlib.colors.to_hex(matplotlib.colormaps["tab20"](i % 20))


def handoff_timeline(ax: Any) -> None:
    """Prefill of L layers, each layer's KV sent while the next computes; DONE; decode. Below, a bulk transfer."""
    layers, compute, send = 6, 1.0, 0.7
    for row, (label, layerwise) in enumerate([("layer-wise (ours)", True), ("bulk, after the prefill", False)]):
        y = 3.2 - 2.2 * row
        ax.text(-0.3, y + 0.5, label, ha="right", va="center", fontsize=9)
        for i in range(layers):
            _box(ax, i * compute, y + 0.5, compute, 0.45, f"L{i}", COLORS[0])
        end = layers * compute
        for i in range(layers):
            start = (i + 1) * compute if layerwise else end + i * send
            _box(ax, start, y, send, 0.45, f"KV{i}", COLORS[1])
        done = (layers * compute + send) if layerwise else end + layers * send
        ax.axvline(done, ymin=0, ymax=1, color="gray", lw=0.5, ls=":")
        _box(ax, done, y, 0.9, 0.95, "DONE", COLORS[2])
        for s in range(3):
            _box(ax, done + 1.0 + s * 0.8, y + 0.25, 0.7, 0.45, "tok", COLORS[4])
    ax.text(0, 4.5, "prefill worker computes layers (blue); KV of each layer on the wire (orange); the decode "
            "worker checks the digest at DONE, then decodes", fontsize=8)
    ax.set_xlim(-4, 14)
    ax.set_ylim(0.6, 4.8)
    ax.set_yticks([])
    ax.set_xlabel("time (compute of one layer = 1)")
    ax.set_title("The P/D handoff: the transfer hides behind the prefill")


def fleet_routing(ax: Any) -> None:
    """The sites of two_regions.toml by jurisdiction and tier; a request may go only where residency allows."""
    from reference.cluster.scenario import load_scenario

    s = load_scenario(REPO / "reference/cluster/examples/two_regions.toml")
    tiers = ["edge", "regional", "central"]
    regions = sorted({site.jurisdiction for site in s.sites.values()})
    place: dict[str, tuple[float, float]] = {}
    for name, site in s.sites.items():
        col = regions.index(site.jurisdiction) * 5
        row = tiers.index(site.tier) if site.tier in tiers else 2
        n = sum(1 for p in place.values() if p[0] // 5 == col // 5 and p[1] == row * 1.6)
        place[name] = (col + n * 2.2, row * 1.6)
        gpus = ", ".join(f"{k} x{v}" for k, v in site.gpus.items())
        _box(ax, *place[name], 2, 1, f"{name}\n{site.tier}, {gpus}", COLORS[row])
    for i, region in enumerate(regions):
        ax.text(i * 5 + 2, 5.2, f"jurisdiction {region}", ha="center", fontsize=9, weight="bold")
        ax.plot([i * 5 - 0.4] * 2, [-1.6, 5.5], color="black", lw=0.5)
        edge = next((p for n, p in place.items() if s.sites[n].jurisdiction == region and s.sites[n].tier == "edge"),
                    None)
        up = next((p for n, p in place.items() if s.sites[n].jurisdiction == region and s.sites[n].tier != "edge"),
                  None)
        if edge:
            ax.annotate(f"user in {region}", xy=(edge[0] + 1, edge[1]), xytext=(edge[0] + 1, -1.2), ha="center",
                        fontsize=8, arrowprops={"arrowstyle": "->"})
        if edge and up:
            ax.annotate("", xy=(up[0] + 1, up[1]), xytext=(edge[0] + 1, edge[1] + 1),
                        arrowprops={"arrowstyle": "->", "ls": "--"})
    ax.text(-0.3, -2.1, "a request is served only in an allowed jurisdiction; among those, at the nearest tier "
            "with room (dashed: overflow up a tier)", fontsize=8)
    ax.set_xlim(-0.6, 5 * len(regions))
    ax.set_ylim(-2.4, 5.6)
    ax.axis("off")
    ax.set_title("Fleet routing: residency first, then tier")


def e4_phase(ax: Any) -> None:
    """E4's stored sweep: p90 ITL cut (colocated best / disaggregated best) per point; x: the SLO missed."""
    data = json.loads((REPO / "experiments/results/E4.json").read_text())
    sweep = data["measured"]["sweep"]
    rows = sorted({(p["gpus"], p["workload"]) for p in sweep})
    loads = sorted({p["load"] for p in sweep})
    grid = np.full((len(rows), len(loads)), np.nan)
    for p in sweep:
        i, j = rows.index((p["gpus"], p["workload"])), loads.index(p["load"])
        grid[i, j] = p["p90_itl_cut"]
        note = f"{p['p90_itl_cut']:.2f}" + ("" if p["disaggregated_meets_ttft"] else " x")
        ax.text(j, i, note, ha="center", va="center", fontsize=8)
    im = ax.imshow(np.log2(grid), cmap="RdBu", vmin=-2, vmax=2, aspect="auto")
    ax.set_xticks(range(len(loads)), [f"load {x:g}" for x in loads])
    ax.set_yticks(range(len(rows)), [f"{g} GPUs, {w}" for g, w in rows])
    cbar = ax.figure.colorbar(im, ax=ax, ticks=[-2, -1, 0, 1, 2])
    cbar.ax.set_yticklabels(["0.25x", "0.5x", "1x", "2x", "4x"])
    cbar.set_label("p90 ITL cut by disaggregation (>= 3x: the article's regime)")
    ax.set_title("E4: where disaggregation cuts p90 ITL (each setup at its best; x: TTFT SLO missed)", fontsize=9)


FIGURES: dict[str, tuple[Callable[[Any], None], tuple[float, float]]] = {
    "block_table": (block_table, (10, 4.5)),
    "huffman_lookup": (huffman_lookup, (10, 5.5)),
    "palette_tile": (palette_tile, (11, 3.8)),
    "handoff_timeline": (handoff_timeline, (11, 4)),
    "fleet_routing": (fleet_routing, (9, 5)),
    "e4_phase": (e4_phase, (8, 4.5)),
}


def draw(name: str, out: Path) -> Path:
    """Draw one figure into ``out/NAME.png``."""
    fn, size = FIGURES[name]
    fig, ax = _figure(*size)
    fn(ax)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.concepts", description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help=f"comma-separated figure names (default: all of {', '.join(FIGURES)})")
    p.add_argument("--out", type=Path, default=OUT, help="the folder to write into (default paper/figures/)")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        p.error(f"unknown figure(s) {', '.join(unknown)}; known: {', '.join(FIGURES)}")
    for name in names:
        print(draw(name, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
