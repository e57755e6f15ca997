"""Results on disk, the reproduction table, and the paper built from them.

A result file ``experiments/results/<claim>.json`` holds at least: claim, title, setup (weights,
workload, machine, commit, date), measured, article, verdict, why, summary, figures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments import setup_info
from experiments.claims import CLAIMS
from experiments.registry import RESULTS_DIR, Experiment, Result

REPO = Path(__file__).resolve().parent.parent
PAPER = REPO / "paper" / "report.md"


def write_result(exp: Experiment, result: Result, full: bool, seconds: float, results_dir: Path) -> Path:
    """Write one claim's result JSON, with the setup every number needs next to it."""
    setup = {
        **result.setup,
        "machine": setup_info.machine(),
        "commit": setup_info.commit(),
        "date": setup_info.now(),
        "size": "full" if full else "quick",
        "seconds": round(seconds, 1),
    }
    record = {
        "claim": exp.claim,
        "title": exp.title,
        "setup": setup,
        "measured": result.measured,
        "article": result.article,
        "summary": result.summary,
        "verdict": result.verdict,
        "why": result.why,
        "figures": result.figures,
        "tables": result.tables,
    }
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{exp.claim}.json"
    path.write_text(json.dumps(record, indent=2, default=_jsonable) + "\n")
    return path


def load_results(results_dir: Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """Every stored result by claim id (unreadable files are reported, not fatal)."""
    out = {}
    for c in CLAIMS:
        path = results_dir / f"{c.id}.json"
        if path.is_file():
            try:
                out[c.id] = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                out[c.id] = {"summary": f"unreadable result file: {e}", "verdict": "error"}
    return out


def table_rows(
    implemented: dict[str, Experiment], results: dict[str, dict[str, Any]], ran: set[str]
) -> list[tuple[str, str, str, str, str]]:
    """(claim, topic, article, ours, verdict) for every claim in CLAIMS.md."""
    rows = []
    for c in CLAIMS:
        r = results.get(c.id)
        if c.id not in implemented:
            ours, verdict = "-", "not implemented yet"
        elif r is None:
            ours, verdict = "-", "not run yet"
        else:
            ours = r.get("summary", "")
            verdict = r.get("verdict", "")
            if c.id not in ran:
                setup = r.get("setup", {})
                verdict += f" (stored, {setup.get('date', '?')[:10]} @ {setup.get('commit', '?')})"
        rows.append((c.id, c.topic, c.article, ours, verdict))
    return rows


def print_table(rows: list[tuple[str, str, str, str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Reproduction: the articles' claims, and what we measured", show_lines=True)
    for col, style in [("claim", "bold"), ("what", ""), ("article", "cyan"), ("ours", "green"), ("verdict", "")]:
        table.add_column(col, style=style, overflow="fold")
    for row in rows:
        verdict = row[4]
        color = "dim"
        if verdict.startswith("matches"):
            color = "green"
        elif verdict.startswith(("partly", "differs")):
            color = "yellow"
        table.add_row(*row[:4], f"[{color}]{verdict}[/{color}]")
    console = Console()
    if not console.is_terminal:  # a log file: do not wrap the table at 80 columns
        console = Console(width=170)
    console.print(table)


def build_paper(implemented: dict[str, Experiment], results_dir: Path = RESULTS_DIR, out: Path = PAPER) -> Path:
    """Write paper/report.md from the stored results: every number in it comes from a JSON."""
    results = load_results(results_dir)
    lines = [
        "# Reproducing Unweight, Infire and edge placement: the report",
        "",
        "Built by `python -m experiments paper` from `experiments/results/*.json`; no number here is",
        "typed by hand. Each section names the weights, workload, machine and commit it was measured on.",
        "",
        "| claim | what | article | ours | verdict |",
        "|---|---|---|---|---|",
    ]
    for cid, topic, article, ours, verdict in table_rows(implemented, results, ran=set(results)):
        lines.append(f"| {cid} | {topic} | {article} | {ours} | {verdict} |")
    for c in CLAIMS:
        r = results.get(c.id)
        if not r or "setup" not in r:
            continue
        s = r["setup"]
        m = s.get("machine", {})
        lines += [
            "",
            f"## {c.id}: {r.get('title', c.topic)}",
            "",
            f"**Article:** {c.article}.  ",
            f"**Ours:** {r.get('summary', '')}.  ",
            f"**Verdict:** {r.get('verdict', '')}. {r.get('why', '')}",
            "",
            f"Measured on: weights {s.get('weights', '-')}; workload {s.get('workload', '-')}; "
            f"{m.get('cpu', '?')} ({m.get('cores', '?')} cores); commit {s.get('commit', '?')}; "
            f"{s.get('date', '?')}; {s.get('size', '?')} size.",
        ]
        for table in r.get("tables", []):
            lines += ["", table]
        for fig in r.get("figures", []):
            lines += ["", f"![{c.id}](../experiments/results/{fig})"]
    lines += engine_bench_section(results_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


def engine_bench_section(results_dir: Path) -> list[str]:
    """The engine benchmark (``python -m experiments.bench_engine``), if it has been run: one row per system."""
    path = results_dir / "bench_engine.json"
    if not path.exists():
        return []
    r = json.loads(path.read_text())
    m, s = r["measured"], r["setup"]
    lines = ["", "## Engine benchmark: fast engine vs transformers vs reference", "",
             f"**Goal:** {r.get('goal', '')}.  ", f"**Result:** {r.get('verdict', '')}. {r.get('why', '')}", "",
             "| system | useful tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |", "|---|---|---|---|"]
    for name, tok_s in m["useful_tok_s"].items():
        ttft, itl = m["ttft_ms"][name], m["itl_ms"][name]
        lines.append(f"| {name} | {tok_s:.1f} | {ttft['p50']:.0f} / {ttft['p99']:.0f} | "
                     f"{itl['p50']:.0f} / {itl['p99']:.0f} |")
    machine = s.get("machine", {})
    lines += ["", f"Measured on: weights {s.get('weights')}; workload {s.get('workload')}; {s.get('threads')} "
              f"threads on {machine.get('cpu', '?')} ({machine.get('cores', '?')} cores, load average "
              f"{s.get('load_average')}); commit {s.get('commit')}; {s.get('date')}. transformers by batch size: "
              f"{m.get('transformers_by_batch', {})} useful tok/s."]
    lines += [f"\n![engine benchmark](../experiments/results/{fig})" for fig in r.get("figures", [])]
    return lines


def _jsonable(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")
