"""The reproduction runner.

    python -m experiments reproduce [--full] [--only U1,E4] [--weights PATH ...] [--store | --out DIR]
    python -m experiments compare RUN_DIR   # a rerun next to the stored results (the agreement table)
    python -m experiments table      # the table from stored results, running nothing
    python -m experiments paper      # rebuild paper/report.md from stored results
    python -m experiments list       # implemented experiments and their quick-run times
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from experiments.agreement import agreement_rows, compare, new_run_dir, print_agreement
from experiments.claims import CLAIM_IDS
from experiments.registry import RESULTS_DIR, Context, cpu_seconds, discover
from experiments.report import build_paper, load_results, print_table, table_rows, write_result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("reproduce", help="run experiments, write results, print the table")
    rep.add_argument("--full", action="store_true", help="full sizes (slow); default is quick sizes")
    rep.add_argument("--only", default="", help="comma-separated claim ids, e.g. U1,E4")
    rep.add_argument("--weights", action="append", default=[], metavar="PATH",
                     help="also measure this checkpoint (safetensors file/dir or GGUF); repeatable")
    where = rep.add_mutually_exclusive_group()
    where.add_argument("--store", action="store_true",
                       help="write into experiments/results/ and rebuild paper/ (default: a new runs/<date>-<commit>/)")
    where.add_argument("--out", type=Path, metavar="DIR", help="write the rerun into DIR instead of runs/...")
    cmp = sub.add_parser("compare", help="print a rerun's agreement table against the stored results")
    cmp.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    cmp.add_argument("--against", type=Path, default=RESULTS_DIR, metavar="DIR",
                     help="the results to compare with (default experiments/results/)")
    sub.add_parser("table", help="print the table from stored results")
    sub.add_parser("paper", help="rebuild paper/report.md from stored results")
    sub.add_parser("list", help="list implemented experiments")
    args = parser.parse_args(argv)

    experiments = discover()
    if args.command == "list":
        for cid, exp in experiments.items():
            print(f"{cid:4s} {exp.title}  (quick run ~{exp.quick_minutes:g} min)")
        return 0
    if args.command == "table":
        print_table(table_rows(experiments, load_results(), ran=set()))
        return 0
    if args.command == "compare":
        try:
            compare(args.run_dir, args.against, experiments)
        except FileNotFoundError as e:
            print(f"compare: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "paper":
        try:
            print(f"wrote {build_paper(experiments)}")
        except ValueError as e:
            print(f"paper not rebuilt: {e}", file=sys.stderr)
            return 1
        return 0

    wanted = [c.strip().upper() for c in args.only.split(",") if c.strip()] or list(CLAIM_IDS)
    unknown = [c for c in wanted if c not in CLAIM_IDS]
    if unknown:
        parser.error(f"unknown claim id(s) {', '.join(unknown)}; known: {', '.join(CLAIM_IDS)}")
    for source in args.weights:  # before any work: a wrong path should not cost a whole run
        problem = weights_problem(source)
        if problem:
            parser.error(f"--weights {source}: {problem}")
    to_run = [experiments[c] for c in wanted if c in experiments]
    stored = load_results()  # before anything is written: what the rerun is compared with
    if args.store:
        out_dir = RESULTS_DIR
    elif args.out is not None:
        if args.out.exists() and any(args.out.iterdir()):
            parser.error(f"--out {args.out}: exists and is not empty (a rerun never overwrites another)")
        args.out.mkdir(parents=True, exist_ok=True)
        out_dir = args.out
    else:
        out_dir = new_run_dir()
    print(f"writing results to {out_dir}" + ("" if args.store else " (experiments/results/ and paper/ untouched; "
                                                                    "--store writes there)"), flush=True)
    ctx = Context(full=args.full, weights=args.weights, results_dir=out_dir, progress_factory=_progress_factory())
    ran, failed = set(), []
    run_start, run_cpu = time.perf_counter(), cpu_seconds()
    for exp in to_run:
        print(f"== {exp.claim}: {exp.title}", flush=True)
        start, cpu_start = time.perf_counter(), cpu_seconds()
        ctx.phases.clear()
        try:
            result = exp.run(ctx)
            path = write_result(exp, result, args.full, time.perf_counter() - start, out_dir,
                                cpu_seconds() - cpu_start, phases=list(ctx.phases))
        except Exception:  # report, keep going with the other claims, exit non-zero at the end
            traceback.print_exc()
            failed.append(exp.claim)
            continue
        print(f"   {result.summary}  ->  {path}  ({time.perf_counter() - start:.0f} s wall, "
              f"{cpu_seconds() - cpu_start:.0f} s CPU, load average {os.getloadavg()[0]:.1f})", flush=True)
        ran.add(exp.claim)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    print(f"ran {len(ran)} claim(s) in {time.perf_counter() - run_start:.0f} s wall, {cpu_seconds() - run_cpu:.0f} s "
          f"CPU (this process and its finished children); load average now {load} (1/5/15 min)", flush=True)
    rows = [r for r in table_rows(experiments, load_results(out_dir), ran) if r[0] in wanted]
    print_table(rows)
    rerun = {k: v for k, v in load_results(out_dir).items() if k in ran}
    print_agreement(agreement_rows(rerun, stored, experiments), "This run vs the results stored before it")
    try:
        paper = build_paper(experiments, out_dir) if args.store else \
            build_paper(experiments, out_dir, out_dir / "report.md")
        print(f"paper: {paper}")
    except ValueError as e:  # stored results that cannot go into the paper (e.g. without a clock)
        print(f"paper not rebuilt: {e}", file=sys.stderr)
        failed.append("paper")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def weights_problem(source: str) -> str | None:
    """Why ``--weights source`` cannot be read, or None: the weight files are opened (headers only)."""
    from reference.model.errors import WeightError
    from reference.model.safetensors_io import SafetensorsError
    from reference.model.weights import open_weights

    try:
        open_weights(source)
    except (WeightError, SafetensorsError, OSError) as e:
        return str(e)
    return None


def _progress_factory():  # noqa: ANN202 - returns a callable making rich Progress objects
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    def make() -> Progress:
        return Progress(TextColumn("   {task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), transient=True)

    return make


if __name__ == "__main__":
    sys.exit(main())
