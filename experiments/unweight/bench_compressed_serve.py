"""Compressed vs plain weights through the server: ``serve.bench`` against ``python -m serve --engine fast``.

Three endpoints, all the fast engine (torch, one thread) on SmolLM2 with the scheduler settings of
``experiments.disagg.bench_disagg_serve`` (its ``Served``, ``timed``, ``answers``, ``medians`` and figure are used
here, so the workload, the clocks and the CPU accounting are the same):

* ``plain``: ``--model smollm2`` (every matrix bf16);
* ``compressed``: ``--model smollm2 --compressed all`` (the four projections of every layer in the palette
  form, decoded to bf16 with torch at every call on a CPU: there is no fused kernel off the GPU);
* ``container``: ``--model FILE``, a container written by ``python -m reference.codec compress smollm2
  FILE --to-bf16`` (Unweight mode), decoded to bf16 at load; with ``--setups ...,container_compressed`` also
  the container served ``--compressed all`` (transcoded at load).

The workload is the first ``--num-prompts`` ShareGPT prompts (cut to ``--max-prompt-chars``), streamed
chat completions, greedy, ``--max-tokens``, one seeded Poisson process at ``--request-rate``. The setups
alternate ``--repeats`` times (plain, compressed, container, plain, ...) so that the load of other jobs
falls on all alike; the load average is recorded before and after every run. Reported per setup: the
median and the range over the repeats of TTFT / ITL / e2e p50/p90/p99, goodput at the stated SLO and CPU
ms per output token (user+system of the server's process tree during the run). Then every setup answers
the prompts once more untimed, and its answers are compared with the plain endpoint's (compression is
lossless, so they must be identical).

Writes ``experiments/results/serve_compressed.json`` and ``serve_compressed.png``.

    python -m experiments.unweight.bench_compressed_serve [--num-prompts 16] [--max-tokens 32] [--request-rate 1]
        [--repeats 2] [--container FILE] [--setups plain,compressed,container]
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
from typing import Any

from experiments.disagg.bench_disagg_serve import (
    ENGINE,
    KEYS,
    REPO,
    RESULTS,
    _get,
    add_workload_arguments,
    agreement,
    answers,
    figure,
    medians,
    timed,
)
from reference.provenance import commit, machine, now
from reference.safe_write import write_text
from serve.bench import BenchConfig, sharegpt_prompts

SETUPS = ("plain", "compressed", "container", "container_compressed")
DEFAULT_SETUPS = ("plain", "compressed", "container")


def setup_args(setup: str, container: Path, model: str = "smollm2") -> tuple[str, list[str]]:
    """(``--model``, the other arguments) of ``python -m serve`` for ``setup`` (served as "smollm2")."""
    model = str(container) if setup.startswith("container") else model
    return model, ["--engine", "fast", "--threads", "1", "--served-model-name", "smollm2",
                   *(["--compressed", "all"] if setup.endswith("compressed") else [])]


def command_line(setup: str, model: str) -> list[str]:
    """``python -m serve``'s arguments of ``setup`` (the container as FILE), for the results."""
    served, args = setup_args(setup, Path("FILE"), model)
    return ["--model", served, *args, *ENGINE]


def write_container(model: str, path: Path, options: list[str]) -> float:
    """``python -m reference.codec compress MODEL PATH --to-bf16 [options]``; returns the seconds it took."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "reference.codec", "compress", model, str(path), "--to-bf16", *options],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def spread(runs: list[dict]) -> dict[str, list[float]]:
    """[min, max] over the repeats of every value ``medians`` reports."""
    out = {"/".join(k): [min(_get(r, k) for r in runs), max(_get(r, k) for r in runs)] for k in KEYS}
    cpu = [r["cpu_ms_per_output_token"] for r in runs]
    out["cpu_ms_per_output_token"] = [min(cpu), max(cpu)]
    return out


def table(result: dict) -> str:
    """The README's table (markdown): median [min-max] over the repeats, per setup."""
    med, rng = result["medians"], result["spread"]

    def cell(setup: str, key: str, scale: float = 1.0, digits: int = 0) -> str:
        m, (lo, hi) = med[setup][key] * scale, rng[setup][key]
        return f"{m:.{digits}f} [{lo * scale:.{digits}f}-{hi * scale:.{digits}f}]"

    rows = ["| setup | TTFT p50 / p90 / p99 (s) | ITL p50 / p90 / p99 (ms) | e2e p50 / p90 / p99 (s) | goodput (req/s) "
            "| CPU ms / token |", "|---|---|---|---|---|---|"]
    for s in result["setups"]:
        ttft = " / ".join(cell(s, f"ttft_ms/{p}", 1e-3, 1) for p in ("p50", "p90", "p99"))
        itl = " / ".join(cell(s, f"itl_ms/{p}") for p in ("p50", "p90", "p99"))
        e2e = " / ".join(cell(s, f"e2e_ms/{p}", 1e-3, 1) for p in ("p50", "p90", "p99"))
        rows.append(f"| {s.replace('_', ' ')} | {ttft} | {itl} | {e2e} | {cell(s, 'goodput_rps', 1, 2)} "
                    f"| {cell(s, 'cpu_ms_per_output_token')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.unweight.bench_compressed_serve",
                                description=__doc__.split("\n")[0])
    add_workload_arguments(p)
    p.add_argument("--setups", default=",".join(DEFAULT_SETUPS), help=f"which of {', '.join(SETUPS)} (plain first)")
    p.add_argument("--model", default="smollm2", help="packaged model name or checkpoint path (default smollm2)")
    p.add_argument("--container", type=Path, help="a container of --model (default: one written by "
                                                  "`python -m reference.codec compress MODEL FILE --to-bf16`)")
    p.add_argument("--min-elements", type=int, help="the codec's --min-elements for that container")
    p.add_argument("--no-agreement", action="store_true", help="skip the untimed run that compares the answers")
    p.add_argument("--out", type=Path, default=RESULTS / "serve_compressed.json",
                   help="results JSON (default experiments/results/serve_compressed.json; the figure beside it)")
    a = p.parse_args(argv)
    if a.num_prompts < 1 or a.max_tokens < 1 or a.repeats < 1 or not a.request_rate > 0:
        p.error("--num-prompts, --max-tokens, --repeats and --request-rate must be > 0")
    setups = tuple(s for s in a.setups.split(",") if s)
    if not set(setups) <= set(SETUPS) or setups[:1] != ("plain",) or len(set(setups)) != len(setups):
        p.error(f"--setups: plain first, then any of {', '.join(SETUPS[1:])} (got {a.setups!r})")
    if a.container is not None and not a.container.is_file():
        p.error(f"--container {a.container}: no such file")
    prompts = sharegpt_prompts(a.num_prompts, a.max_prompt_chars)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="unfire-serve-compressed-") as tmp:
        container, compress_s = a.container, None
        if container is None and any(s.startswith("container") for s in setups):
            container = Path(tmp) / "model.unweight.safetensors"
            options = ["--min-elements", str(a.min_elements)] if a.min_elements is not None else []
            compress_s = write_container(a.model, container, options)
        container_bytes = container.stat().st_size if container is not None else None
        runs: list[dict[str, Any]] = []
        for repeat in range(a.repeats):
            for setup in setups:
                model, args = setup_args(setup, container, a.model)  # type: ignore[arg-type]
                cfg = BenchConfig(url="", num_prompts=a.num_prompts, request_rate=a.request_rate,
                                  max_tokens=a.max_tokens, max_prompt_chars=a.max_prompt_chars,
                                  slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms)
                load = os.getloadavg()
                run = timed(setup, prompts, cfg, args, model)
                run |= {"repeat": repeat, "load_average_before": load, "load_average_after": os.getloadavg()}
                runs.append(run)
                print(setup, repeat, json.dumps({k: run["summary"][k] for k in ("completed", "failed", "duration_s")}),
                      f"{run['cpu_ms_per_output_token']:.1f} CPU ms/token, load {load[0]:.1f}", flush=True)
        agree = None
        if not a.no_agreement:
            got = {}
            for s in setups:
                model, args = setup_args(s, container, a.model)  # type: ignore[arg-type]
                got[s] = answers(s, prompts, a.max_tokens, args, model)
            agree = {s: agreement(got["plain"], got[s]) for s in setups[1:]}
            print(json.dumps(agree), flush=True)
    loads = [r["load_average_before"][0] for r in runs] + [r["load_average_after"][0] for r in runs]
    result = {
        "what": "plain vs compressed weights through python -m serve --engine fast, measured with serve.bench",
        "commit": commit(), "machine": machine(), "when": now(), "wall_s": time.time() - started,
        "clock": "latencies: wall clock at the client (time.perf_counter, serve.bench); CPU: user+system seconds "
                 "of the server's process tree during the run (psutil)",
        "load_average_range": [min(loads), max(loads)],
        "container": {"written_by": f"python -m reference.codec compress {a.model} FILE --to-bf16" if compress_s
                      else str(a.container), "seconds": compress_s,
                      "bytes": container_bytes},
        "workload": {"dataset": "sharegpt", "num_prompts": a.num_prompts, "max_tokens": a.max_tokens,
                     "max_prompt_chars": a.max_prompt_chars, "request_rate": a.request_rate, "repeats": a.repeats,
                     "greedy": True, "model": a.model, "engine": "fast (torch, 1 thread)",
                     "setups": {s: command_line(s, a.model) for s in setups}},
        "slo": {"ttft_ms": a.slo_ttft_ms, "tpot_ms": a.slo_tpot_ms},
        "setups": list(setups),
        "medians": {s: medians([r for r in runs if r["setup"] == s]) for s in setups},
        "spread": {s: spread([r for r in runs if r["setup"] == s]) for s in setups},
        "agreement_with_plain": agree,
        "runs": runs,
    }
    plain = result["medians"]["plain"]
    result["vs_plain"] = {s: {k: round(result["medians"][s][k] / plain[k], 3) for k in
                              ("itl_ms/p50", "tpot_ms/p50", "e2e_ms/p50", "cpu_ms_per_output_token") if plain[k]}
                          for s in setups[1:]}
    write_text(a.out, json.dumps(result, indent=2) + "\n")
    figure(result, a.out.with_suffix(".png"), setups,
           f"{a.model}, fast engine on a CPU, {a.num_prompts} ShareGPT prompts at {a.request_rate} req/s "
           f"(medians of {a.repeats} runs; load average {min(loads):.1f}-{max(loads):.1f})")
    print(table(result))
    print(json.dumps(result["vs_plain"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
