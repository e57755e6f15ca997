"""The experiment registry: one module per claim, found by its file name.

To add an experiment, add a module ``experiments/<claim>_<topic>.py`` (e.g. ``u3_ratio.py``) that
defines ``EXPERIMENT = Experiment(claim="U3", title=..., run=...)``. Nothing else changes: the
runner discovers it, the table gets its row, the paper gets its section.

``run(ctx)`` does the work and returns a ``Result``; the runner adds the setup (machine, commit,
date), writes ``experiments/results/<claim>.json`` and prints the table.

Every result states the clock its times are on (``Result.clock``, one of ``CLOCKS``), and the paper
prints it in the section; a result whose numbers look timed (a key ending in _ms, _s, _mbps, ...) with
no clock, or with ``"none"``, is refused when written and when the paper is built.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# The clocks a result's times can be on (``Result.clock``), and what each means for a reader.
CLOCKS = {
    "wall": "wall-clock seconds (time.perf_counter) on the machine named below; other load on it counts",
    "cpu-process": ("CPU seconds of the measuring process (time.process_time; idle gaps skipped): less "
                    "exposed to other load than wall time, but not immune (caches, memory bandwidth and "
                    "frequency are shared), so absolute figures move between runs; compare ratios"),
    "simulated": "simulated seconds of a discrete-event model (costs calibrated from measurements)",
    "none": "no timing: counts, sizes and ratios of them only",
}
_TIMED_KEY = re.compile(r"(_ms|_s|seconds|_per_s|_mbps|_gbps)$")


@dataclass
class Result:
    """What an experiment measured, and how it compares with the article."""

    measured: dict[str, Any]  # our numbers (the JSON's "measured")
    summary: str  # one short line for the table's "ours" column
    verdict: str  # "matches", "differs", "partly matches", ...
    why: str  # one or two sentences: the basis of the verdict
    setup: dict[str, Any] = field(default_factory=dict)  # weights, workload, sizes
    article: dict[str, Any] = field(default_factory=dict)  # the article's numbers, quoted
    figures: list[str] = field(default_factory=list)  # paths relative to experiments/results
    clock: str | None = None  # one of CLOCKS: what every time in ``measured`` and ``summary`` is on
    clock_detail: str = ""  # optional: how that clock was taken here (threads, what was skipped, ...)
    notes: list[str] = field(default_factory=list)  # caveats the paper prints in the section's text
    tables: list[str] = field(default_factory=list)  # markdown tables for the paper's section
    # the figure a rerun is compared on (``experiments.engine.agreement``): {"name", "value", "min", "max"}, min/max
    # the spread over the run's repeats (equal to value for a deterministic, simulated figure)
    headline: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.clock is not None and self.clock not in CLOCKS:
            raise ValueError(f"Result.clock must be one of {sorted(CLOCKS)}, got {self.clock!r}")


def clock_problem(clock: str | None, measured: Any) -> str | None:
    """Why a result's clock is not acceptable (None if it is): a clock must be stated, and "none" is
    only allowed when no measured key looks like a time (ends in _ms, _s, _seconds, _per_s, _mbps)."""
    if clock is None:
        return f"no clock stated: set Result.clock to one of {sorted(CLOCKS)}"
    if clock not in CLOCKS:
        return f"unknown clock {clock!r}: use one of {sorted(CLOCKS)}"
    if clock == "none":
        timed = sorted(k for k in _keys(measured) if _TIMED_KEY.search(k))
        if timed:
            return f"clock 'none' but these measured numbers look timed: {timed[:5]}"
    return None


def _keys(x: Any) -> Iterator[str]:
    if isinstance(x, dict):
        for k, v in x.items():
            yield str(k)
            yield from _keys(v)
    elif isinstance(x, list):
        for v in x:
            yield from _keys(v)


@dataclass
class Context:
    """What the runner hands an experiment."""

    full: bool = False  # --full: full sizes; otherwise quick sizes (the whole quick run < 15 min)
    weights: list[str] = field(default_factory=list)  # extra checkpoints given with --weights
    results_dir: Path = RESULTS_DIR
    progress_factory: Callable[[], Any] | None = None  # returns a rich Progress, or None
    # every track()ed phase of the claim being run: description, wall and CPU seconds (the runner clears
    # it before each claim and stores it in the result's setup, so a quick size's cost can be read per part)
    phases: list[dict[str, Any]] = field(default_factory=list)

    @contextmanager
    def progress(self) -> Iterator[Any]:
        """A rich Progress to add tasks to (a silent stand-in when not on a terminal)."""
        if self.progress_factory is None:
            yield _SilentProgress()
            return
        with self.progress_factory() as p:
            yield p

    def track(self, items: Iterable[Any], description: str, total: int | None = None) -> Iterator[Any]:
        """Iterate with a progress bar."""
        items = list(items) if total is None else items
        total = len(items) if total is None else total  # type: ignore[arg-type]
        start, cpu_start = time.perf_counter(), cpu_seconds()
        try:
            with self.progress() as p:
                task = p.add_task(description, total=total)
                for item in items:
                    yield item
                    p.advance(task)
        finally:
            self.phases.append({"phase": description, "seconds": round(time.perf_counter() - start, 1),
                                "cpu_seconds": round(cpu_seconds() - cpu_start, 1)})


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (worker processes included)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class _SilentProgress:
    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def advance(self, *args: Any, **kwargs: Any) -> None:
        pass

    def update(self, *args: Any, **kwargs: Any) -> None:
        pass


@dataclass(frozen=True)
class Experiment:
    claim: str  # the claim id in CLAIMS.md, e.g. "U1"
    title: str
    run: Callable[[Context], Result]
    quick_minutes: float = 1.0  # the quick run in one process on a 2-core machine, rounded up to 1/4 min (as measured)
    # the table cell ("ours") from a result record as stored (its "measured" and "setup"): run() builds its
    # Result.summary with it, and the table and the paper call it on stored results, so a wording change
    # (which figure is comparable with the article's, which code produced a speed) reaches them without a
    # rerun; every number still comes from the record. None: the stored summary is the cell.
    summarize: Callable[[dict[str, Any]], str] | None = None
    # False: no number of the result depends on a clock (counts, sizes, simulated time from fixed inputs), so
    # it is the same however loaded the machine is; ``reproduce --jobs 2`` runs these in a second process
    timed: bool = True
    # True: under ``--jobs 2`` it starts only once the second process has ended, with the cores to itself as in a
    # one-process run: it times worker processes of its own, whose wall clocks matter (E4, R2), or its verdict
    # rests on CPU-time ratios near their threshold, which a neighbour's changing work blurs (E1)
    alone: bool = False
    # stored result files (repository paths) whose numbers the row quotes instead of measuring them in the
    # run (a GPU's benchmark, a vLLM head-to-head): ``reproduce`` says so, and the paper names them
    quotes: tuple[str, ...] = ()
    # what the row rests on (repository paths): filled by ``discover`` with the claim module, the
    # experiments modules it imports, its stored result, and ``quotes``
    evidence: tuple[str, ...] = ()


def evidence_of(module_file: Path, exp: Experiment) -> tuple[str, ...]:
    """The claim module, the experiments modules it imports (its benchmarks), its result file, its quotes."""
    import ast

    repo = module_file.resolve().parents[2]
    used = [module_file.resolve()]
    for node in ast.walk(ast.parse(module_file.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module in ("experiments.unweight", "experiments.engine",
                                                                 "experiments.disagg", "experiments.edge"):
            names = [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            path = repo / (name.replace(".", "/") + ".py")
            if name.startswith("experiments.") and not name.startswith("experiments.claims") and path.exists() \
                    and name not in ("experiments.registry", "experiments.report"):
                used.append(path)
    files = [str(p.relative_to(repo)) for p in dict.fromkeys(used)]
    return (*files, f"experiments/results/{exp.claim}.json", *exp.quotes)


def discover() -> dict[str, Experiment]:
    """Every claim module's EXPERIMENT, by claim id.

    A claim module is any module of the package ``experiments/claims/`` (its place says what it is);
    helpers the claim modules share live one level up, in ``experiments/``."""
    from experiments import claims

    found: dict[str, Experiment] = {}
    for mod in pkgutil.iter_modules(claims.__path__):
        module = importlib.import_module(f"experiments.claims.{mod.name}")
        exp = getattr(module, "EXPERIMENT", None)
        if not isinstance(exp, Experiment):
            raise TypeError(f"experiments/claims/{mod.name}.py must define EXPERIMENT = Experiment(...)")
        if exp.claim in found:
            raise ValueError(f"two experiments claim {exp.claim}: {mod.name} and another module")
        found[exp.claim] = dataclasses.replace(exp, evidence=evidence_of(Path(module.__file__), exp))
    return found


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), imported when a figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, ctx: Context, name: str, dpi: int = 110) -> str:
    """Lay out, write ``ctx.results_dir/name`` and close a matplotlib figure; returns the name for the result."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    ctx.results_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(ctx.results_dir / name, dpi=dpi)
    plt.close(fig)
    return name
