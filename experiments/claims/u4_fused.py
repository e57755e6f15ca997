"""U4: decompression on-chip, fused into the matmul; lossless; speed against the bf16 matmul.

What runs without a GPU (the quick run, on CPU): every MiniLM weight matrix goes through the fast
path a serving process would take: the torch encoder (Huffman form, byte-identical to the reference
encoder is checked by the conformance suite), the Huffman -> palette transcode (plain torch), then
the Triton palette decoder (under TRITON_INTERPRET=1) and, for a few matrices, the fused
palette-decode matmul against the same Triton kernel on the decoded weights. Counted: weights that
come back bit-exact, bits per weight of each form, fused results equal bit for bit.

Speed on the CPU (measured in every run, quick or full, on any CPU): the C tile products of
``experiments/unweight/bench_fused_cpu.py`` (each palette tile decoded right before its product, in the
instruction set in force: AMX, AVX-512 BF16, AVX2 or NEON, ``UNFIRE_CPU_ISA``, named in the result) on
SmolLM2's projections (all 30 layers), against the plain products at rows 1-256; the full benchmark's
stored batch curve (experiments/results/bench_fused_cpu.json) is drawn beside it. On a Hopper GPU:
``python -m experiments.gpu_check`` writes experiments/results/gpu_bench.json, reported when present.
"""

from __future__ import annotations

import json
from typing import Any

from experiments.claims.u1_entropy import to_bf16_bits
from experiments.registry import RESULTS_DIR, Context, Experiment, Result, pyplot, save_figure
from reference.model.names import MLP_KINDS, tensor_kind
from reference.model.weights import open_weights

INTERPRETER_TILES = (256, 512)  # (block rows, block columns) of the palette decoder under TRITON_INTERPRET=1
ARTICLE = {"slowdown_vs_bf16_h100": "30-40% lower throughput than bf16 (public Unweight kernels)",
           "memory_bound_limit": "16/12 = 1.33x faster than bf16 at batch 1", "lossless": True}


def lossless(ctx: Context) -> dict[str, Any]:
    import torch

    import fast  # noqa: F401  (without CUDA this switches Triton's interpreter on, before triton is imported)
    from fast.bf16 import from_numpy_bits
    from fast.codec.decode_torch import transcode_torch
    from fast.codec.encode import encode
    from fast.codec.matmul_triton import MatmulConfig, fused_matmul, matmul
    from fast.codec.palette_triton import decode_palette
    from fast.triton_util import on_interpreter

    # quick run under the interpreter, which pays per operation, not per element: wider tiles than decode_config's
    # 64 x 256 decode the same bits in fewer steps (the same kernel; conformance checks it at its own tile sizes)
    tiles = INTERPRETER_TILES if on_interpreter() and not ctx.full else (None, None)
    source = open_weights("minilm")
    rows, fused = [], []
    names = [n for n in source.names() if source.dtype(n) == "F32" and len(source.get(n).shape) == 2
             and source.get(n).size >= 4096]
    for name in ctx.track(names, "U4: encode, transcode, decode (Triton, interpreter)"):
        bits = to_bf16_bits(source.get(name), source.dtype(name))
        w = from_numpy_bits(bits)
        hform = encode(w)
        pform = transcode_torch(hform)
        decoded = decode_palette(pform, *tiles)
        exact = torch.equal(decoded.view(torch.int16), w.view(torch.int16))
        rows.append({"name": name, "kind": tensor_kind(name), "shape": list(bits.shape), "n": int(bits.size),
                     "bit_exact": bool(exact), "huffman_bits_per_weight": 8 * hform.nbytes() / bits.size,
                     "palette_bits_per_weight": 8 * pform.nbytes() / bits.size,
                     "verbatim_chunks": int(pform.vchunks.numel())})
        if tensor_kind(name) in MLP_KINDS and len(fused) < (6 if ctx.full else 2):
            x = torch.randn(3, bits.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            cfg = MatmulConfig(16, 64, 64, 2)
            same = torch.equal(fused_matmul(x, pform, config=cfg).view(torch.int16),
                               matmul(x, decoded, config=cfg).view(torch.int16))
            fused.append({"name": name, "batch": 3, "fused_equals_plain_on_decoded": bool(same)})
    return {"tensors": rows, "fused": fused,
            "decode_tiles": "decode_config's" if tiles[0] is None else f"{tiles[0]} x {tiles[1]}"}


def gpu_results() -> dict[str, Any] | None:
    path = RESULTS_DIR / "gpu_bench.json"
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    return None if doc.get("tiny") else doc


def cpu_speed(ctx: Context) -> dict[str, Any] | None:
    """The tile products' speed on this CPU, with the instruction set in force (None without a C compiler)."""
    from experiments.unweight.bench_fused_cpu import measure
    from fast.codec import matmul_c

    if matmul_c.library() is None:
        return None
    # every layer even in a quick run: 4 layers' weights stay in cache, which hides the bytes the
    # compressed form saves (served, a model's weights stream from memory at every step)
    return measure("smollm2", None, [1], 5 if ctx.full else 3, rows_list=(1, 4, 16, 64, 256), verbose=False)


def run(ctx: Context) -> Result:
    measured = lossless(ctx)
    measured["cpu"] = cpu_speed(ctx)
    rows = measured["tensors"]
    n = sum(r["n"] for r in rows)
    all_exact = all(r["bit_exact"] for r in rows) and all(f["fused_equals_plain_on_decoded"] for f in measured["fused"])
    pal = sum(r["palette_bits_per_weight"] * r["n"] for r in rows) / n
    huf = sum(r["huffman_bits_per_weight"] * r["n"] for r in rows) / n
    gpu = gpu_results()
    measured["gpu"] = gpu
    lossless_text = (f"{len(rows)} MiniLM matrices ({n / 1e6:.1f} M weights) decode bit-exact: "
                     f"{'yes' if all_exact else 'NO'}; palette form {pal:.2f} bits/weight, Huffman {huf:.2f}")
    cpu = measured["cpu"]
    cpu_text = "" if cpu is None else ". CPU (measured now): " + cpu_summary(cpu)
    if gpu is None and cpu is None:
        verdict = "partly measured"
        why = (lossless_text + ". Speed needs a C compiler (the CPU's tile products) or a Hopper "
               "GPU (`python -m experiments.gpu_check`, results in experiments/results/gpu_bench.json).")
    else:
        verdict = "measured"
        why = lossless_text + cpu_text + ("" if gpu is None else
                                          f". GPU numbers quoted from experiments/results/gpu_bench.json "
                                          f"({gpu.get('date')}, commit {gpu.get('commit')}).")
    figure = plot(rows, gpu, ctx, measured["cpu"])
    return Result(
        clock="wall",
        clock_detail=("CPU: wall time of the C tile products over every projection of SmolLM2, plain and compressed "
                      "alternating (bench_fused_cpu.measure); GPU: CUDA events in the GPU benchmark (quoted)"),
        measured=measured, summary=summarize({"measured": measured}), verdict=verdict, why=why, figures=[figure],
        setup={"weights": "minilm (every 2-D float tensor with >= 4096 weights, cast to bf16 with RNE)",
               "kernels": ("Triton under TRITON_INTERPRET=1 on CPU (palette decoder tiles: "
                           f"{measured['decode_tiles']}); natively on a GPU via experiments/gpu_check.py")},
        article=ARTICLE,
    )


def cpu_summary(cpu: dict[str, Any]) -> str:
    """Compressed vs plain speed by rows, as the engine serves (same bits), with the CPU and its instruction set."""
    parts = [f"{r['rows']} rows {r['engine_compressed_vs_engine_plain']:.2f}x" for r in cpu["rows"]]
    b1 = next(r for r in cpu["rows"] if r["rows"] == 1)
    gbps = b1.get("gbps_engine_compressed", b1.get("gbps_tile_compressed", 0.0))  # the key before 2026-12-05
    isa = cpu.get("engine_isa")
    how = (f"{isa} at every row count: batch-invariant" if isa else "AMX at every row count: batch-invariant"
           if "gbps_engine_compressed" in b1 else "torch's oneDNN above 4 rows")
    where = f" on {cpu['cpu']}" if cpu.get("cpu") else ""
    return (f"C tile products (fast/codec/native/tile_matmul.c; {how}){where}, SmolLM2 "
            f"({cpu['layers']} layers) compressed/plain speed as served: " + ", ".join(parts)
            + f"; batch 1 streams {gbps:.1f} GB/s of compressed weights "
            f"(one-thread read bandwidth {cpu['read_bandwidth_gbps_one_thread']:.1f} GB/s)")


def summarize(record: dict[str, Any]) -> str:
    """The table cell from a U4 record, naming the code: on the CPU the fast path's kernels run in Triton's
    interpreter (lossless checked, no speed); a speed comes only from a GPU run, against cuBLAS."""
    m = record["measured"]
    rows, gpu = m["tensors"], m.get("gpu")
    pal = sum(r["palette_bits_per_weight"] * r["n"] for r in rows) / sum(r["n"] for r in rows)
    if m.get("cpu"):
        return f"lossless ({pal:.2f} bits/weight in palette form); CPU: " + cpu_summary(m["cpu"])
    if gpu is None:
        return (f"lossless on CPU (fast/ torch encoder, Triton palette decoder and fused matmul in Triton's "
                f"interpreter: {pal:.2f} bits/weight in palette form); speed not measured (no GPU run)")
    b1 = gpu["goals"].get("fused_b1_speedup_vs_cublas")
    return (f"{gpu['device']}: fused Triton palette-decode matmul at batch 1 = {b1:.2f}x cuBLAS bf16; Triton palette "
            f"decode {gpu['goals']['palette_decode_TBps']:.2f} TB/s; lossless")


def plot(rows: list[dict[str, Any]], gpu: dict[str, Any] | None, ctx: Context,
         cpu: dict[str, Any] | None = None) -> str:
    """Bits per weight of each form per matrix; the CPU's speed ratios by batch (measured in this run);
    with GPU results, fused / cuBLAS speed by batch."""
    plt = pyplot()

    panels = 1 + (cpu is not None) + (gpu is not None)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 3.8), squeeze=False)
    ax = axes[0][0]
    idx = range(len(rows))
    ax.axhline(16, color="k", lw=0.8, ls="--", label="bf16")
    ax.plot(idx, [r["palette_bits_per_weight"] for r in rows], "o", ms=3, label="palette form (inference)")
    ax.plot(idx, [r["huffman_bits_per_weight"] for r in rows], "s", ms=3, label="Huffman form (storage)")
    ax.set_xlabel("MiniLM weight matrix (file order)")
    ax.set_ylabel("bits per weight")
    ax.set_ylim(0, 17)
    ax.set_title("U4: every matrix decodes bit-exact; size of each form", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    if cpu is not None:
        ax = axes[0][1]
        rs = [r for r in cpu["rows"] if r["threads"] == 1]
        ms = [r["rows"] for r in rs]
        ax.plot(ms, [r["engine_compressed_vs_engine_plain"] for r in rs], "ro-", label="compressed / plain (as served)")
        if all("engine_plain_vs_onednn" in r for r in rs):
            ax.plot(ms, [r["engine_plain_vs_onednn"] for r in rs], "bs-", label="plain tiles / oneDNN")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows per product (batch)")
        ax.set_ylabel("speed ratio (one thread)")
        ax.set_title(f"CPU tile products, SmolLM2 ({cpu['layers']} layers), every projection", fontsize=9)
        ax.legend(fontsize=7)
    if gpu:
        ax = axes[0][-1]
        for shape in sorted({tuple(r["shape"]) for r in gpu["matmul"]}):
            pts = [(r["batch"], r["fused_speedup_vs_cublas"]) for r in gpu["matmul"] if tuple(r["shape"]) == shape]
            ax.plot(*zip(*pts, strict=True), "o-", label=f"W {shape[0]}x{shape[1]}")
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="cuBLAS bf16")
        ax.axhline(16 / 12, color="g", lw=0.8, ls=":", label="memory-bound limit 16/12")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("fused speed / cuBLAS speed")
        ax.set_title(f"{gpu['device']}", fontsize=9)
        ax.legend(fontsize=7)
    return save_figure(fig, ctx, "U4.png")


EXPERIMENT = Experiment(claim="U4", title="On-chip decode fused into the matmul: lossless, and its speed",
                        run=run, quick_minutes=1.5, summarize=summarize,
                        quotes=("experiments/results/gpu_bench.json",))  # the GPU row, when a GPU run stored it
