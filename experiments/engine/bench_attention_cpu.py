"""CPU paged attention (``fast/kv/attention_c.py``): the AMX tile products against the AVX-512 BF16 loops.

On a CPU with AMX (Sapphire Rapids and later) the C kernel computes every row, decode and prefill alike, by tile
products; ``UNFIRE_NATIVE_SIMD=3`` forces the AVX-512 BF16 loops it took before (and still takes on Zen 4/5). Both
run here side by side, alternating, on SmolLM2-135M's attention shape (9 query heads on 3 kv heads, head size 64,
blocks of 16 tokens, block tables shuffled as after a while of serving, one thread):

* prefill steps: one prompt of 512 or 2048 tokens (each row attends to the positions up to its own), and 16
  prompts of 128 tokens (the burst workload of ``bench_serve_vllm``); time per layer;
* decode steps: 64 sequences of 110-360 cached tokens (the bench_engine workload's decode), every one of 30
  layers with a cache of its own (the K/V come from memory, as in the engine); time per step;
* model steps: SmolLM2's whole forward pass (every layer, bf16) over one prefill step of one 2048-token prompt
  and of 16 prompts of 128 tokens (the burst's step): what the attention's share does to time to first token;
* with ``--engine N``: the whole fast engine on the bench_engine workload (64 ShareGPT requests at once, greedy,
  end token ignored, 2048-token steps), N passes per path alternating: useful tokens/s and the seconds spent in
  steps with prefill and in pure decode steps.

Each case checks that the two paths agree within one bf16 step and that a row's bits are the same in a prefill
chunk and alone (the AMX path's promise). Ratios are the median of per-round ratios (rounds alternate the order).

    python -m experiments.engine.bench_attention_cpu [--rounds 5] [--engine 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from reference.safe_write import write_text

RESULTS = Path(__file__).resolve().parents[1] / "results"
SHAPE = {"heads": 9, "kv_heads": 3, "head_dim": 64, "block_size": 16}  # SmolLM2-135M
PATHS = {"amx": "1", "avx512_bf16": "3"}
LAYERS = 30


def make_cache(lengths: list[int], seed: int, layers: int = 1) -> tuple[Any, list[list[int]]]:
    """A bf16 cache of ``layers`` layers holding ``lengths`` tokens per sequence in shuffled blocks (unused NaN)."""
    from fast.kv import KVStep, PagedKVCache

    bs, kv, d = SHAPE["block_size"], SHAPE["kv_heads"], SHAPE["head_dim"]
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lengths]
    nb = sum(need) + 1
    cache = PagedKVCache(num_layers=layers, num_blocks=nb, block_size=bs, num_kv_heads=kv, head_dim=d,
                         dtype="bfloat16")
    ids = torch.randperm(nb, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    fill = KVStep.build(query_lens=lengths, starts=[0] * len(lengths), block_tables=tables, block_size=bs,
                        num_blocks=nb)
    for layer in range(layers):
        cache.k[layer].fill_(float("nan"))
        cache.v[layer].fill_(float("nan"))
        shape = (sum(lengths), kv, d)
        cache.write(layer, fill.slots, torch.randn(shape, generator=gen).bfloat16(),
                    torch.randn(shape, generator=gen).bfloat16())
    return cache, tables


def prefill_case(lengths: list[int], rounds: int) -> dict[str, Any]:
    """Every prompt of ``lengths`` as one chunk (rows causal): ms per layer, per path."""
    from fast.kv import KVStep
    from fast.kv import attention_torch as at

    cache, tables = make_cache(lengths, 1)
    step = KVStep.build(query_lens=lengths, starts=[0] * len(lengths), block_tables=tables,
                        block_size=SHAPE["block_size"], num_blocks=cache.num_blocks)
    q = torch.randn((step.num_tokens, SHAPE["heads"], SHAPE["head_dim"]),
                    generator=torch.Generator().manual_seed(2)).bfloat16()
    scale = SHAPE["head_dim"] ** -0.5
    reps = max(1, 4096 // max(lengths))
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    outs = {}
    for r in range(rounds + 1):
        for name in (list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]):
            os.environ["UNFIRE_NATIVE_SIMD"] = PATHS[name]
            attend = at.bound(cache, step, SHAPE["heads"], scale)
            outs[name] = attend(q, 0)
            t = time.perf_counter()
            for _ in range(reps):
                attend(q, 0)
            if r:
                times[name].append((time.perf_counter() - t) / reps * 1e3)
    # a row alone (its chunk's last token) against the same row in the chunk
    last = torch.tensor(lengths).cumsum(0) - 1
    os.environ["UNFIRE_NATIVE_SIMD"] = PATHS["amx"]
    decode = torch.empty_like(q)
    from fast.kv import attention_c

    attention_c.decode_rows(q, cache, 0, KVStep.build(
        query_lens=[1] * len(lengths), starts=[n - 1 for n in lengths], block_tables=tables,
        block_size=SHAPE["block_size"], num_blocks=cache.num_blocks), torch.arange(len(lengths)), last, scale, decode)
    return {"case": f"prefill {len(lengths)} x {lengths[0]}", "unit": "ms per layer", "times": times,
            "row_alone_same_bits": bool(torch.equal(decode[last], outs["amx"][last])),
            "paths_max_rel_diff": float(((outs["amx"].float() - outs["avx512_bf16"].float()).abs()
                                         / (outs["avx512_bf16"].float().abs() + 1e-3)).max())}


def decode_case(rounds: int, batch: int = 64) -> dict[str, Any]:
    """``batch`` decode rows over ``LAYERS`` layers of their own: ms per step, per path."""
    from fast.kv import KVStep
    from fast.kv import attention_torch as at

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(110, 360, (batch,), generator=gen).tolist()
    cache, tables = make_cache(lengths, 3, LAYERS)
    step = KVStep.build(query_lens=[1] * batch, starts=[n - 1 for n in lengths], block_tables=tables,
                        block_size=SHAPE["block_size"], num_blocks=cache.num_blocks)
    q = torch.randn((batch, SHAPE["heads"], SHAPE["head_dim"]), generator=gen).bfloat16()
    scale = SHAPE["head_dim"] ** -0.5
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for r in range(rounds + 1):
        for name in (list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]):
            os.environ["UNFIRE_NATIVE_SIMD"] = PATHS[name]
            attend = at.bound(cache, step, SHAPE["heads"], scale)
            t = time.perf_counter()
            for _ in range(3):
                for layer in range(LAYERS):
                    attend(q, layer)
            if r:
                times[name].append((time.perf_counter() - t) / 3 * 1e3)
    return {"case": f"decode {batch} rows, contexts 110-360, {LAYERS} layers", "unit": "ms per step",
            "times": times}


def model_step_case(lengths: list[int], rounds: int) -> dict[str, Any]:
    """SmolLM2's forward pass (bf16, every layer) over one prefill step of ``lengths``: ms per step, per path."""
    from fast.engine.model import TorchLlama
    from fast.kv import KVStep

    global _MODEL
    if _MODEL is None:
        _MODEL = TorchLlama.load("smollm2", dtype="bfloat16")
    model = _MODEL
    bs = SHAPE["block_size"]
    need = [-(-n // bs) for n in lengths]
    cache = model.new_cache(num_blocks=sum(need) + 1, block_size=bs)
    tables, at = [], 0
    for n in need:
        tables.append(list(range(at, at + n)))
        at += n
    step = KVStep.build(query_lens=lengths, starts=[0] * len(lengths), block_tables=tables, block_size=bs,
                        num_blocks=cache.num_blocks)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])
    rows = torch.tensor(lengths).cumsum(0) - 1
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    logits = {}
    for r in range(rounds + 1):
        for name in (list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]):
            os.environ["UNFIRE_NATIVE_SIMD"] = PATHS[name]
            t = time.perf_counter()
            logits[name] = model.forward(tokens, positions, step, cache, rows)
            if r:
                times[name].append((time.perf_counter() - t) * 1e3)
    same = bool(torch.equal(logits["amx"].argmax(-1), logits["avx512_bf16"].argmax(-1)))
    return {"case": f"model step: prefill {len(lengths)} x {lengths[0]} (SmolLM2, 30 layers)", "unit": "ms per step",
            "times": times, "same_next_tokens": same}


_MODEL: Any = None


def engine_case(passes: int) -> dict[str, Any]:
    """The fast engine (SmolLM2, bf16, one thread) on the bench_engine workload, the paths alternating."""
    from experiments.engine.bench_engine import engine_options, phases, run_engine
    from experiments.engine.stats import sharegpt_jobs
    from fast.engine import Engine
    from reference.model.tokenizer import load_tokenizer

    jobs = sharegpt_jobs(load_tokenizer("smollm2"), 64, max_prompt=256, max_output=128)
    useful = sum(j.output_len for j in jobs)
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in PATHS}
    for r in range(passes):
        for name in (list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]):
            os.environ["UNFIRE_NATIVE_SIMD"] = PATHS[name]
            engine = Engine.load("smollm2", threads=1, **engine_options(jobs, time.perf_counter))
            t = time.perf_counter()
            run_engine(engine, jobs, lambda n: None)
            seconds = time.perf_counter() - t
            ph = phases(engine)
            runs[name].append({"useful_tok_s": useful / seconds, "prefill_s": ph["prefill_s"],
                               "decode_s": ph["decode_s"]})
            print(f"engine pass {r}: {name} {useful / seconds:.1f} useful tok/s (prefill steps {ph['prefill_s']} s, "
                  f"decode steps {ph['decode_s']} s)", flush=True)
    ratio = statistics.median(a["useful_tok_s"] / b["useful_tok_s"]
                              for a, b in zip(runs["amx"], runs["avx512_bf16"], strict=True))
    return {"case": f"engine: bench_engine workload ({len(jobs)} requests, {useful} output tokens)",
            "unit": "useful tokens/s", "runs": runs, "amx_speedup": ratio,
            "median": {p: statistics.median(x["useful_tok_s"] for x in v) for p, v in runs.items()}}


def summarize(case: dict[str, Any]) -> dict[str, Any]:
    t = case["times"]
    case["median"] = {p: statistics.median(v) for p, v in t.items()}
    case["amx_speedup"] = statistics.median(b / a for a, b in zip(t["amx"], t["avx512_bf16"], strict=True))
    return case


def measure(rounds: int, engine_passes: int = 0) -> dict[str, Any]:
    from fast.kv import attention_c
    from reference.provenance import commit, machine

    if not attention_c.has_amx():
        raise SystemExit("this CPU (or its OS) does not run AMX tiles: nothing to compare (the kernel takes the "
                         "AVX-512 BF16 loops here)")
    torch.set_num_threads(1)
    old = os.environ.get("UNFIRE_NATIVE_SIMD")
    load_before = os.getloadavg()[0]
    try:
        cases = [summarize(prefill_case([2048], rounds)), summarize(prefill_case([512], rounds)),
                 summarize(prefill_case([128] * 16, rounds)), summarize(decode_case(rounds)),
                 summarize(model_step_case([2048], max(2, rounds // 2))),
                 summarize(model_step_case([128] * 16, rounds))]
        if engine_passes:
            cases.append(engine_case(engine_passes))
    finally:
        if old is None:
            os.environ.pop("UNFIRE_NATIVE_SIMD", None)
        else:
            os.environ["UNFIRE_NATIVE_SIMD"] = old
    return {"what": "CPU paged attention, AMX tile products vs the AVX-512 BF16 loops (speedup > 1: AMX faster)",
            "shape": SHAPE, "threads": 1, "rounds": rounds, "cases": cases, "commit": commit(), "machine": machine(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
            "note": "speedup = median over rounds of time(avx512_bf16) / time(amx), rounds alternating the order"}


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = out["cases"]
    fig, ax = plt.subplots(figsize=(9, 5))
    names = [c["case"].replace(", contexts", "\ncontexts").replace(" workload (", "\nworkload (")
             .replace(" (SmolLM2", "\n(SmolLM2") for c in cases]
    colors = ["tab:green" if c["case"].startswith(("engine", "model")) else "tab:orange"
              if c["case"].startswith("decode") else "tab:blue" for c in cases]
    ax.barh(names, [c["amx_speedup"] for c in cases], color=colors)
    ax.axvline(1, color="gray", lw=0.8)
    for i, c in enumerate(cases):
        ax.text(c["amx_speedup"], i, f" {c['amx_speedup']:.2f}x  ({c['median']['avx512_bf16']:.1f} -> "
                f"{c['median']['amx']:.1f} {c['unit']})", va="center", fontsize=7)
    ax.set_xlabel("speed of the AMX path / the AVX-512 BF16 loops (one thread)")
    ax.set_title(f"SmolLM2 attention on {out['machine'].get('cpu', 'this CPU')}", fontsize=9)
    ax.set_xlim(0, max(c["amx_speedup"] for c in cases) * 1.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m experiments.engine.bench_attention_cpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per case (default 5)")
    p.add_argument("--engine", type=int, default=0, metavar="N",
                   help="also N passes per path of the whole engine on the bench_engine workload (default 0)")
    p.add_argument("--json", type=Path, default=RESULTS / "bench_attention_cpu.json",
                   help="where to write the results (and a .png figure beside them)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.engine < 0:
        p.error("--rounds must be at least 1 and --engine at least 0")
    out = measure(args.rounds, args.engine)
    for c in out["cases"]:
        print(f"{c['case']:45s} loops {c['median']['avx512_bf16']:8.2f}  amx {c['median']['amx']:8.2f} {c['unit']}"
              f"  -> {c['amx_speedup']:.2f}x")
    write_text(args.json, json.dumps(out, indent=1) + "\n")
    plot(out, args.json.with_suffix(".png"))
    print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
