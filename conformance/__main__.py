"""``python -m conformance [--device cpu|cuda] [-k PATTERN] [--json FILE]``: run the suite.

Prints one row per case (level, elements, result, time, bound), then the first difference of each
failure, and exits 1 if any case failed or crashed (2 on a usage error, e.g. no case matched).
With ``--device cpu`` the Triton kernels run in the interpreter: TRITON_INTERPRET=1 is set here,
before triton is imported (an explicit TRITON_INTERPRET=0 is refused). ``--record-launches FILE``
also writes every kernel launch the cases make (for the compile gate).

``python -m conformance --compile sm_90 [--all | --no-shapes] [--launches FILE | --no-cases] [--json FILE]``: the
compile gate (conformance/compile_gate.py), no GPU needed. It compiles with the real Triton compiler
and ptxas the launches the conformance cases make (recorded by running them under the interpreter
in a child process, or read from ``--launches``) and the launches the launchers pick on a GPU at
Llama-3.1-8B shapes (conformance/real_shapes.py: a representative subset, or ``--all``; ``-k`` picks
cases and real shapes by name). Exits 1 on
a compile error, on spills in a default configuration, or on shared memory over the target's limit.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

from reference.safe_write import atomic_output


class UsageError(Exception):
    """A bad combination of options or environment: printed, exit status 2."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where the fast side runs (default: cuda if present, else cpu under TRITON_INTERPRET=1)")
    p.add_argument("-k", dest="patterns", action="append", metavar="PATTERN",
                   help="run only cases whose name contains PATTERN (or matches it as a glob); repeatable")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--large", dest="large", action="store_true", default=None,
                      help="large shapes (the default on cuda)")
    size.add_argument("--small", dest="large", action="store_false", help="small shapes (the default on cpu)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the input generators (default 0)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--record-launches", type=Path, metavar="FILE",
                   help="also write the kernel launches the cases make (JSON, for --compile --launches)")
    gate = p.add_argument_group("compile gate")
    gate.add_argument("--compile", metavar="TARGET", choices=["sm_90", "sm_80"],
                      help="compile every kernel specialization for TARGET (sm_90 or sm_80) instead of running cases")
    shapes = gate.add_mutually_exclusive_group()
    shapes.add_argument("--all", action="store_true", help="--compile: every real-shape launch, H100 and H200 "
                        "(default: a representative subset)")
    shapes.add_argument("--no-shapes", action="store_true", help="--compile: no real-shape launches (only the "
                        "conformance cases' or --launches')")
    cases = gate.add_mutually_exclusive_group()
    cases.add_argument("--launches", type=Path, metavar="FILE",
                       help="--compile: the conformance launches from this file (from --record-launches) instead "
                       "of recording them now")
    cases.add_argument("--no-cases", action="store_true", help="--compile: only the real-shape launches")
    gate.add_argument("--no-cache", action="store_true", help="--compile: do not read or write the result cache")
    gate.add_argument("--jobs", type=int, default=1, metavar="N", help="--compile: compile in N processes")
    return p.parse_args(argv)


def choose_device(requested: str | None) -> str:
    """Decide the device and switch the interpreter on for cpu, before triton is imported."""
    if requested is None:
        requested = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None
    if requested == "cpu":
        if os.environ.get("TRITON_INTERPRET", "1") != "1":
            raise UsageError("--device cpu runs the Triton kernels in the interpreter: unset TRITON_INTERPRET "
                             "or set it to 1 (it is 0 now)")
        os.environ["TRITON_INTERPRET"] = "1"
        if _native_kernels_loaded():
            raise UsageError("--device cpu: triton was imported in this process before TRITON_INTERPRET=1 was set; "
                             "run `TRITON_INTERPRET=1 python -m conformance --device cpu` in a fresh process")
        return "cpu"
    import torch

    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
        return choose_device(requested) if requested == "cpu" else requested
    if not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available (use --device cpu to run under the interpreter)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise UsageError("--device cuda: TRITON_INTERPRET=1 is set; unset it to run the kernels natively")
    return "cuda"


def _native_kernels_loaded() -> bool:
    """True if triton was already imported in this process without the interpreter."""
    tl = sys.modules.get("triton.language")
    return tl is not None and type(tl.zeros).__name__ != "InterpretedFunction"


def cpu_isas() -> dict[str, object]:
    """The CPU's instruction sets whose native kernels the cases ran (every one this CPU can execute) and the
    ones they could not run here."""
    from fast import cpu_isa

    have = list(cpu_isa.supported())
    return {"cpu": cpu_isa.describe_cpu(), "arch": cpu_isa.arch(), "gated": have,
            "not_gated": [name for name in cpu_isa.ALL if name not in have]}


def print_results(results: list, device: str, large: bool, seconds: float) -> None:
    bounds = sorted({r.bound for r in results if r.bound})
    label = {b: f"B{i + 1}" for i, b in enumerate(bounds)}

    def note(r) -> str:
        if r.status == "skip":
            return r.detail
        if r.bound:
            used = f"{100 * r.bound_used:.0f}% of " if r.bound_used is not None else ""
            return f"{used}bound {label[r.bound]}"
        return ""

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text when rich is missing
        for r in results:
            print(f"{r.status:5}  {r.level:17}  {r.elements:>10}  {r.seconds:7.2f}s  {r.name}  {note(r)}")
    else:
        probe = Console()
        console = Console(width=probe.width if probe.is_terminal else 140)
        table = Table(title=f"conformance on {device} ({'large' if large else 'small'} shapes)")
        for col, kw in [("case", {"no_wrap": True}), ("level", {}), ("elements", {"justify": "right"}),
                        ("result", {}), ("time", {"justify": "right"}), ("note", {})]:
            table.add_column(col, **kw)
        style = {"pass": "green", "FAIL": "bold red", "error": "bold red", "skip": "yellow"}
        for r in results:
            table.add_row(r.name, r.level, f"{r.elements:,}", f"[{style[r.status]}]{r.status}[/]",
                          f"{r.seconds:.2f}s", note(r))
        console.print(table)
    for b in bounds:
        print(f"bound {label[b]}: {b}")
    for r in results:
        if r.failed:
            print(f"\n{r.status}: {r.name} ({r.level})\n  {r.detail}")
    isas = cpu_isas()
    print(f"CPU kernels gated on every instruction set of this CPU ({isas['cpu']}, {isas['arch']}): "
          f"{', '.join(isas['gated'])}; not executable here: {', '.join(isas['not_gated']) or 'none'} "
          "(the aarch64 builds run under qemu in tests/test_aarch64.py)")
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "FAIL", "error", "skip")}
    print(f"\n{counts['pass']} passed, {counts['FAIL']} failed, {counts['error']} errors, "
          f"{counts['skip']} skipped in {seconds:.1f}s")


def write_json(path: Path, results: list, device: str, large: bool, seed: int, seconds: float) -> None:
    from reference.provenance import commit, machine

    info = machine()
    try:
        import torch

        if device == "cuda":
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:  # pragma: no cover
        pass
    doc = {
        "device": device, "large": large, "seed": seed, "seconds": seconds,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit(), "machine": info,
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1", "cpu_isas": cpu_isas(),
        "passed": all(not r.failed for r in results), "cases": [r.to_json() for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as f:  # complete or not at all
        f.write((json.dumps(doc, indent=1) + "\n").encode())


def json_problem(path: Path) -> str | None:
    """Why the results could not be written to ``path`` (checked before the run), or None."""
    if path.is_dir():
        return "is a directory"
    if path.exists() and not os.access(path, os.W_OK):
        return "is not writable"
    folder = path.parent
    while not folder.exists():  # write_json creates the missing folders: the first existing one must allow it
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the directory {folder} is not writable"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for flag, path in (("--json", args.json), ("--record-launches", args.record_launches)):
        problem = json_problem(path) if path else None
        if problem:  # found out now, not after the whole run
            print(f"python -m conformance: {flag} {path}: {problem}", file=sys.stderr)
            return 2
    if args.compile:
        return compile_main(args)
    if args.all or args.launches or args.no_cases or args.no_cache or args.no_shapes:
        print("python -m conformance: --all, --no-shapes, --launches, --no-cases and --no-cache go with --compile",
              file=sys.stderr)
        return 2
    try:
        device = choose_device(args.device)
    except UsageError as e:
        print(f"python -m conformance: {e}", file=sys.stderr)
        return 2
    large = (device == "cuda") if args.large is None else args.large

    import torch

    from conformance.registry import load_cases
    from conformance.run_cases import run_cases, select

    cases = select(load_cases(), args.patterns, large)
    if not cases:
        print(f"no conformance case matches {args.patterns}", file=sys.stderr)
        return 2
    if args.list:
        for c in cases:
            print(f"{c.name:50} {c.level.value:18} {c.bound.text if c.bound else ''}")
        return 0
    start = time.perf_counter()
    with _recording(args.record_launches, device) as recorder:
        results = run_cases(cases, torch.device(device), large, args.seed,
                            on_result=lambda r: print(f"  {r.status:5} {r.seconds:6.2f}s  {r.name}", flush=True),
                            on_start=lambda c: setattr(recorder, "origin", c.name) if recorder else None)
    seconds = time.perf_counter() - start
    print_results(results, device, large, seconds)
    if args.json:
        try:
            write_json(args.json, results, device, large, args.seed, seconds)
        except OSError as e:  # the disk filled up meanwhile: say so in one line (exit 2, not "a case failed")
            print(f"python -m conformance: --json {args.json}: {e.strerror or e}", file=sys.stderr)
            return 2
    return 1 if any(r.failed for r in results) else 0


@contextlib.contextmanager
def _recording(path: Path | None, device: str):
    """Record the kernel launches into ``path`` (JSON) while the cases run; nothing without a path."""
    if path is None:
        yield None
        return
    if device != "cpu":
        raise SystemExit("python -m conformance: --record-launches needs --device cpu (the interpreter)")
    from conformance.launches import record_launches, save

    with record_launches() as recorder:
        yield recorder
    save(path, recorder.all())
    print(f"recorded {len(recorder.launches)} kernel launches into {path}")


def compile_main(args: argparse.Namespace) -> int:
    """The compile gate: record or read the conformance launches, add the real-shape ones, compile."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        print("python -m conformance --compile: compiles for a GPU: unset TRITON_INTERPRET or set it to 0",
              file=sys.stderr)
        return 2
    if _interpreter_loaded():
        print("python -m conformance --compile: triton was imported under the interpreter in this process; "
              "run it in a fresh process", file=sys.stderr)
        return 2
    os.environ["TRITON_INTERPRET"] = "0"  # before fast is imported (it would switch the interpreter on)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated (silences its warning)
    from conformance import compile_gate, launches, real_shapes

    start = time.perf_counter()
    found: list = []
    if args.launches:
        try:
            found = launches.load(args.launches)
        except ValueError as e:
            print(f"python -m conformance: --launches: {e}", file=sys.stderr)
            return 2
    elif not args.no_cases:
        found = _record_in_child(args)
        if found is None:
            return 1
    print(f"{len(found)} launches from conformance cases", flush=True)
    if not args.no_shapes:
        gpus = real_shapes.gpus_for(args.compile)
        planned = real_shapes.all_launches(gpus) if args.all else real_shapes.subset_launches(args.compile)
        if args.patterns:  # -k also picks real shapes, by their names
            planned = [x for x in planned if any(p.lower() in x.origin.lower() for p in args.patterns)]
        found += planned
    if not found:
        print("python -m conformance --compile: nothing to compile", file=sys.stderr)
        return 2
    results = compile_gate.run_gate(found, args.compile, use_cache=not args.no_cache, jobs=max(1, args.jobs),
                                    on_result=lambda r: print(f"  {r.status:6} {r.seconds:5.1f}s  "
                                                              f"{r.kernel.split(':')[1]}  {r.origin}", flush=True))
    seconds = time.perf_counter() - start
    compile_gate.print_report(results, args.compile, seconds)
    if args.json:
        import triton

        from reference.provenance import commit

        doc = {"target": args.compile, "triton": triton.__version__, "all": args.all, "seconds": seconds,
               "commit": commit(), "passed": not any(r.failed for r in results),
               "results": [r.to_json() for r in results]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(args.json) as f:
            f.write((json.dumps(doc, indent=1) + "\n").encode())
    return 1 if any(r.failed for r in results) else 0


def _record_in_child(args: argparse.Namespace) -> list | None:
    """Run the cases under the interpreter in a child process, recording their launches."""
    import subprocess
    import tempfile

    from conformance import launches

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "launches.json"
        cmd = [sys.executable, "-m", "conformance", "--device", "cpu", "--seed", str(args.seed),
               "--record-launches", str(path)]
        for pattern in args.patterns or []:
            cmd += ["-k", pattern]
        env = dict(os.environ, TRITON_INTERPRET="1")
        print(f"recording the conformance cases' launches: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not path.exists():
            tail = (proc.stdout + proc.stderr)[-3000:]
            print(f"python -m conformance --compile: the conformance run failed (exit {proc.returncode}); fix it "
                  f"first, or pass --no-cases:\n{tail}", file=sys.stderr)
            return None
        return launches.load(path)


def _interpreter_loaded() -> bool:
    """True if triton was already imported in this process with the interpreter on."""
    tl = sys.modules.get("triton.language")
    return tl is not None and type(tl.zeros).__name__ == "InterpretedFunction"


if __name__ == "__main__":
    sys.exit(main())
