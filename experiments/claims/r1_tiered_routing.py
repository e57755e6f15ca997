"""R1: tiered routing: what share of requests ends at the edge, and where a figure like ~60% comes from.

A fleet of metros, each with an edge PoP of L4 GPUs holding a Llama-1B-shaped model, two regional
sites of H100s holding Llama-8B, and a central site holding Llama-70B on 4 H100s per replica.
Requests are ShareGPT-sized; each metro's traffic is a mix of "simple" requests (any model will
do, the small one preferred), "medium" ones (8B or larger) and "complex" ones (70B only). The
router tries the edge first and spills to the next tier on load (estimated wait over the tier's
threshold) or model absence. Varied: L4s per edge PoP and the share of simple requests. Measured:
the share of requests whose prompt was served at each tier, TTFT, and the edge's utilization.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.edge.common import ASSUMPTIONS, SHARED_MACHINE, link, scenario, site
from experiments.registry import Context, Experiment, Result, pyplot, save_figure
from reference.cluster import scenario_from_dict, simulate
from reference.cluster.lengths import sharegpt_lengths

METROS = 4
RATE_PER_METRO = 80.0  # requests/s


def fleet(edge_gpus: int, simple_share: float, duration_s: float) -> dict[str, Any]:
    sites, links, traffic = [], [], []
    for m in range(METROS):
        jur = "EU" if m % 2 == 0 else "US"
        sites.append(site(f"m{m}-edge", "edge", jur, [{"model": "llama-1b", "gpu": "L4", "count": edge_gpus}]))
        links.append(link(f"m{m}-edge", f"r{m % 2}", rtt_ms=20))
        shares = {"simple": simple_share, "medium": (1 - simple_share) * 2 / 3, "complex": (1 - simple_share) / 3}
        models = {"simple": ["llama-1b", "llama-8b", "llama-70b"], "medium": ["llama-8b", "llama-70b"],
                  "complex": ["llama-70b"]}
        for kind, share in shares.items():
            if share > 0:
                traffic.append({"name": f"m{m}-{kind}", "origins": [f"m{m}-edge"], "rate_per_s": RATE_PER_METRO * share,
                                "models": models[kind], "allowed": ["EU", "US"], "max_prompt": 1024,
                                "max_output": 256, "output_scale": 0.5, "access_rtt_ms": 10})
    for r in range(2):
        sites.append(site(f"r{r}", "regional", "EU" if r == 0 else "US",
                          [{"model": "llama-8b", "gpu": "H100", "count": 2}]))
        links.append(link(f"r{r}", "central", rtt_ms=40))
    sites.append(site("central", "central", "US", [{"model": "llama-70b", "gpu": "H100", "gpus": 4, "count": 2}]))
    return scenario(sites, links, traffic, duration_s=duration_s, spill_wait_ms={"edge": 100.0, "regional": 200.0})


def run(ctx: Context) -> Result:
    duration = 15.0 if ctx.full else 3.0
    edge_gpus = [1, 2, 3, 4] if ctx.full else [1, 2, 4]
    shares = [0.4, 0.5, 0.6, 0.7, 0.8, 0.9] if ctx.full else [0.4, 0.6, 0.8]
    lengths = sharegpt_lengths()
    grid: list[dict[str, Any]] = []
    for e, p in ctx.track([(e, p) for e in edge_gpus for p in shares], "R1 edge capacity x model mix"):
        r = simulate(scenario_from_dict(fleet(e, p, duration)), seed=1, lengths=lengths)
        s = r.summary()
        edge_util = next((v["busy_share"] for k, v in s["utilization"].items() if k == "colocated"), None)
        grid.append({"edge_gpus_per_pop": e, "simple_share": p, "tier_share": s["tier_share"],
                     "edge_share": s["tier_share"].get("edge", 0.0), "ttft_ms": s["ttft_ms"],
                     "requests": s["requests"], "refused": s["refused"], "fleet_busy_share": edge_util,
                     "events": s["events"], "event_log_hash": s["event_log_hash"]})
    near = min(grid, key=lambda g: abs(g["edge_share"] - 0.6))
    figure = plot(grid, edge_gpus, shares, ctx)
    capped = [g for g in grid if g["edge_share"] < g["simple_share"] - 0.05]
    return Result(
        measured={"grid": grid, "closest_to_60_percent": near},
        summary=(f"edge share {min(g['edge_share'] for g in grid):.0%}-{max(g['edge_share'] for g in grid):.0%} over "
                 f"{len(edge_gpus)} edge sizes x {len(shares)} mixes; ~60% ({near['edge_share']:.0%}) at "
                 f"{near['edge_gpus_per_pop']} L4/PoP and {near['simple_share']:.0%} simple requests"),
        verdict="matches (as a function of mix and capacity)",
        why=("The edge share is not a constant: it is the share of requests a small model may serve, capped by what "
             f"the edge can take before its estimated wait passes the spill threshold ({len(capped)} of "
             f"{len(grid)} settings are capacity-capped). ~60% appears where the simple share is ~60-70% and the "
             "edge has room for it, as in the article's mix; with other mixes or thinner PoPs the figure moves."),
        setup={"weights": "none (simulated; Llama 1B/8B/70B shapes)",
               "workload": (f"{METROS} metros x {RATE_PER_METRO:g} requests/s, Poisson, {duration:g} s; "
                            "ShareGPT lengths (SmolLM2 tokenizer; prompts <= 1024, answers x0.5 <= 256); "
                            "simple/medium/complex mix"),
               "fleet": ("per metro an edge PoP of 1-4 L4 (Llama-1B); 2 regional sites x 2 H100 (Llama-8B); central "
                         "2 x 4 H100 (Llama-70B); RTT user-PoP 10 ms, PoP-regional 20 ms, regional-central 40 ms; "
                         "spill at 100 ms (edge) / 200 ms (regional) estimated wait"),
               "assumptions": ASSUMPTIONS, "time": SHARED_MACHINE},
        article={"claim": "~60% of requests end at the edge"},
        clock="simulated",
        clock_detail="roofline step costs on datasheet peaks; network delays from the scenario's RTTs",
        figures=[figure],
    )


def plot(grid: list[dict[str, Any]], edge_gpus: list[int], shares: list[float], ctx: Context) -> str:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for e in edge_gpus:
        rows = [g for g in grid if g["edge_gpus_per_pop"] == e]
        axes[0].plot([g["simple_share"] for g in rows], [g["edge_share"] for g in rows], "o-", label=f"{e} L4 per PoP")
    axes[0].plot([0.4, 1], [0.4, 1], "k:", lw=1, label="edge share = simple share")
    axes[0].axhline(0.6, color="grey", lw=0.8, ls="--")
    axes[0].set_xlabel("share of requests a small model may serve")
    axes[0].set_ylabel("share of requests served at the edge")
    axes[0].legend(fontsize=8)
    x = np.arange(len(grid))
    bottom = np.zeros(len(grid))
    for tier in ("edge", "regional", "central"):
        v = np.array([g["tier_share"].get(tier, 0.0) for g in grid])
        axes[1].bar(x, v, bottom=bottom, label=tier)
        bottom += v
    axes[1].set_xticks(x, [f"{g['edge_gpus_per_pop']}/{g['simple_share']:.0%}" for g in grid], fontsize=7)
    axes[1].set_xlabel("L4 per PoP / simple share")
    axes[1].legend(fontsize=8)
    return save_figure(fig, ctx, "R1.png")


EXPERIMENT = Experiment(claim="R1", title="Tiered edge / regional / central routing", run=run, quick_minutes=0.25,
                        timed=False)
