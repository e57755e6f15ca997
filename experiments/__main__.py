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
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from experiments.claims import CLAIM_IDS
from experiments.engine.agreement import agreement_rows, compare, new_run_dir, print_agreement
from experiments.registry import RESULTS_DIR, Context, Experiment, cpu_seconds, discover
from experiments.report import REPO, build_paper, load_results, print_table, table_rows, write_result


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
    rep.add_argument("--jobs", type=int, choices=(1, 2), default=None,
                     help="2 (the default with 2 or more cores): the claims whose numbers depend on no clock run in a "
                          "second process beside the timed ones; 1: every claim in this process, one after another")
    where.add_argument("--part-of", type=Path, help=argparse.SUPPRESS)  # --jobs 2's second process: the run's folder
    cmp = sub.add_parser("compare", help="print a rerun's agreement table against the stored results")
    cmp.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the rerun's folder")
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
    if args.part_of is not None:  # the second process of --jobs 2: its claims into the run's folder, nothing else
        ctx = Context(full=args.full, weights=args.weights, results_dir=args.part_of)
        return 1 if run_claims(to_run, ctx, args.full, args.part_of)[1] else 0
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
    jobs = args.jobs or (2 if (os.cpu_count() or 1) >= 2 else 1)
    mine, theirs = split_claims(to_run, jobs)
    ctx = Context(full=args.full, weights=args.weights, results_dir=out_dir, progress_factory=_progress_factory())
    run_start, run_cpu = time.perf_counter(), cpu_seconds()
    second = SecondProcess(theirs, args, out_dir) if theirs else None
    try:
        ran, failed = run_claims(mine, ctx, args.full, out_dir, before=second)
    except BaseException:  # interrupted: do not leave the second process running
        if second is not None:
            second.proc.kill()
            second.proc.wait()
        raise
    if second is not None:
        done, lost = second.finish()
        ran |= done
        failed += lost
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    print(f"ran {len(ran)} claim(s) in {time.perf_counter() - run_start:.0f} s wall, {cpu_seconds() - run_cpu:.0f} s "
          f"CPU (this process and its finished children); load average now {load} (1/5/15 min)", flush=True)
    rows = [r for r in table_rows(experiments, load_results(out_dir), ran) if r[0] in wanted]
    print_table(rows)
    print_provenance([experiments[c] for c in sorted(ran) if c in experiments])
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


def print_provenance(ran: list[Experiment]) -> None:
    """Per claim: measured in this run, and which stored files it quoted instead (never silently)."""
    print("measured in this run: " + ", ".join(e.claim for e in ran), flush=True)
    for e in ran:
        stored = [q for q in e.quotes if (REPO / q).exists()]
        if stored:
            print(f"  {e.claim} also QUOTES (not re-measured here): " + ", ".join(stored), flush=True)


def split_claims(claims: list[Experiment], jobs: int) -> tuple[list[Experiment], list[Experiment]]:
    """(this process's claims, the second process's): with ``jobs`` 2, the claims no clock enters
    (``Experiment.timed`` False: their numbers are the same however loaded the machine is) go to a second
    process and the timed ones stay here, in order, but those that run alone (``Experiment.alone``) last: they
    wait for the second process, which by then has most likely ended; with 1, or when only one kind is asked
    for, all stay, in order."""
    theirs = [e for e in claims if not e.timed] if jobs >= 2 else []
    if len(theirs) in (0, len(claims)):
        return list(claims), []
    return [e for e in claims if e.timed and not e.alone] + [e for e in claims if e.alone], theirs


def run_claims(claims: list[Experiment], ctx: Context, full: bool, out_dir: Path,
               before: SecondProcess | None = None) -> tuple[set[str], list[str]]:
    """Run each claim, write its result, print a line; (claims that ran, claims that failed). ``before``: the
    second process of --jobs 2, waited for before a claim that runs alone (``Experiment.alone``)."""
    ran: set[str] = set()
    failed: list[str] = []
    for exp in claims:
        if before is not None and exp.alone and before.running():
            print(f"== {exp.claim} runs alone: waiting for the second process first", flush=True)
            before.wait()
        print(f"== {exp.claim}: {exp.title}", flush=True)
        start, cpu_start = time.perf_counter(), cpu_seconds()
        ctx.phases.clear()
        try:
            result = exp.run(ctx)
            path = write_result(exp, result, full, time.perf_counter() - start, out_dir,
                                cpu_seconds() - cpu_start, phases=list(ctx.phases))
        except Exception:  # report, keep going with the other claims, exit non-zero at the end
            traceback.print_exc()
            failed.append(exp.claim)
            continue
        print(f"   {result.summary}  ->  {path}  ({time.perf_counter() - start:.0f} s wall, "
              f"{cpu_seconds() - cpu_start:.0f} s CPU, load average {os.getloadavg()[0]:.1f})", flush=True)
        ran.add(exp.claim)
    return ran, failed


class SecondProcess:
    """``--jobs 2``: the untimed claims in a second ``python -m experiments reproduce`` of this checkout,
    writing into the same run folder; its output is kept and printed when it ends. It is waited for (and so
    reaped, its CPU seconds counted among this process's finished children) before a claim that runs alone, or
    at the end: never while a claim of this process is timing."""

    def __init__(self, claims: list[Experiment], args: argparse.Namespace, out_dir: Path) -> None:
        self.claims = [e.claim for e in claims]
        self.out_dir = out_dir
        self.log = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, "-m", "experiments", "reproduce", "--only", ",".join(self.claims),
               "--part-of", str(out_dir)] + ["--full"] * args.full + [x for w in args.weights for x in ("--weights", w)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        self.started, self.started_at = time.perf_counter(), time.time()
        print(f"second process: {', '.join(self.claims)} (no clock enters their numbers), beside this one's",
              flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)  # this cwd: same paths
        self.seconds: float | None = None
        self.cpu_seconds = 0.0

    def running(self) -> bool:
        return self.seconds is None

    def wait(self) -> int:
        """Wait for it to end (once); its exit status. Called while no claim of this process runs, so the CPU
        seconds of children reaped meanwhile are its own."""
        if self.seconds is None:
            before = cpu_seconds()
            self.proc.wait()
            self.seconds, self.cpu_seconds = time.perf_counter() - self.started, cpu_seconds() - before
        return self.proc.wait()

    def finish(self) -> tuple[set[str], list[str]]:
        """Wait, print its output and time; (claims whose result it wrote, claims that failed)."""
        code = self.wait()
        self.log.seek(0)
        for line in self.log.read().splitlines():
            print(f"   [second process] {line}")
        done = {c for c in self.claims if (self.out_dir / f"{c}.json").is_file()
                and (self.out_dir / f"{c}.json").stat().st_mtime >= self.started_at}
        print(f"second process: {len(done)} claim(s) in {self.seconds:.0f} s wall, {self.cpu_seconds:.0f} s CPU "
              f"(exit status {code})", flush=True)
        return done, [c for c in self.claims if c not in done]


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
