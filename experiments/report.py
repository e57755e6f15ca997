"""Results on disk, the reproduction table, and the paper built from them.

A result file ``experiments/results/<claim>.json`` holds at least: claim, title, setup (weights,
workload, machine, commit, date), measured, article, verdict, why, summary, figures.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from experiments.claims import CLAIMS
from experiments.registry import CLOCKS, RESULTS_DIR, Experiment, Result, clock_problem
from reference import provenance
from reference.safe_write import write_text

REPO = Path(__file__).resolve().parent.parent
PAPER = REPO / "paper" / "report.md"


def write_result(exp: Experiment, result: Result, full: bool, seconds: float, results_dir: Path,
                 cpu_seconds: float | None = None, phases: list[dict[str, Any]] | None = None) -> Path:
    """Write one claim's result JSON, with the setup every number needs next to it (and its clock).
    ``seconds``: the run's wall time; ``cpu_seconds``: its CPU time, worker processes included (less
    exposed than wall time to other load on a shared machine); ``phases``: the wall and CPU seconds of
    each part the experiment tracked (``Context.track``)."""
    problem = clock_problem(result.clock, result.measured)
    if problem:
        raise ValueError(f"experiment {exp.claim}: {problem}")
    setup = {
        **result.setup,
        "machine": provenance.machine(),
        "commit": provenance.commit(),
        "date": provenance.now(),
        "size": "full" if full else "quick",
        "seconds": round(seconds, 1),
        **({"cpu_seconds": round(cpu_seconds, 1)} if cpu_seconds is not None else {}),
        **({"phases": phases} if phases else {}),
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
        "notes": result.notes,
        "clock": result.clock,
        "clock_detail": result.clock_detail,
        "tables": result.tables,
        "headline": result.headline,
    }
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{exp.claim}.json"
    write_text(path, json.dumps(record, indent=2, default=_jsonable) + "\n")
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


# what a claim's ``summarize`` may raise on a record written before it read a field: the stored summary stands
_OLD_RECORD = (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError)


def summary_of(exp: Experiment | None, record: dict[str, Any]) -> str:
    """The "ours" cell of a result: the claim's ``summarize`` applied to the record (the stored numbers in
    today's wording), or the stored summary when the claim has none or the record lacks what it reads."""
    if exp is not None and exp.summarize is not None and "measured" in record:
        try:
            return exp.summarize(record)
        except _OLD_RECORD:
            pass
    return record.get("summary", "")


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
            ours = summary_of(implemented[c.id], r)
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
    """Write paper/report.md from the stored results: every number in it comes from a JSON.

    ``results_dir``/``out`` elsewhere (a rerun's ``runs/<date>-<commit>/``): the paper of that run, its
    figures linked relative to ``out``."""
    results = load_results(results_dir)
    figs = Path(os.path.relpath(results_dir.resolve(), out.resolve().parent)).as_posix()
    problems = [f"{cid}: {p}" for cid, r in results.items() if "setup" in r
                for p in [clock_problem(r.get("clock"), r.get("measured", {}))] if p]
    if problems:
        raise ValueError("cannot build the paper, results without a valid clock (rerun them):\n  "
                         + "\n  ".join(problems))
    lines = [
        "# Reproducing Unweight, Infire and edge placement: the report",
        "",
        ("Built by `python -m experiments paper` from `experiments/results/*.json`; no number here is"
         if results_dir.resolve() == RESULTS_DIR.resolve() else
         "Built by `python -m experiments reproduce` from the result files beside it (a rerun); no number here is"),
        "typed by hand. Each section names the weights, workload, machine and commit it was measured on,",
        "and the clock its times are on:",
        "",
        *[f"- **{name}**: {text}." for name, text in CLOCKS.items()],
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
            f"**Ours:** {summary_of(implemented.get(c.id), r)}.  ",
            f"**Verdict:** {r.get('verdict', '')}. {r.get('why', '')}",
            "",
            f"Measured on: weights {s.get('weights', '-')}; workload {s.get('workload', '-')}; "
            f"{m.get('cpu', '?')} ({counted(m.get('cores'), 'core')}"
            + (f", load average {m['load_average']} at the end, its own work included" if "load_average" in m else "")
            + f"); commit {s.get('commit', '?')}; "
            f"{s.get('date', '?')}; {s.get('size', '?')} size.  ",
            f"**Clock:** {r['clock']}" + (f" ({r['clock_detail']})" if r.get("clock_detail") else "") + ".  ",
            f"**Evidence:** {evidence_line(implemented.get(c.id))}",
        ]
        for note in r.get("notes", []):
            lines += ["", f"**Note:** {note}"]
        for table in r.get("tables", []):
            lines += ["", table]
        if c.id == "U3":
            lines += codec_peers_lines(results_dir)
        for fig in r.get("figures", []):
            lines += ["", f"![{c.id}]({figs}/{fig})"]
    if results_dir.resolve() == RESULTS_DIR.resolve() and out.resolve() == PAPER.resolve():
        readme_table(table_rows(implemented, results, ran=set(results)))
    lines += engine_bench_section(results_dir)
    lines += _serve_section(results_dir)
    lines += _fleet_section(results_dir)
    lines += _cluster_scale_section(results_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out, "\n".join(lines) + "\n")
    return out


def evidence_line(exp: Experiment | None) -> str:
    """The files a claim's row rests on, and those it quotes rather than re-measures."""
    if exp is None:
        return "-"
    quoted = [q for q in exp.quotes if (REPO / q).exists()]
    line = ", ".join(f"`{e}`" for e in exp.evidence if e not in exp.quotes)
    return line + (f"; quoted, not re-measured by `reproduce`: {', '.join(f'`{q}`' for q in quoted)}" if quoted else "")


README = REPO / "README.md"
BEGIN, END = "<!-- results:begin (python -m experiments paper) -->", "<!-- results:end -->"


def with_results_table(text: str, rows: list[tuple[str, str, str, str, str]]) -> str:
    """``text`` with the short results table (claim, what, the articles' figure, verdict) between its markers."""
    if BEGIN not in text or END not in text:
        return text
    table = ["| claim | what | the articles | our verdict |", "|---|---|---|---|"]
    table += [f"| {cid} | {topic} | {article} | {verdict} |" for cid, topic, article, _, verdict in rows]
    head, rest = text.split(BEGIN, 1)
    return head + BEGIN + "\n" + "\n".join(table) + "\n" + END + rest.split(END, 1)[1]


def readme_table(rows: list[tuple[str, str, str, str, str]]) -> None:
    """Rewrite the README's results table from ``rows`` (nothing if the README or its markers are missing)."""
    if not README.exists():
        return
    text = README.read_text()
    new = with_results_table(text, rows)
    if new != text:
        write_text(README, new)


def counted(n: Any, word: str) -> str:
    """``1 core``, ``2 cores``, ``? cores`` (unknown)."""
    if n is None:
        return f"? {word}s"
    return f"{n} {word}" + ("" if n == 1 else "s")


def engine_goal(record: dict[str, Any]) -> str:
    """The engine benchmark's goals: the stored one (against transformers and llama.cpp) and, when the record
    holds a run against vLLM, the article's goal against vLLM, so that every goal its result names is stated."""
    goal = record.get("goal", "")
    v = record.get("vs_vllm") or {}
    if "goal" in v and "vllm" not in goal.lower():
        vllm = f"against vLLM (the article's baseline): >= {v['goal']}x its useful tok/s"
        goal = f"{goal}; {vllm}" if goal else vllm
    return goal


def engine_bench_section(results_dir: Path) -> list[str]:
    """The engine benchmark (``python -m experiments.engine.bench_engine``), if it has been run: one row per system."""
    path = results_dir / "bench_engine.json"
    if not path.exists():
        return []
    r = json.loads(path.read_text())
    m, s = r["measured"], r["setup"]
    lines = ["", "## Engine benchmark: fast engine vs transformers vs reference", "",
             f"**Goal:** {engine_goal(r)}.  ", f"**Result:** {r.get('verdict', '')}. {r.get('why', '')}", "",
             "| system | useful tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | CPU ms / output token |",
             "|---|---|---|---|---|"]
    v = r.get("vs_vllm")
    if v and "median" in v:
        cpu = (f"; CPU per output token {v['cpu_over_vllm']:.2f}x vLLM's process tree" if "cpu_over_vllm" in v
               else "")
        lines.insert(-3, f"**Against vLLM** (the article's baseline, goal {v['goal']}x): fast_bf16 / vllm_bf16 "
                         f"median {v['median']:.2f}x over {v['repeats']} alternating repeats (spread "
                         f"{v['spread'][0]:.2f}-{v['spread'][1]:.2f}){cpu}: {v['verdict']}.  ")
    for other in sorted(results_dir.glob("bench_engine_run*.json")):  # earlier runs: how much the ratio moves
        run = json.loads(other.read_text())
        tok = run["measured"]["useful_tok_s"]
        ratio = run["measured"].get("fast_over_transformers")
        ov = run.get("vs_vllm") or {}
        against = (f" fast_bf16 / vllm_bf16 median {ov['median']:.2f}x over {ov['repeats']} alternating repeats "
                   f"(spread {ov['spread'][0]:.2f}-{ov['spread'][1]:.2f}): {ov['verdict']}." if "median" in ov else "")
        lines.insert(-3, f"**Other run** (`{other.name}`, {run['setup'].get('date')}, load average "
                         f"{run['setup'].get('load_average')}): " + ", ".join(f"{k} {v:.1f}" for k, v in tok.items())
                         + (f" useful tok/s ({ratio:.2f}x)." if ratio else " useful tok/s.") + against + "  ")
    for name, tok_s in m["useful_tok_s"].items():
        ttft, itl = m["ttft_ms"][name], m["itl_ms"][name]
        cpu = m.get("cpu_s_per_token", {}).get(name)
        lines.append(f"| {name} | {tok_s:.1f} | {ttft['p50']:.0f} / {ttft['p99']:.0f} | "
                     f"{itl['p50']:.0f} / {itl['p99']:.0f} | {'-' if cpu is None else f'{cpu * 1000:.2f}'} |")
    machine = s.get("machine", {})
    clock = "CPU time of each system's process" if s.get("clock") == "cpu" else "wall-clock time"
    by_batch = m.get("transformers_by_batch")
    lines += ["", f"Times are {clock}. Measured on: weights {s.get('weights')}; workload {s.get('workload')}; "
              f"{counted(s.get('threads'), 'thread')} on {machine.get('cpu', '?')} "
              f"({counted(machine.get('cores'), 'core')}, load average "
              f"{s.get('load_average')}); commit {s.get('commit')}; {s.get('date')}."
              + (f" transformers by batch size: {by_batch} useful tok/s." if by_batch else "")]
    lines += [f"\n![engine benchmark](../experiments/results/{fig})" for fig in r.get("figures", [])]
    return lines


def codec_peers_lines(results_dir: Path) -> list[str]:
    """U3's coders on whole files (``python -m experiments.unweight.bench_codec_peers``), when it was measured."""
    try:
        r = json.loads((results_dir / "bench_codec_peers.json").read_text())
        names, models = list(r["versions"]), r["models"]
        cells = [[m["coders"][n] for n in names] for m in models]
        rows = [f"| {m['weights']} | " + " | ".join(f"{c['ratio']:.4f}x, {c['decode_GBps_median']:.3g} GB/s "
                                                   f"({c['decode_vs_zipnn_median']:.2f}x)" for c in row) + " |"
                for m, row in zip(models, cells, strict=True)]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return []
    return ["", "Whole files, every coder (`experiments/unweight/bench_codec_peers.py`): each model's 2-D+ tensors "
            "as one bf16 safetensors file; ratio = that file / the compressed file; decode = one thread on one core, "
            "each model in a process of its own, compressed file (page cache) to buffers in memory, median of "
            f"{r.get('repeat', '?')} runs (x ZipNN: the same runs' time ratio); every output byte-identical. "
            f"{r.get('cpu', '?')}; commit {r.get('commit', '?')}; {r.get('date', '?')}.", "",
            "| model | " + " | ".join(n if n.startswith("ours") else f"{n} {r['versions'][n]}" for n in names) + " |",
            "|---" * (len(names) + 1) + "|", *rows]


def _serve_section(results_dir: Path) -> list[str]:
    """The HTTP server's overhead (``python -m experiments.engine.bench_serve``), when it was measured."""
    path = results_dir / "serve_overhead.json"
    try:
        r = json.loads(path.read_text())
        med, s = r["median"], r["setup"]
        rows = [(side, med[side]) for side in ("in_process", "served")]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return []
    w, m = s.get("workload", {}), s.get("machine", {})
    lines = ["", "## Serving: the HTTP layer's overhead", "",
             f"`python -m serve.bench` against `python -m serve` vs the same engine in-process, same workload "
             f"({w.get('num_prompts')} ShareGPT prompts, {w.get('max_tokens')} output tokens each, greedy, "
             f"arrivals {w.get('arrivals')}); medians of {s.get('repeats')} alternating runs.", "",
             "| | output tok/s | TTFT p50 (ms) | TTFT p90 (ms) | ITL p50 (ms) | ITL p90 (ms) | e2e p50 (ms) |",
             "|---|---|---|---|---|---|---|"]
    for side, v in rows:
        cells = [v.get(k) for k in ("output_throughput_tok_s", "ttft_ms.p50", "ttft_ms.p90", "itl_ms.p50",
                                    "itl_ms.p90", "e2e_ms.p50")]
        lines.append(f"| {side.replace('_', '-')} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells)
                     + " |")
    pairs = r.get("overhead", {}).get("median_of_pairs", {})
    if isinstance(pairs, dict) and pairs.get("engine_process_cpu_per_token_ratio") is not None:
        lines += ["", f"CPU seconds per output token of the process running the engine, served / in-process "
                  f"(median over pairs): {pairs['engine_process_cpu_per_token_ratio']:.2f}; the load generator's "
                  f"own CPU: {pairs.get('client_cpu_per_token_ms', float('nan')):.1f} ms per output token."]
    lines += ["", f"Measured on: weights {s.get('weights', '-')}; {s.get('engine', '-')} engine; "
              f"{m.get('cpu', '?')} ({counted(m.get('cores'), 'core')}"
            + (f", load average {m['load_average']} at the end, its own work included" if "load_average" in m else "")
            + f"); commit {s.get('commit', '?')}; "
              f"{s.get('date', '?')}. {s.get('note', '')}"]
    return lines


def _fleet_section(results_dir: Path) -> list[str]:
    """R1 on real processes (``python -m experiments.edge.scenario_sim``): the simulator against the real fleet."""
    try:
        r = json.loads((results_dir / "R1_fleet.json").read_text())
        s, table = r["setup"], r["measured"]["markdown"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return []
    m = s.get("machine_before", {})
    lines = ["", f"## {r.get('title', 'Tiered routing: the simulator against the real fleet')}", "",
             f"`python -m serve fleet {s.get('scenario')}` (gateway + real `python -m serve` sites, routed by "
             f"`reference.cluster.router`) against the simulator on the same scenario and arrivals. Each cell: "
             "simulated / simulated with the real fleet's measured downtime / **real** (median of "
             f"{s.get('runs')} runs) [real min-max]; times in ms.", "", table, "",
             f"Measured on: weights {s.get('weights')}; clock {s.get('clock')}; {m.get('cpu', '?')} "
             f"({counted(m.get('cores'), 'core')}, load average {m.get('load_average', '?')} at the start); commit "
             f"{s.get('commit')}; {s.get('date')}."]
    if r.get("figure"):
        lines.append(f"\n![fleet trace](../experiments/results/{r['figure']})")
    return lines


def _cluster_scale_section(results_dir: Path) -> list[str]:
    """The cluster simulator at fleet scale (``python -m experiments.edge.bench_cluster``), when it was measured."""
    path = results_dir / "bench_cluster.json"
    try:
        r = json.loads(path.read_text())
        m = r["machine"]
        how = "measured" if r.get("measured_not_projected") else "projected linearly from this run"
        lines = ["", "## Scale: the cluster simulator", "",
                 f"{r['requests']:,} requests over {r['gpus']:,} simulated GPUs ({r['replicas']} replicas, each the "
                 f"real scheduler and block manager), {r['simulated_s']} simulated seconds: {r['events']:,} events "
                 f"({r.get('queue_events', r['events']):,} taken from the queue, macro steps "
                 f"{'on' if r.get('macro_steps', False) else 'off'}) in {r['run_s']} s wall, {r['cpu_s']} s CPU: "
                 f"{r['events_per_s']:,} events/s of wall time, {r['events_per_cpu_s']:,} per CPU second. "
                 f"Time for 1,000,000 requests ({how}): {r['projected_s_for_1M_requests']} s wall, "
                 f"{r['projected_cpu_s_for_1M_requests']} s CPU; goal {r['goal_s']} s: "
                 f"{'met' if r['goal_met'] else 'not met'}.", "",
                 f"Measured on: {m.get('cpu', '?')} ({counted(m.get('cores'), 'core')}, load average "
                 f"{r.get('load_average_before', '?')} before and {r.get('load_average_after', '?')} after the run, "
                 f"its own work included); peak memory {r.get('peak_rss_mb', '?')} MB; commit {r.get('commit', '?')}; "
                 f"{r.get('date', '?')}. {r.get('note', '')}."]
        earlier = r.get("earlier_runs", [])
        if earlier:
            lines += ["", "Earlier runs of the same command: " + "; ".join(
                f"{e['run_s']} s wall, {e['cpu_s']} s CPU at {e['commit'][:7]} (load average "
                f"{e['load_average_before']} -> {e['load_average_after']}, event-log hash {e['event_log_hash'][:8]})"
                for e in earlier) + f". {r.get('earlier_runs_note', '')}."]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return []
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
