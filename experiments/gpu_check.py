"""One command for a GPU session: first the compile gate (every kernel specialization the launchers pick
at Llama-3.1-8B shapes compiled for the GPU with ptxas: seconds, and no GPU time is spent if one does
not compile or spills), then the conformance suite natively on CUDA (large shapes), then the
benchmarks: the codec kernels (``gpu_bench.py``), KV decode attention (``bench_kv.py``) and the engine
(tokens/s, TTFT, ITL, control-plane share at batch 1..256, bf16 and compressed weights: ``gpu_engine.py``).
If the compile gate fails, nothing else runs.

Each step runs in its own process with its own time limit, so a failure in one still leaves the
others' results. Writes experiments/results/conformance_cuda.json, gpu_bench.json, bench_kv.json,
gpu_engine.json, compile_gate.json and a summary gpu_check.json (GPU name, date, commit, pass/fail,
the goals). Sized for one 10-minute call: compile gate <= 60 s (16 processes), conformance <= 240 s,
codec benchmark <= 160 s, KV benchmark <= 90 s, engine <= 110 s (the benchmarks stop starting new
rows at their ``--*-budget``).

``--tiny`` runs the same steps on the CPU under TRITON_INTERPRET=1 (a few conformance cases, the
benchmark's tiny shapes; the compile gate for two kernels) and writes to a temporary folder: a smoke
test that the script works, not a GPU measurement.

    python -m experiments.gpu_check [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reference.safe_write import write_text

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent


def step(name: str, cmd: list[str], timeout: float, env: dict[str, str]) -> dict[str, object]:
    """Run one step; return its exit code, time and the tail of its output."""
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout, capture_output=True, text=True)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        partial = e.stdout or b""
        rc, output = "timeout", partial.decode(errors="replace") if isinstance(partial, bytes) else str(partial)
    print(output[-6000:], flush=True)
    return {"cmd": cmd, "rc": rc, "seconds": time.perf_counter() - start, "tail": output[-3000:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke test under the interpreter")
    p.add_argument("--out", type=Path, default=None, help="results folder (default experiments/results; "
                   "a temporary folder with --tiny)")
    p.add_argument("--compile-timeout", type=float, default=60, help="seconds before the compile gate is stopped "
                   "(default 60)")
    p.add_argument("--conformance-timeout", type=float, default=240, help="seconds before the conformance step is "
                   "stopped (default 240)")
    p.add_argument("--bench-timeout", type=float, default=160, help="seconds before the kernel benchmark is stopped "
                   "(default 160)")
    p.add_argument("--bench-budget", type=float, default=120,
                   help="--budget of experiments.unweight.gpu_bench (default 120)")
    p.add_argument("--kv-timeout", type=float, default=90,
                   help="seconds before the KV benchmark is stopped (default 90)")
    p.add_argument("--kv-budget", type=float, default=50, help="--budget of experiments.engine.bench_kv (default 50)")
    p.add_argument("--engine-timeout", type=float, default=110, help="seconds before the engine benchmark is stopped "
                   "(default 110)")
    p.add_argument("--engine-budget", type=float, default=70,
                   help="--budget of experiments.engine.gpu_engine (default 70)")
    args = p.parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu_check_")) if args.tiny else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    py = sys.executable
    gate_env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    gate_env["TRITON_INTERPRET"] = "0"  # the gate compiles for the GPU, with or without one
    gate = [py, "-m", "conformance", "--compile", "sm_90", "--no-cases", "--jobs", str(min(16, os.cpu_count() or 1)),
            "--json", str(out / "compile_gate.json")]
    gate += ["-k", "bf16 rounding", "-k", "kv.write 512 tokens, float32 into a bf16"] if args.tiny else ["--all"]
    if args.tiny:
        env["TRITON_INTERPRET"] = "1"
        conf = [py, "-m", "conformance", "--device", "cpu", "-k", "bf16.", "-k", "codec.palette_decode.random",
                "-k", "matmul.fused_vs_plain.synthetic_96x320.b1", "-k", "kv.decode_attention.fp8.triton",
                "--json", str(out / "conformance_cpu.json")]
        bench = [py, "-m", "experiments.unweight.gpu_bench", "--tiny", "--json", str(out / "gpu_bench_tiny.json")]
        engine = [py, "-m", "experiments.engine.gpu_engine", "--tiny", "--json", str(out / "gpu_engine_tiny.json")]
        kv = [py, "-m", "experiments.engine.bench_kv", "--tiny", "--json", str(out / "bench_kv_tiny.json")]
    else:
        env.pop("TRITON_INTERPRET", None)
        conf = [py, "-m", "conformance", "--device", "cuda", "--large", "--json", str(out / "conformance_cuda.json")]
        bench = [py, "-m", "experiments.unweight.gpu_bench", "--budget", str(args.bench_budget),
                 "--json", str(out / "gpu_bench.json")]
        engine = [py, "-m", "experiments.engine.gpu_engine", "--budget", str(args.engine_budget),
                  "--json", str(out / "gpu_engine.json")]
        kv = [py, "-m", "experiments.engine.bench_kv", "--budget", str(args.kv_budget), "--json",
              str(out / "bench_kv.json")]
    summary: dict[str, object] = {"tiny": args.tiny, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    sys.path.insert(0, str(REPO))
    from reference.provenance import commit, machine

    summary.update({"commit": commit(), "machine": machine()})
    try:
        import torch

        summary["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        summary["gpu"] = None
    summary["compile_gate"] = step("compile_gate", gate, args.compile_timeout, gate_env)
    if summary["compile_gate"]["rc"] != 0:  # never spend the GPU on a kernel that does not compile
        summary["stopped"] = "the compile gate failed: fix it (python -m conformance --compile sm_90 --all) first"
        write_text(out / "gpu_check.json", json.dumps(summary, indent=1) + "\n")
        print(f"{summary['stopped']}\nwrote {out / 'gpu_check.json'}")
        return 1
    summary["conformance"] = step("conformance", conf, args.conformance_timeout, env)
    summary["benchmark"] = step("benchmark", bench, args.bench_timeout, env)
    summary["kv_benchmark"] = step("kv_benchmark", kv, args.kv_timeout, env)
    kv_path = out / ("bench_kv_tiny.json" if args.tiny else "bench_kv.json")
    if kv_path.exists():
        rows = json.loads(kv_path.read_text()).get("rows", [])
        summary["kv_benchmark"]["result_file"] = str(kv_path)
        summary["kv_benchmark"]["triton_GBps"] = {f"{r['dtype']}.b{r['batch']}": r["triton_GBps"] for r in rows}
    summary["engine"] = step("engine", engine, args.engine_timeout, env)
    for key, name in (("conformance", "conformance_cpu.json" if args.tiny else "conformance_cuda.json"),
                      ("benchmark", "gpu_bench_tiny.json" if args.tiny else "gpu_bench.json"),
                      ("engine", "gpu_engine_tiny.json" if args.tiny else "gpu_engine.json")):
        path = out / name
        if path.exists():
            doc = json.loads(path.read_text())
            summary[key]["result_file"] = str(path)
            summary[key]["passed" if key == "conformance" else "goals"] = doc.get("passed" if key == "conformance"
                                                                                  else "goals")
    write_text(out / "gpu_check.json", json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out / 'gpu_check.json'}")
    ok = all(summary[k]["rc"] == 0 for k in ("compile_gate", "conformance", "benchmark", "kv_benchmark", "engine"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
