"""Is this checkout's fast engine slower than another's? Both run the bench_engine workload, alternating.

    python -m experiments.engine.bench_engine_ab --baseline 9b48640 [--pairs 4] [--cpus 0]
    python -m experiments.engine.bench_engine_ab --baseline ../other-checkout --tiny --pairs 1

The baseline is a commit (checked out into a temporary git worktree, removed afterwards) or the folder of
another checkout. Each side runs ``bench_engine --systems fast_bf16 --threads 1 --warmup`` in a process of
its own, from its own tree, on the same workload (the 64 ShareGPT requests on SmolLM2, or ``--tiny``); the
sides alternate and swap who goes first every pair, so the machine's drift hits both alike. Reported: each
run's useful tok/s and its prefill and decode seconds, and per pair this checkout over the baseline
(median, min, max). This is the check for "not slower than before" after a kernel change: a ratio read
from two separate runs on a shared machine says little, one from alternating runs says more.
Results: experiments/results/bench_engine_ab.json (``--out``) and a figure beside it (.png; ``--plot JSON``
draws it again from a stored file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from experiments.engine.stats import spread
from reference import provenance
from reference.safe_write import write_text

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "experiments" / "results"
# where bench_engine lives: today's layout first, then the flat experiments/ of older commits
BENCH_MODULES = ("experiments/engine/bench_engine.py", "experiments/bench_engine.py")


def bench_module(tree: Path) -> str:
    """The module name of bench_engine in a checkout; raises ValueError if it has none."""
    for rel in BENCH_MODULES:
        if (tree / rel).is_file():
            return rel.removesuffix(".py").replace("/", ".")
    raise ValueError(f"{tree} holds no bench_engine ({' or '.join(BENCH_MODULES)}): not a checkout of this project")


def tree_commit(tree: Path) -> str:
    """The commit a checkout is at (short), or "unknown" outside git."""
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def add_worktree(commit: str, parent: Path) -> Path:
    """A detached worktree of this repository at ``commit`` under ``parent``; raises ValueError if git cannot."""
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"--baseline {commit!r} is neither a folder nor a commit of {REPO}")
    tree = parent / "baseline"
    made = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), found.stdout.strip()],
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise ValueError(f"git worktree add {commit} failed: {made.stderr.strip()}")
    return tree


def remove_worktree(tree: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)


def run_side(tree: Path, out: Path, *, tiny: bool, requests: int, cpus: str | None, timeout: float) -> dict[str, Any]:
    """One measured bench_engine run of the fast engine from ``tree``: its useful tok/s and phase seconds."""
    cmd = [sys.executable, "-m", bench_module(tree), "--threads", "1", "--systems", "fast_bf16", "--warmup",
           "--out", str(out)]
    cmd += ["--tiny"] if tiny else ["--requests", str(requests)]
    cmd += ["--cpus", cpus] if cpus is not None else []
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"bench_engine in {tree} ran past {timeout:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"bench_engine in {tree} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    measured = json.loads(out.read_text())["measured"]
    phases = measured["phases"]["fast_bf16"]
    return {"useful_tok_s": measured["useful_tok_s"]["fast_bf16"], "prefill_s": phases["prefill_s"],
            "decode_s": phases["decode_s"], "load_average": round(os.getloadavg()[0], 2)}


def compare(candidate: Path, baseline: Path, pairs: int, *, tiny: bool, requests: int, cpus: str | None,
            timeout: float) -> dict[str, Any]:
    """``pairs`` alternating runs of each side; who goes first swaps every pair."""
    from tqdm import tqdm

    runs: dict[str, list[dict]] = {"candidate": [], "baseline": []}
    trees = {"candidate": candidate, "baseline": baseline}
    with tempfile.TemporaryDirectory(prefix="unfire-ab-") as tmp, tqdm(total=2 * pairs, desc="engine runs") as bar:
        for i in range(pairs):
            order = ("baseline", "candidate") if i % 2 == 0 else ("candidate", "baseline")
            for side in order:
                bar.set_postfix_str(f"pair {i + 1}: {side}")
                runs[side].append(run_side(trees[side], Path(tmp) / f"{side}{i}.json", tiny=tiny,
                                           requests=requests, cpus=cpus, timeout=timeout))
                bar.update()
    ratios = {}
    for key in ("useful_tok_s", "prefill_s", "decode_s"):  # a phase of a tiny run can round to 0 s: not a ratio
        pairs_of = [(c[key], b[key]) if key == "useful_tok_s" else (b[key], c[key])
                    for c, b in zip(runs["candidate"], runs["baseline"], strict=True)]
        values = [x / y for x, y in pairs_of if x > 0 and y > 0]
        if values:
            ratios[key] = spread(values)
    return {"runs": runs, "candidate_over_baseline": ratios}


def figure(result: dict[str, Any], path: Path) -> Path:
    """Each pair's useful tok/s of both sides, and the per-pair ratios (above 1: the candidate is faster)."""
    from experiments.registry import pyplot

    plt = pyplot()
    s, runs = result["setup"], result["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    pairs = range(1, len(runs["candidate"]) + 1)
    for side, label in (("baseline", f"baseline {s['baseline_commit']}"),
                        ("candidate", f"candidate {s['candidate_commit']}")):
        left.plot(pairs, [r["useful_tok_s"] for r in runs[side]], "o-", label=label)
    left.set_xticks(list(pairs))
    left.set_xlabel("pair (runs alternate; who goes first swaps)")
    left.set_title("useful output tokens/s (higher is better)")
    left.legend()
    ratio = result["candidate_over_baseline"]
    names = list(ratio)
    right.bar(names, [ratio[n]["median"] for n in names], color="tab:blue", label="median")
    right.errorbar(names, [ratio[n]["median"] for n in names],
                   yerr=[[ratio[n]["median"] - ratio[n]["min"] for n in names],
                         [ratio[n]["max"] - ratio[n]["median"] for n in names]],
                   fmt="none", color="black", capsize=4, label="min-max over pairs")
    right.axhline(1.0, color="gray", ls="--")
    right.set_title("candidate vs baseline per pair (above 1: faster)")
    right.legend()
    fig.suptitle(f"{s['workload']}; {s['threads']} thread; {s['machine'].get('cpu', '')}; {s['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m experiments.engine.bench_engine_ab",
                                description=__doc__.splitlines()[0])
    p.add_argument("--baseline", help="a commit of this repository, or the folder of another checkout")
    p.add_argument("--pairs", type=int, default=4, help="runs of each side, alternating (default 4)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model and 6 requests (seconds)")
    p.add_argument("--requests", type=int, default=64, help="ShareGPT requests per run (default 64)")
    p.add_argument("--cpus", help="pin both sides to these cores, e.g. 0 (taskset)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_engine_ab.json",
                   help="the results file (default experiments/results/bench_engine_ab.json)")
    p.add_argument("--plot", type=Path, metavar="JSON", help="only draw the figure of a stored results file again")
    args = p.parse_args(argv)
    if args.plot is not None:
        try:
            stored = json.loads(args.plot.read_text())
            return {"figure": str(figure(stored, args.plot.with_suffix(".png")))}
        except (OSError, ValueError, KeyError) as e:
            p.exit(2, f"error: --plot {args.plot}: not a bench_engine_ab results file ({e!r})\n")
    if args.baseline is None:
        p.error("--baseline is required (a commit or a checkout's folder)")
    if args.pairs < 1:
        p.error("--pairs must be >= 1")
    with tempfile.TemporaryDirectory(prefix="unfire-baseline-") as tmp:
        folder = Path(args.baseline).expanduser()
        worktree = None
        try:
            if folder.is_dir():
                baseline = folder.resolve()
            else:
                baseline = worktree = add_worktree(args.baseline, Path(tmp))
            bench_module(baseline)
            baseline_commit = tree_commit(baseline)
            result = compare(REPO, baseline, args.pairs, tiny=args.tiny, requests=args.requests, cpus=args.cpus,
                             timeout=args.timeout)
        except (ValueError, RuntimeError) as e:
            p.exit(2, f"error: {e}\n")
        finally:
            if worktree is not None:
                remove_worktree(worktree)
    ratio = result["candidate_over_baseline"]
    result = {
        "title": "Fast engine: this checkout vs a baseline checkout, alternating runs of bench_engine",
        "setup": {"candidate_commit": provenance.commit(), "baseline": args.baseline,
                  "baseline_commit": baseline_commit, "pairs": args.pairs, "threads": 1, "cpus": args.cpus,
                  "weights": "random 2-layer Llama" if args.tiny else "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
                  "workload": "bench_engine --tiny" if args.tiny
                  else f"bench_engine, {args.requests} ShareGPT requests",
                  "machine": provenance.machine(), "date": provenance.now(),
                  "ratios": "useful tok/s: candidate / baseline; prefill_s, decode_s: baseline / candidate "
                            "(above 1: the candidate is faster), per pair"},
        **result,
    }
    result["figures"] = [figure(result, args.out.with_suffix(".png")).name]
    write_text(args.out, json.dumps(result, indent=1))
    print(f"candidate {result['setup']['candidate_commit']} over baseline {result['setup']['baseline_commit']}: "
          + "; ".join(f"{k} {v['median']:.3f}x [{v['min']:.3f}-{v['max']:.3f}]" for k, v in ratio.items()))
    return result


if __name__ == "__main__":
    main()
