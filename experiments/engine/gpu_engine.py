"""The fast engine on a GPU: tokens/s, TTFT, ITL and the control-plane share at batch 1..256.

For each variant (bf16 weights; bf16 weights served compressed) and each batch size B, B requests
with distinct 128-token prompts arrive at once; after their prefill, 10 decode steps of all B are
timed (``experiments/engine/engine_load.py``: model vs schedule / step tensors / bookkeeping). Decode
steps replay CUDA graphs. Stops starting new rows after ``--budget`` seconds. The engine's
conformance at large shapes runs in the conformance step of ``gpu_check`` (engine.* cases).

    python -m experiments.engine.gpu_engine [--budget 150] [--json FILE]
    python -m experiments.engine.gpu_engine --tiny     # CPU smoke test: a tiny random Llama, B = 1, 4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from reference.safe_write import write_text

RESULTS = Path(__file__).resolve().parents[1] / "results"
BATCHES = (1, 4, 16, 64, 256)
GOAL = "control plane < 5% of a decode step at 64 sequences"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    from experiments.engine.engine_load import blocks_needed, decode_load
    from fast.engine import Engine, FastModel, TorchLlama
    from reference.provenance import commit, machine

    p = argparse.ArgumentParser(prog="python -m experiments.engine.gpu_engine", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tiny random model (a quick check)")
    p.add_argument("--budget", type=float, default=150.0, help="seconds after which no new row starts")
    p.add_argument("--json", type=Path, default=RESULTS / "gpu_engine.json", help="where the results go")
    args = p.parse_args(argv)
    if args.tiny:
        from experiments.engine.bench_engine import tiny_checkpoint

        config, weights, _ = tiny_checkpoint()
        device, batches, prompt, steps, label = "cpu", (1, 4), 8, 3, "random 2-layer Llama (--tiny)"
    else:
        from reference.model.loader import load_llama

        config, weights = load_llama("smollm2")
        device, batches, prompt, steps = "cuda", BATCHES, 128, 10
        label = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized), bf16"
    start = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    for variant, compressed in (("bf16", False), ("compressed", True)):
        model = TorchLlama(config, weights, dtype="bfloat16", device=device, compressed=compressed)
        rows[variant] = {}
        for b in batches:
            if time.perf_counter() - start > args.budget:
                break
            budget = min(max(b * prompt, 512), 8192)
            engine = Engine(FastModel(model), num_blocks=blocks_needed(b, prompt, steps, budget), block_size=16,
                            max_num_seqs=b, max_num_batched_tokens=budget)
            rows[variant][str(b)] = decode_load(engine, b, prompt_len=prompt, steps=steps)
            print(variant, b, rows[variant][str(b)], flush=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    control = {n: r for n, r in rows["bf16"].items() if n in ("16", "64", "256")}
    share64 = control.get("64", {}).get("control_share")
    result = {"weights": label, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
              "commit": commit(), "machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "rows": rows, "control_plane": control,
              "goals": {GOAL: None if share64 is None else bool(share64 < 0.05)}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_text(args.json, json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
