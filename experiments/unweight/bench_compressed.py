"""Compressed checkpoints as models: load cost, resident weight memory, and what the saved memory buys.

    python -m experiments.unweight.bench_compressed [--model smollm2] [--requests 32] [--budget-blocks N] [--out FILE]

One run, one process, one thread (torch and BLAS), engine time on the process CPU clock:

1. **Containers.** ``--model`` is compressed (``--to-bf16``) in both modes, Unweight (Huffman) and
   rANS, by the fast CLI's encoders (the same bytes as ``python -m reference.codec compress``).
2. **Load.** ``fast.engine.TorchLlama.load`` on the checkpoint itself and on the containers, plain
   (every matrix decoded to bf16) and compressed (the four projections of every layer in the palette
   form; o/down transcoded from the stored Huffman form, the fused q/k/v and gate/up encoded again):
   bytes read (the file: every loader reads each stored byte once), load time (wall and CPU), resident
   weight bytes (``TorchLlama.weight_nbytes``; the CPU's oneDNN packed copies of plain matrices are
   reported apart: a speed copy a GPU does not make).
3. **The economic point.** A fixed memory budget for weights + KV cache: the plain bf16 weights plus
   ``--budget-blocks`` KV blocks (default: a third of what the whole workload needs, so the plain model
   cannot hold every sequence at once). The compressed model spends less of it on weights: how many more
   KV blocks, and how many more sequences of the workload's mean length, it holds. Then the fast engine
   runs the bench workload (ShareGPT, as ``experiments.engine.bench_engine``) three ways: plain with the
   budget's blocks, compressed with its larger number of blocks, and compressed with the plain number
   (which separates the decode cost from what the extra blocks buy): useful tok/s, peak concurrent
   sequences, preemptions.

SmolLM2's weights are dequantized 4-bit (Q4_1): their exponent statistics are NOT representative of
trained bf16 weights, so its compression ratio is not the article's; the memory arithmetic is the same
for any model. On a CPU the palette form is decoded to bf16 at every matmul (no fused kernel), which
costs time per step that a GPU's fused kernel does not pay: the throughput here is the CPU's.
Results: experiments/results/bench_compressed.json and .png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
MODES = ("unweight", "rans")
SWEEP_BLOCKS = (32, 128, 512, 2048)  # budgets of the README's arithmetic table (blocks the bf16 model gets)


def write_containers(model: str, folder: Path) -> dict[str, Path]:
    """The model compressed in both modes (fast encoders; same bytes as the reference CLI)."""
    from fast.codec.__main__ import encode_to_reference
    from reference.codec import compress_checkpoint

    out = {}
    for mode in MODES:
        out[mode] = folder / f"model.{mode}.safetensors"
        extra = {"encoder": encode_to_reference} if mode == "unweight" else {}
        compress_checkpoint(model, out[mode], to_bf16=True, mode=mode, **extra)
    return out


def measure_load(source: str | Path, compressed: bool) -> tuple[Any, dict[str, Any]]:
    """Load once; (model, {seconds, cpu_seconds, bytes_read, weights})."""
    from fast.engine.model import TorchLlama
    from reference.model.weights import open_weights

    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    model = TorchLlama.load(source, dtype="bfloat16", compressed=compressed)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    files = open_weights(source).files
    return model, {"seconds": round(wall, 3), "cpu_seconds": round(cpu, 3),
                   "bytes_read": sum(Path(f.path).stat().st_size for f in files),
                   "weights": model.weight_nbytes()}


def bf16_checkpoint_bytes(model: str | Path) -> int:
    """Tensor bytes of the checkpoint stored as bf16 (2 bytes per parameter): what a bf16 file reads."""
    from reference.model.weights import open_weights

    return 2 * open_weights(model).num_params()


def block_bytes(config: Any, block_size: int = 16, itemsize: int = 2) -> int:
    """Bytes of one KV block (keys and values of every layer) in bf16."""
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * block_size * itemsize


def run_workload(model: Any, jobs: list, num_blocks: int) -> dict[str, Any]:
    """The fast engine over ``model`` with ``num_blocks`` KV blocks: useful tok/s and concurrency."""
    from experiments.engine.bench_engine import phases, run_engine, score
    from fast.engine import Engine, FastModel

    engine = Engine(FastModel(model), num_blocks=num_blocks, block_size=16, max_num_seqs=64,
                    max_num_batched_tokens=2048, clock=time.process_time)
    out = score(run_engine(engine, jobs, lambda n: None), jobs)
    out["peak_running"] = max(len(r.new_tokens) for r in engine.step_log)
    out["phases"] = phases(engine)
    out["num_blocks"] = num_blocks
    return out


def run(model_name: str, requests: int, max_prompt: int, max_output: int, budget_blocks: int | None,
        workdir: Path) -> dict[str, Any]:
    """Every measurement of the module docstring; returns the ``measured`` part of the result."""
    from experiments.engine.stats import sharegpt_jobs
    from reference.model.tokenizer import load_tokenizer

    t = time.perf_counter()
    containers = write_containers(model_name, workdir)
    compress_s = time.perf_counter() - t
    loads: dict[str, Any] = {}
    plain, loads["checkpoint_plain"] = measure_load(model_name, False)
    del plain
    plain, loads["unweight_plain"] = measure_load(containers["unweight"], False)
    packed, loads["unweight_compressed"] = measure_load(containers["unweight"], True)
    _, loads["rans_compressed"] = measure_load(containers["rans"], True)
    config = plain.config

    jobs = sharegpt_jobs(load_tokenizer(containers["unweight"]), requests, max_prompt=max_prompt,
                         max_output=max_output)
    need = sum(-(-(len(j.prompt) + j.output_len) // 16) for j in jobs)
    mean_blocks = need / len(jobs)
    b0 = budget_blocks or max(8, need // 3)
    per_block = block_bytes(config)
    w_plain = sum(v for k, v in loads["unweight_plain"]["weights"].items() if k != "packed")
    w_comp = sum(v for k, v in loads["unweight_compressed"]["weights"].items() if k != "packed")
    budget = w_plain + b0 * per_block
    b1 = (budget - w_comp) // per_block
    economics = {"budget_bytes": budget, "kv_block_bytes": per_block, "weights_plain_bytes": w_plain,
                 "weights_compressed_bytes": w_comp, "blocks_plain": b0, "blocks_compressed": int(b1),
                 "extra_blocks": int(b1 - b0), "extra_blocks_pct": round(100 * (b1 - b0) / b0, 1),
                 "mean_blocks_per_sequence": round(mean_blocks, 2),
                 "sequences_plain": int(b0 // mean_blocks), "sequences_compressed": int(b1 // mean_blocks),
                 "workload_blocks": need}
    throughput = {"plain": run_workload(plain, jobs, b0), "compressed": run_workload(packed, jobs, int(b1)),
                  "compressed_same_blocks": run_workload(packed, jobs, b0)}
    return {"compress_seconds": round(compress_s, 2), "bf16_checkpoint_bytes": bf16_checkpoint_bytes(model_name),
            "loads": loads, "economics": economics,
            "throughput": throughput,
            "workload": (f"{len(jobs)} ShareGPT requests (prompt <= {max_prompt}, output <= {max_output} tokens; "
                         f"{sum(len(j.prompt) for j in jobs)} prompt and {sum(j.output_len for j in jobs)} output "
                         "tokens), greedy, end token ignored, all arriving at once")}


def summary(m: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers."""
    loads, e, t = m["loads"], m["economics"], m["throughput"]
    dense = loads["unweight_plain"]["weights"]
    comp = loads["unweight_compressed"]["weights"]
    return {"file_bytes": {k: v["bytes_read"] for k, v in loads.items()} | {"bf16": m["bf16_checkpoint_bytes"]},
            "load_seconds": {k: v["seconds"] for k, v in loads.items()},
            "resident_weights_ratio": round((comp["dense"] + comp["compressed"]) / (dense["dense"]), 4),
            "kv_blocks": [e["blocks_plain"], e["blocks_compressed"]],
            "sequences": [e["sequences_plain"], e["sequences_compressed"]],
            "useful_tok_s": {k: v["useful_tok_s"] for k, v in t.items()},
            "peak_running": {k: v["peak_running"] for k, v in t.items()}}


def table(result: dict[str, Any]) -> str:
    """The README's memory/concurrency table (markdown), from a result."""
    m = result["measured"]
    loads, e, t = m["loads"], m["economics"], m["throughput"]
    mib = 2**20
    rows = ["| load | file read (MiB) | load s (wall / CPU) | resident weights (MiB) | + CPU packed copies (MiB) |",
            "|---|---|---|---|---|"]
    for k, v in loads.items():
        w = v["weights"]
        rows.append(f"| {k.replace('_', ' ')} | {v['bytes_read'] / mib:.1f} | {v['seconds']:.1f} / "
                    f"{v['cpu_seconds']:.1f} | {(w['dense'] + w['compressed']) / mib:.1f} | {w['packed'] / mib:.1f} |")
    rows += ["", f"Budget {e['budget_bytes'] / mib:.1f} MiB for weights + KV (KV block: "
             f"{e['kv_block_bytes'] / 1024:.0f} KiB, 16 tokens; a workload sequence needs "
             f"{e['mean_blocks_per_sequence']} blocks on average):", "",
             "| engine | weights (MiB) | KV blocks | sequences of mean length | run (CPU s) | useful tok/s "
             "| peak running | preempted |", "|---|---|---|---|---|---|---|---|"]
    runs = (("plain", e["weights_plain_bytes"], e["blocks_plain"], e["sequences_plain"]),
            ("compressed", e["weights_compressed_bytes"], e["blocks_compressed"], e["sequences_compressed"]),
            ("compressed_same_blocks", e["weights_compressed_bytes"], e["blocks_plain"], e["sequences_plain"]))
    for run_name, weights, blocks, seqs in runs:
        r = t[run_name]
        rows.append(f"| {run_name.replace('_', ' ')} | {weights / mib:.1f} | {blocks} | {seqs} | {r['seconds']:.1f} "
                    f"| {r['useful_tok_s']:.1f} | {r['peak_running']} | {r['phases']['preempted']} |")
    rows += ["", "The same arithmetic at other budgets (bf16 weights + N blocks; measured weight bytes):", "",
             "| KV blocks, bf16 weights | KV blocks, compressed | more blocks | sequences of mean length |",
             "|---|---|---|---|"]
    for n in SWEEP_BLOCKS:
        more = (e["weights_plain_bytes"] - e["weights_compressed_bytes"]) // e["kv_block_bytes"]
        rows.append(f"| {n} | {n + more} | +{100 * more / n:.0f}% | {int(n // e['mean_blocks_per_sequence'])} -> "
                    f"{int((n + more) // e['mean_blocks_per_sequence'])} |")
    return "\n".join(rows)


def figure(result: dict[str, Any], path: Path) -> Path:
    from experiments.registry import pyplot

    plt = pyplot()
    m = result["measured"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.6))
    w = {k: v["weights"] for k, v in m["loads"].items()}
    names = list(w)
    a.bar(names, [(v["dense"] + v["compressed"]) / 2**20 for v in w.values()], color="#4c72b0")
    a.set_ylabel("resident weights, MiB")
    a.set_title("weights (packed CPU copies excluded)")
    a.tick_params(axis="x", rotation=25, labelsize=7)
    e = m["economics"]
    b.bar(["bf16", "compressed"], [e["blocks_plain"], e["blocks_compressed"]], color=["#4c72b0", "#dd8452"])
    b.set_title(f"KV blocks in {e['budget_bytes'] / 2**20:.0f} MiB (weights + KV)")
    t = m["throughput"]
    c.bar(list(t), [v["useful_tok_s"] for v in t.values()], color=["#4c72b0", "#dd8452", "#c44e52"])
    c.set_title("useful tok/s at that budget (CPU, 1 thread)")
    c.tick_params(axis="x", rotation=15, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch
    from threadpoolctl import threadpool_limits

    from reference import provenance as setup_info
    from reference.safe_write import write_text

    p = argparse.ArgumentParser(prog="python -m experiments.unweight.bench_compressed",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="packaged model name or checkpoint path")
    p.add_argument("--requests", type=int, default=32, help="ShareGPT requests of the throughput run (default 32)")
    p.add_argument("--max-prompt", type=int, default=256, help="prompt tokens kept per request (default 256)")
    p.add_argument("--max-output", type=int, default=64, help="output tokens per request at most (default 64)")
    p.add_argument("--budget-blocks", type=int, help="KV blocks the budget gives the plain model")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_compressed.json",
                   help="results JSON (default experiments/results/bench_compressed.json; the figure beside it)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    with threadpool_limits(1, user_api="blas"), tempfile.TemporaryDirectory() as tmp:
        measured = run(args.model, args.requests, args.max_prompt, args.max_output, args.budget_blocks, Path(tmp))
    setup = {"weights": args.model, "threads": 1, "clock": "engine time = CPU seconds of this process",
             "machine": setup_info.machine(), "commit": setup_info.commit(), "date": setup_info.now(),
             "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
             "note": ("SmolLM2's weights are dequantized Q4_1: compression statistics not representative of "
                      "trained bf16 weights" if args.model == "smollm2" else "")}
    result = {"title": "Compressed checkpoints as models: load, memory, KV blocks and throughput at a fixed budget",
              "summary": summary(measured), "measured": measured, "setup": setup}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["figures"] = [figure(result, args.out.with_suffix(".png")).name]
    write_text(args.out, json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1), flush=True)
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
