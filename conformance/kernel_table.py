"""``python -m conformance.kernel_table GATE.json``: the per-kernel table of fast/README.md, in Markdown.

From the compile gate's results (``python -m conformance --compile sm_90 --all --json GATE.json``):
registers, spills, shared memory and occupancy on H100 of each kernel's default configuration at
Llama-3.1-8B shapes, and its roofline time on H200: bytes moved and FLOPs over 4.8 TB/s and
989 TFLOP/s (dense bf16), i.e. max(bytes / bandwidth, FLOPs / peak), next to cuBLAS bf16's roofline
for the same product. These are bounds (the physical limit each kernel is to be timed against),
not measurements.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from conformance.compile_gate import occupancy
from conformance.real_shapes import BLOCK, CODEC_SHAPE, HEAD_DIM, HEADS, KV_HEADS, PROJECTIONS

BW, PEAK = 4.8e12, 989e12  # H200 SXM: HBM3e bytes/s, dense bf16 tensor-core FLOP/s (datasheet)
FMA_PEAK = 67e12  # H200 SXM: float32 FLOP/s on the CUDA cores (datasheet): the attention kernels' dots
PALETTE_BYTES = 1.5  # a weight in palette form: a 4-bit index and the sm byte (verbatim chunks aside)
CONTEXT = 4096  # decode attention: tokens of context per sequence


def bound_us(nbytes: float, flops: float, peak: float = PEAK) -> float:
    """Roofline time in microseconds on H200."""
    return 1e6 * max(nbytes / BW, flops / peak)


def _find(results: list[dict], kernel: str, origin_start: str) -> dict | None:
    for r in results:
        if r["kernel"].endswith(kernel) and (r["origin"].startswith(origin_start)
                                             or any(o.startswith(origin_start) for o in r.get("origins", []))):
            return r
    return None


def _hw(r: dict | None) -> str:
    if r is None:
        return "not compiled | | |"
    occ = occupancy(r["registers"], r["smem"], r["num_warps"])
    return f"{r['registers']} ({r['spill_bytes']} spill) | {r['smem'] / 1024:.1f} KiB | {r['num_warps']}w, {occ:.0%}"


def matmul_rows(results: list[dict]) -> list[str]:
    out = ["| projection [N x K] | batch | plain: regs (spill) | plain: smem | plain: warps, occupancy | "
           "fused: regs (spill) | fused: smem | fused: warps, occupancy | cuBLAS bf16 roofline (= plain) | "
           "fused roofline |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, (n, k) in PROJECTIONS.items():
        for m in (1, 4, 16, 64, 256):
            plain = _find(results, "_matmul_kernel", f"llama8b.{name}.b{m}.plain on H100")
            fused = _find(results, "_matmul_kernel", f"llama8b.{name}.b{m}.fused on H100")
            act = 2 * m * k + 2 * m * n
            flops = 2 * m * n * k
            plain_us, fused_us = bound_us(2 * n * k + act, flops), bound_us(PALETTE_BYTES * n * k + act, flops)
            out.append(f"| {name} [{n} x {k}] | {m} | {_hw(plain)} | {_hw(fused)} | {plain_us:.1f} us | "
                       f"{fused_us:.1f} us |")
    return out


def other_rows(results: list[dict]) -> list[str]:
    rows, cols = CODEC_SHAPE
    n = rows * cols
    out = ["| kernel | at | regs (spill) | smem | warps, occupancy | bytes | FLOPs | H200 roofline, as the kernel "
           "computes | cuBLAS bf16 roofline, same product |",
           "|---|---|---|---|---|---|---|---|---|"]

    def row(kernel: str, origin: str, label: str, nbytes: float, flops: float, fma: bool = False) -> None:
        r = _find(results, kernel, origin)
        own = bound_us(nbytes, flops, FMA_PEAK if fma else PEAK)
        blas = f"{bound_us(nbytes, flops):.1f} us" if flops else "n/a"
        out.append(f"| {kernel.strip('_')} | {label} | {_hw(r)} | {nbytes / 1e6:.1f} MB | {flops / 1e9:.2f} G | "
                   f"{own:.1f} us{' (fp32 FMA)' if fma else ''} | {blas} |")

    row("_palette_decode_kernel", "codec", f"{rows}x{cols}", n * (PALETTE_BYTES + 2), 0)
    row("_huffman_kernel", "codec 4096x14336 on H100 SXM (Huffman decode)",
        f"{rows}x{cols} decode, 3 bits/exponent assumed", n * (3 / 8 + 1 + 2), 0)
    row("_huffman_kernel", "codec 4096x14336 on H100 SXM (Huffman transcode)",
        f"{rows}x{cols} transcode, 3 bits/exponent assumed", n * (3 / 8 + 1), 0)
    row("_round_kernel", "bf16 rounding", f"{n} values", n * 6, 0)
    for cache, elt in (("bf16", 2), ("fp8", 1), ("fp32", 4)):
        for batch in (1, 64):
            kv = batch * CONTEXT * KV_HEADS * HEAD_DIM * 2 * elt
            row("_decode_kernel", f"kv.decode {cache} cache, bfloat16 q, batch {batch},",
                f"{cache} cache, batch {batch}, {CONTEXT} context", kv, 4 * batch * HEADS * CONTEXT * HEAD_DIM, True)
        chunk = 512
        kv = chunk * KV_HEADS * HEAD_DIM * 2 * elt
        qo = 2 * chunk * HEADS * HEAD_DIM * 2
        row("_prefill_kernel", f"kv.prefill 512-token chunk, {cache} cache, bfloat16",
            f"{cache} cache, {chunk}-token chunk, causal", kv + qo, 4 * HEADS * HEAD_DIM * chunk * chunk / 2, True)
    row("_copy_kernel", "kv.write 512 tokens, bfloat16 into a bf16", "512 tokens into a bf16 cache (K or V)",
        2 * 512 * KV_HEADS * HEAD_DIM * 2, 0)
    row("_encode_kernel", "kv.write 512 tokens, bfloat16 into a fp8", "512 tokens into an fp8 cache (K or V)",
        512 * KV_HEADS * HEAD_DIM * 3, 0)
    return out


def table(doc: dict) -> str:
    results = doc["results"]
    head = (f"Compile gate results for {doc['target']} with triton {doc['triton']} at commit {doc.get('commit', '?')}; "
            f"occupancy from registers, shared memory and warps on H100 (64K registers, 228 KiB, 64 warps per SM). "
            f"Roofline times are bounds on H200 (4.8 TB/s; 989 TFLOP/s bf16 tensor cores, 67 TFLOP/s float32 on the "
            f"CUDA cores, where the attention kernels' IEEE float32 dots run), not measurements; KV decode at "
            f"{CONTEXT} tokens of context, block {BLOCK}, query bf16; activations bf16.")
    return "\n".join([head, "", *matmul_rows(results), "", *other_rows(results)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.kernel_table", description=__doc__.splitlines()[0])
    p.add_argument("gate_json", type=Path, help="written by python -m conformance --compile sm_90 --all --json FILE")
    args = p.parse_args(argv)
    try:
        doc = json.loads(args.gate_json.read_text())
        print(table(doc), end="")
    except (OSError, ValueError, KeyError) as e:
        print(f"python -m conformance.kernel_table: {args.gate_json}: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
