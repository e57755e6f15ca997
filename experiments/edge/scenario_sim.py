"""R1 on real processes: the same scenario and the same arrivals through the simulator and the real fleet.

    python -m experiments.edge.scenario_sim [--runs 3] [--scenario reference/cluster/examples/fleet_small.toml]
                                    [--seed 1] [--json experiments/results/R1_fleet.json]

1. *Arrivals.* The simulator draws the scenario's requests (traffic classes, Poisson arrivals, ShareGPT
   lengths, random token ids) from its seeded RNG; they are recorded as it routes them.
2. *Calibration, as E5 does.* The tiny model the fleet's servers run is profiled in this process, on the
   reference engine with the servers' scheduler settings: E5's profiling sweep (``cluster_fidelity``'s
   scenes, plus a few longer prompts that this scenario's 256-token step budget allows) and a
   ``StepTimeModel`` fitted on those steps alone (E5's model form). The simulator prices every step with it.
3. *Simulated.* The scenario (its site failure included) runs in the simulator with that cost model and
   the servers' KV size.
4. *Real.* ``--runs`` times, a fresh fleet (``serve.fleet.Fleet``: a ``python -m serve`` process per site,
   the gateway with the scenario's network delays added) gets the very same requests at their arrival
   times (streamed completions over token ids, ``ignore_eos``), the failed site's processes are killed at
   the failure's time and restarted at its end; the gateway's trace gives each request's tier, site, TTFT
   and token times.

Reported side by side: per-tier shares, outcomes and residency violations, and TTFT / ITL p50/p90/p99 per
tier; the real columns are the median over the runs with their range (the run-to-run spread). Wall clock on
a shared machine: the load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from experiments.edge.cluster_fidelity import FORM, fit, run_sweep_stepwise, sweep_jobs
from experiments.engine.stats import Job
from reference.cluster.scenario import TIERS, Scenario, load_scenario
from reference.cluster.simulator import Simulator
from reference.safe_write import write_text

RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT_SCENARIO = Path(__file__).resolve().parents[2] / "reference/cluster/examples/fleet_small.toml"
NUM_BLOCKS = 256  # KV blocks of every server (the simulator's replicas get as many)
PS = (50, 90, 99)


class Recorded(Simulator):
    """The simulator, keeping each request's first arrival (to replay on the real fleet) and how it ended."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, record_gaps=True, **kwargs)
        self.arrivals: dict[int, tuple[int, float, list[int], int]] = {}
        self.finished: list[Any] = []

    def _route(self, r: Any) -> None:
        self.arrivals.setdefault(r.rid, (r.traffic, r.arrival, list(r.prompt), r.output_len))
        super()._route(r)

    def _done(self, r: Any, outcome: str) -> None:
        super()._done(r, outcome)
        self.finished.append(r)


def calibrate(s: Scenario, workdir: Path) -> Any:
    """E5's method on the tiny model: the profiling sweep on the engine the servers run, a fit on its steps."""
    from reference.engine.engine import Engine
    from reference.model.llama import LlamaModel
    from reference.model.tokenizer import load_tokenizer
    from reference.sched import Tenants
    from serve.fleet.tiny import write_tiny_checkpoint

    folder = write_tiny_checkpoint(workdir / "tiny")
    engine = Engine(LlamaModel.load(str(folder)), load_tokenizer(str(folder)), num_blocks=NUM_BLOCKS,
                    block_size=s.block_size, max_num_seqs=s.max_num_seqs,
                    max_num_batched_tokens=s.max_num_batched_tokens, policy=s.policy, tenants=Tenants.open())
    rng = np.random.default_rng(7)
    longer = [[Job([int(x) for x in rng.integers(1, 30000, n)], out) for n in prompts]
              for prompts, out in [((256,), 4), ((200,), 4), ((160, 96), 4), ((256, 128), 4), ((144,) * 3, 6),
                                   ((32,) * 8, 12), ((16,) * 12, 12)]]
    steps = run_sweep_stepwise(engine, [*sweep_jobs(), *longer])
    for _ in steps:
        pass
    log = engine.step_log[1:]  # the first step warms caches up
    return fit(log, FORM), len(log)


def per_tier(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """rows: {tier, outcome, ttft (s), gaps (s)} -> per tier: share of done requests, TTFT and ITL percentiles (ms)."""
    done = [r for r in rows if r["outcome"] == "done"]
    out: dict[str, Any] = {"requests": len(rows), "outcomes": dict(Counter(r["outcome"] for r in rows))}
    for tier in TIERS:
        mine = [r for r in done if r["tier"] == tier]
        ttft = [r["ttft"] * 1e3 for r in mine]
        gaps = [g * 1e3 for r in mine for g in r["gaps"]]
        out[tier] = {"share": round(len(mine) / max(len(done), 1), 4), "n": len(mine),
                     "ttft_ms": {f"p{p}": round(float(np.percentile(ttft, p)), 2) if ttft else None for p in PS},
                     "itl_ms": {f"p{p}": round(float(np.percentile(gaps, p)), 2) if gaps else None for p in PS}}
    return out


def simulated(s: Scenario, seed: int, cost: Any) -> tuple[dict[str, Any], Recorded]:
    sim = Recorded(s, seed, cost_override=cost, num_blocks=NUM_BLOCKS)
    result = sim.run()
    rows = [{"tier": r.decision.prefill.tier if r.outcome == "done" else None, "outcome": r.outcome,
             "ttft": (r.first_token - r.arrival) if r.outcome == "done" else None, "gaps": list(r.gaps),
             "site": r.decision.prefill.site if r.outcome == "done" else None, "arrival": r.arrival,
             "traffic": r.traffic, "spilled": "overloaded" in r.reason} for r in sim.finished]
    stats = per_tier(rows)
    stats["residency_violations"] = len(result.violations)
    stats["spilled"] = sum(r["spilled"] for r in rows)
    stats["wait_model"] = {rep.site: {"prefill_ms_per_token": round(rep._tok_s * 1e3, 4),
                                      "decode_step_ms": round(rep._decode_s * 1e3, 3)} for rep in sim.replicas}
    return {"stats": stats, "rows": rows}, sim


async def drive(url: str, s: Scenario, arrivals: dict[int, tuple[int, float, list[int], int]],
                fleet: Any) -> list[float]:
    """Send every recorded request at its arrival time; kill and restart failed sites on the scenario's clock.
    Returns each failure's real downtime: from the kill until the restarted servers serve again."""
    t0 = time.monotonic()
    fleet.gateway.t0 = t0

    async def one(client: httpx.AsyncClient, k: int, at: float, prompt: list[int], n: int) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        body = {"model": "auto", "prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True,
                "temperature": 0}
        try:
            async with client.stream("POST", url + "/v1/completions", json=body,
                                     headers={"Authorization": f"Bearer {s.traffic[k].name}"}) as resp:
                async for _ in resp.aiter_lines():
                    pass
        except httpx.HTTPError:
            pass  # the gateway's trace has the outcome

    async def failure(f: Any) -> float:
        await asyncio.sleep(max(0.0, t0 + f.at_s - time.monotonic()))
        await asyncio.to_thread(fleet.sites.kill_site, f.site)
        killed = time.monotonic()
        await asyncio.sleep(max(0.0, t0 + f.at_s + f.duration_s - time.monotonic()))
        await asyncio.to_thread(fleet.sites.restart_site, f.site)
        reps = [r for r in fleet.replicas if r.site == f.site]
        while not all(r.alive for r in reps):  # the gateway's poller sees it up
            await asyncio.sleep(0.05)
        return time.monotonic() - killed

    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0),
                                 limits=httpx.Limits(max_connections=512)) as client:
        done = await asyncio.gather(*(failure(f) for f in s.failures), *(one(client, *a) for a in arrivals.values()))
    return [round(d, 3) for d in done[:len(s.failures)]]


def real_run(s: Scenario, arrivals: dict, workdir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from serve.fleet import Fleet

    trace = io.StringIO()
    fleet = Fleet(s, workdir=workdir, trace=trace, delays=True, poll_s=0.25, num_blocks=NUM_BLOCKS)
    try:
        fleet.start_sites()
        url = fleet.serve(in_thread=True)
        downtime = asyncio.run(drive(url, s, arrivals, fleet))
        time.sleep(0.5)
        wait_model = {v["site"]: {"prefill_ms_per_token": v["tok_ms"], "decode_step_ms": v["decode_step_ms"]}
                      for v in fleet.gateway.view()["servers"]}
        wait_model["downtime_s"] = downtime
    finally:
        fleet.stop()
    records = [json.loads(line) for line in trace.getvalue().splitlines()]
    jur = {name: site.jurisdiction for name, site in s.sites.items()}
    rows = []
    for r in records:
        times = [t / 1e3 for t in r["token_times_ms"]]
        rows.append({"tier": r["tier"], "outcome": r["outcome"], "site": r["prefill_site"],
                     "ttft": r["ttft_ms"] / 1e3 if r["ttft_ms"] is not None else None,
                     "gaps": list(np.diff(times)) if len(times) > 1 else [], "arrival": r["arrival_s"],
                     "tenant": r["tenant"], "retries": r["retries"], "spilled": "overloaded" in r["reason"],
                     "violation": any(jur[v] not in r["allowed"] for v in r["visited"])})
    return rows, wait_model


def spread(values: list[float | None]) -> dict[str, float | None]:
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None}
    return {"median": round(float(np.median(v)), 2), "min": round(min(v), 2), "max": round(max(v), 2)}


def compare(sim: dict[str, Any], runs: list[dict[str, Any]], sim_real: dict[str, Any]) -> dict[str, Any]:
    """Per tier and metric: the simulator on the scenario, the simulator with the real downtime, the real runs."""
    table: dict[str, Any] = {}
    for tier in TIERS:
        row: dict[str, Any] = {"share": {"sim": sim[tier]["share"], "sim_real_downtime": sim_real[tier]["share"],
                                         "real": spread([r[tier]["share"] for r in runs])}}
        for metric in ("ttft_ms", "itl_ms"):
            for p in PS:
                key = f"p{p}"
                row[f"{metric[:-3]}_{key}_ms"] = {"sim": sim[tier][metric][key],
                                                  "sim_real_downtime": sim_real[tier][metric][key],
                                                  "real": spread([r[tier][metric][key] for r in runs])}
        table[tier] = row
    return table


def markdown(table: dict[str, Any]) -> str:
    def cell(c: dict[str, Any], pct: bool = False) -> str:
        if c["sim"] is None and c["real"]["median"] is None:
            return "-"
        f = (lambda x: "-" if x is None else f"{x:.0%}") if pct else (lambda x: "-" if x is None else f"{x:.0f}")
        r = c["real"]
        return f"{f(c['sim'])} / {f(c['sim_real_downtime'])} / **{f(r['median'])}** [{f(r['min'])}-{f(r['max'])}]"

    lines = ["| tier | share | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | ITL p99 |",
             "|---|---|---|---|---|---|---|---|"]
    for tier, row in table.items():
        if not row["share"]["sim"] and not row["share"]["sim_real_downtime"] and not row["share"]["real"]["max"]:
            continue
        cells = [cell(row["share"], pct=True)] + [cell(row[f"{m}_p{p}_ms"]) for m in ("ttft", "itl") for p in PS]
        lines.append(f"| {tier} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(sim_rows: list[dict], real_rows: list[dict], s: Scenario, downtime: list[float], path: Path) -> None:
    """Requests per site and tier over arrival time: the simulator and the first real run, failures shaded."""
    from experiments.registry import pyplot

    plt = pyplot()
    sites = list(s.sites)
    colors = {"edge": "tab:green", "regional": "tab:blue", "central": "tab:purple"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    panels = ((axes[0], sim_rows, "simulated", [f.duration_s for f in s.failures]),
              (axes[1], real_rows, "real fleet (run 1)", downtime))
    for ax, rows, title, downs in panels:
        for f, down in zip(s.failures, downs, strict=True):
            ax.axvspan(f.at_s, f.at_s + down, color="red", alpha=0.08)
            ax.text(f.at_s + 0.05, -0.9, f"{f.site} down {down:.1f} s", fontsize=7, color="red")
        for tier, color in colors.items():
            mine = [r for r in rows if r["outcome"] == "done" and r["tier"] == tier]
            ax.scatter([r["arrival"] for r in mine], [sites.index(r["site"]) for r in mine], s=14, color=color,
                       label=tier, alpha=0.8)
        other = [r for r in rows if r["outcome"] != "done"]
        ax.scatter([r["arrival"] for r in other], [sites.index(r["site"]) if r["site"] else -0.5 for r in other],
                   marker="x", color="black", s=24, label="not done (refused / cut by the failure)")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("arrival (s)")
    axes[0].set_yticks(range(len(sites)), [f"{n} ({s.sites[n].tier}, {s.sites[n].jurisdiction})" for n in sites],
                       fontsize=8)
    axes[0].set_ylim(-1.1, len(sites) - 0.4)
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4)
    fig.suptitle(f"Requests per site and tier over time ({path.stem}: same scenario, same arrivals)", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    from reference.provenance import commit, machine, now

    p = argparse.ArgumentParser(prog="python -m experiments.edge.scenario_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", type=Path, default=DEFAULT_SCENARIO, help="the fleet scenario (TOML)")
    p.add_argument("--runs", type=int, default=3, help="real-fleet runs of the same arrivals (for the spread)")
    p.add_argument("--seed", type=int, default=1, help="seed of the arrivals")
    p.add_argument("--json", type=Path, default=RESULTS / "R1_fleet.json", help="where the results go")
    p.add_argument("--figure", type=Path, default=None, help="default: beside --json, .png")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = {"commit": commit(), "date": now(), "machine_before": machine()}
    s = load_scenario(args.scenario)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="unfire-fleet-sim-") as tmp:
        work = Path(tmp)
        cost, n_steps = calibrate(s, work)
        sim, recorded = simulated(s, args.seed, cost)
        real = [real_run(s, recorded.arrivals, work / f"run{i}") for i in range(args.runs)]
    real_rows = [rows for rows, _ in real]
    runs = []
    for rows, wait_model in real:
        stats = per_tier(rows)
        stats["spilled"] = sum(r["spilled"] for r in rows)
        stats["wait_model"] = wait_model
        stats["residency_violations"] = sum(r["violation"] for r in rows)
        stats["retries"] = sum(r["retries"] for r in rows)
        runs.append(stats)
    # the same arrivals again, with each failure lasting as long as it really did (a restart takes seconds)
    downtime = [float(np.median([r["wait_model"]["downtime_s"][i] for r in runs])) for i in range(len(s.failures))]
    s_real = replace(s, failures=tuple(replace(f, duration_s=d) for f, d in zip(s.failures, downtime, strict=True)))
    sim_real, _ = simulated(s_real, args.seed, cost)
    table = compare(sim["stats"], runs, sim_real["stats"])
    md = markdown(table)
    figure_path = args.figure or args.json.with_suffix(".png")
    figure(sim["rows"], real_rows[0], s, runs[0]["wait_model"]["downtime_s"], figure_path)
    result = {
        "claim": "R1", "title": "Tiered routing: the simulator against the real fleet (same scenario, same arrivals)",
        "setup": {**started, "machine_after": machine(), "scenario": str(args.scenario.name), "seed": args.seed,
                  "runs": args.runs, "weights": "tiny (2 layers, hidden 64, random; SmolLM2 tokenizer) at every site",
                  "servers": f"one python -m serve (reference engine, 1 BLAS thread) per site, {NUM_BLOCKS} KV blocks, "
                             f"max_num_seqs {s.max_num_seqs}, max_num_batched_tokens {s.max_num_batched_tokens}",
                  "calibration": f"E5's profiling sweep + 7 longer scenes on the tiny model in-process, {n_steps} "
                                 f"steps, StepTimeModel form {FORM}",
                  "delays": "the scenario's access and path delays added by the gateway (real) / modelled (sim)",
                  "clock": "wall (the servers' and gateway's monotonic clocks) for real; simulated for the simulator",
                  "seconds": round(time.perf_counter() - t_start, 1)},
        "measured": {"table": table, "simulated": sim["stats"], "simulated_real_downtime": sim_real["stats"],
                     "real_downtime_s": downtime, "real_runs": runs, "markdown": md},
        "figure": figure_path.name,
    }
    write_text(args.json, json.dumps(result, indent=1) + "\n")
    print(md)
    print(f"real downtime {downtime} s; sim with it: {sim_real['stats']['outcomes']}")
    print(f"sim outcomes {sim['stats']['outcomes']}, violations {sim['stats']['residency_violations']}, "
          f"spilled {sim['stats']['spilled']}, wait model {sim['stats']['wait_model']}")
    for r in runs:
        print(f"real: {r['outcomes']} violations {r['residency_violations']} spilled {r['spilled']} "
              f"retries {r['retries']}, wait model {r['wait_model']}")


if __name__ == "__main__":
    main()
