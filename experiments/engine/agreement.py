"""A rerun next to the stored results: per claim, both headlines, whether the verdicts agree, and
whether the rerun's figures fall inside the stored spread.

``python -m experiments reproduce`` writes a rerun into ``runs/<date>-<commit>/`` (git ignores it) and
prints this table at the end; ``python -m experiments compare RUN_DIR`` prints it again later.

Verdicts are compared by their class (the text before any " (" or ";"): "matches", "partly matches",
"differs", ...; a verdict that says "inconclusive" on either side is not a disagreement (the figure sat
within its noise), and the table says so. Spreads: a result may name its headline figure
(``Result.headline``: value with the min and max over its repeats); otherwise every spread the result
stores (a dict with median, min, max and runs, as ``experiments.engine.stats.spread`` writes) is
compared key by key, and the cell counts how many of the rerun's medians fall inside the stored min-max.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from experiments.claims import CLAIMS
from experiments.registry import Experiment
from experiments.report import REPO, load_results, summary_of
from reference import provenance

RUNS_DIR = REPO / "runs"


def new_run_dir(root: Path = RUNS_DIR) -> Path:
    """``root/<YYYY-MM-DD>-<commit>`` (with ``-2``, ``-3``, ... when that run already exists), created."""
    base = f"{dt.datetime.now(dt.UTC):%Y-%m-%d}-{provenance.commit()}"
    path, k = root / base, 1
    while path.exists():
        k += 1
        path = root / f"{base}-{k}"
    path.mkdir(parents=True)
    return path


def verdict_class(verdict: str) -> str:
    """'partly matches (stored, ...)' -> 'partly matches'; '' for a missing verdict."""
    return re.split(r" \(|;|:", verdict or "", maxsplit=1)[0].strip().lower()


def verdicts_agree(stored: str, rerun: str) -> str:
    """'yes', 'no', or 'inconclusive' (either side says its figure sat within its noise)."""
    a, b = verdict_class(stored), verdict_class(rerun)
    if "inconclusive" in (a + b):
        return "yes" if a == b else "inconclusive"
    return "yes" if a == b else "no"


def _spreads(x: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(x, dict):
        if {"median", "min", "max", "runs"} <= set(x):
            yield path, x
            return
        for k, v in x.items():
            yield from _spreads(v, f"{path}.{k}" if path else str(k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _spreads(v, f"{path}[{i}]")


def _inside(value: float, lo: float, hi: float) -> bool:
    tol = 1e-9 * max(1.0, abs(lo), abs(hi))  # rounding in the JSON
    return lo - tol <= value <= hi + tol


def spread_cell(stored: dict[str, Any], rerun: dict[str, Any]) -> str:
    """Whether the rerun's headline (or its spreads) fall inside the stored spread, in words."""
    h0, h1 = stored.get("headline") or {}, rerun.get("headline") or {}
    if h0 and h1 and h0.get("name") == h1.get("name"):
        v, lo, hi = h1["value"], h0.get("min", h0["value"]), h0.get("max", h0["value"])
        where = f"{h1['name']} {v:.3g} vs stored {lo:.3g}" + (f"-{hi:.3g}" if hi != lo else "")
        return ("inside: " if _inside(v, lo, hi) else "outside: ") + where
    old = dict(_spreads(stored.get("measured", {})))
    new = dict(_spreads(rerun.get("measured", {})))
    common = [k for k in new if k in old]
    if not common:
        same = stored.get("summary") == rerun.get("summary")
        return "no spread stored; " + ("the same headline" if same else "headline changed")
    inside = [k for k in common if _inside(new[k]["median"], old[k]["min"], old[k]["max"])]
    out = [k for k in common if k not in inside]
    return f"{len(inside)}/{len(common)} medians inside" + (f" (outside: {', '.join(out[:3])})" if out else "")


def agreement_rows(run: dict[str, dict[str, Any]], stored: dict[str, dict[str, Any]],
                   experiments: dict[str, Experiment] | None = None) -> list[tuple[str, ...]]:
    """(claim, stored headline, rerun headline, verdicts stored -> rerun, agree, spread) per claim of the run.
    With ``experiments``, both headlines are put in today's wording (``report.summary_of``), so a stored
    result written before a wording change compares with a rerun on its numbers."""
    rows = []
    for c in CLAIMS:
        r = run.get(c.id)
        if r is None:
            continue
        if experiments is not None:
            exp = experiments.get(c.id)
            r = {**r, "summary": summary_of(exp, r)}
            if c.id in stored:
                stored = {**stored, c.id: {**stored[c.id], "summary": summary_of(exp, stored[c.id])}}
        s = stored.get(c.id)
        if s is None:
            rows.append((c.id, "-", r.get("summary", ""), f"- -> {r.get('verdict', '')}", "no stored result", "-"))
            continue
        sizes = f" [{s.get('setup', {}).get('size', '?')} vs {r.get('setup', {}).get('size', '?')} size]" \
            if s.get("setup", {}).get("size") != r.get("setup", {}).get("size") else ""
        rows.append((c.id, s.get("summary", ""), r.get("summary", ""),
                     f"{verdict_class(s.get('verdict', ''))} -> {verdict_class(r.get('verdict', ''))}",
                     verdicts_agree(s.get("verdict", ""), r.get("verdict", "")) + sizes, spread_cell(s, r)))
    return rows


def print_agreement(rows: list[tuple[str, ...]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for col in ("claim", "stored headline", "rerun headline", "verdict stored -> rerun", "agree",
                "rerun inside stored spread"):
        table.add_column(col, overflow="fold")
    for row in rows:
        color = {"yes": "green", "no": "red"}.get(row[4].split(" ")[0], "yellow")
        table.add_row(*row[:4], f"[{color}]{row[4]}[/{color}]", row[5])
    console = Console()
    if not console.is_terminal:
        console = Console(width=190)
    console.print(table)
    disagree = [r[0] for r in rows if r[4].startswith("no") and not r[4].startswith("no stored")]
    print(f"verdicts: {len(rows) - len(disagree)} of {len(rows)} agree with the stored ones or are inconclusive"
          + (f"; disagree: {', '.join(disagree)}" if disagree else ""))


def compare(run_dir: Path, stored_dir: Path, experiments: dict[str, Experiment] | None = None) -> list[tuple[str, ...]]:
    """Print the agreement table of ``run_dir`` against ``stored_dir``; returns its rows."""
    run = load_results(run_dir)
    if not run:
        raise FileNotFoundError(f"{run_dir}: no result files (<claim>.json) in it")
    rows = agreement_rows(run, load_results(stored_dir), experiments)
    print_agreement(rows, f"Rerun {run_dir.name} vs stored results ({stored_dir})")
    return rows
