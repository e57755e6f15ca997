"""R4: TTFT and GPU utilization by infrastructure: one central cloud region, three regions, edge PoPs.

The same 24 H100s serving a Llama-8B-shaped model and the same traffic (Poisson, ShareGPT lengths)
from 8 metros around the world, placed three ways: all in one central region (us-east); 8 in each of
three regions (us-east, eu-central, asia-east), users sent to the nearest; 3 in each metro's edge
PoP, with spill to other PoPs when the local one is busy. Round trips are typical public-internet
figures between those places (below); every user also has a 20 ms last mile. TTFT is measured at the
user: request up, queueing and prefill, first token down.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.edge.common import ASSUMPTIONS, SHARED_MACHINE, link, scenario, site
from experiments.registry import Context, Experiment, Result, pyplot, save_figure
from reference.cluster import scenario_from_dict, simulate
from reference.cluster.lengths import sharegpt_lengths

METROS = ["us-east", "us-west", "eu-west", "eu-central", "asia-east", "asia-south", "sa-east", "oceania"]
# RTT (ms) from each metro to the central region (us-east) and to its nearest of three regions
RTT_CENTRAL = {"us-east": 12, "us-west": 65, "eu-west": 75, "eu-central": 90, "asia-east": 170, "asia-south": 210,
               "sa-east": 115, "oceania": 195}
NEAREST = {"us-east": ("us-east", 12), "us-west": ("us-east", 65), "eu-west": ("eu-central", 20),
           "eu-central": ("eu-central", 12), "asia-east": ("asia-east", 12), "asia-south": ("asia-east", 75),
           "sa-east": ("us-east", 115), "oceania": ("asia-east", 110)}
GPUS_TOTAL = 24
ACCESS_RTT_MS = 20.0
ARTICLE = {"central": ("350-800 ms", "45-60%"), "multi-region": ("150-400 ms", "55-70%"),
           "edge": ("80-200 ms", "75-85%")}


def fleet(kind: str, rate_per_metro: float, duration_s: float) -> dict[str, Any]:
    model = {"model": "llama-8b", "gpu": "H100"}
    sites, links = [], []
    if kind == "edge":
        for m in METROS:
            sites.append(site(m, "edge", "W", [{**model, "count": GPUS_TOTAL // len(METROS)}]))
        for i, a in enumerate(METROS):  # PoP to PoP: via the regions' backbone, roughly
            for b in METROS[i + 1:]:
                ra, rb = NEAREST[a], NEAREST[b]
                links.append(link(a, b, rtt_ms=ra[1] + rb[1] + (0 if ra[0] == rb[0] else 90)))
    else:
        regions = ["us-east"] if kind == "central" else ["us-east", "eu-central", "asia-east"]
        for r in regions:
            sites.append(site(f"dc-{r}", "central" if kind == "central" else "regional", "W",
                              [{**model, "count": GPUS_TOTAL // len(regions)}]))
        for m in METROS:
            sites.append(site(m, "edge", "W", []))  # where users enter; no GPUs
            target, rtt = ("us-east", RTT_CENTRAL[m]) if kind == "central" else NEAREST[m]
            links.append(link(m, f"dc-{target}", rtt_ms=rtt))
        for i, a in enumerate(regions):
            for b in regions[i + 1:]:
                links.append(link(f"dc-{a}", f"dc-{b}", rtt_ms=150))
    traffic = [{"name": m, "origins": [m], "rate_per_s": rate_per_metro, "models": ["llama-8b"], "allowed": ["W"],
                "max_prompt": 1024, "max_output": 256, "output_scale": 0.5, "access_rtt_ms": ACCESS_RTT_MS}
               for m in METROS]
    return scenario(sites, links, traffic, duration_s=duration_s, models=("llama-8b",),
                    spill_wait_ms={"edge": 100.0, "regional": 200.0})


def run(ctx: Context) -> Result:
    duration = 20.0 if ctx.full else 5.0
    rate = 25.0  # requests/s per metro
    lengths = sharegpt_lengths()
    rows: dict[str, dict[str, Any]] = {}
    for kind in ctx.track(["central", "multi-region", "edge"], "R4 infrastructures"):
        s = simulate(scenario_from_dict(fleet(kind, rate, duration)), seed=4, lengths=lengths).summary()
        rows[kind] = {"ttft_ms": s["ttft_ms"], "e2e_ms": s["e2e_ms"], "tpot_ms": s["tpot_ms"],
                      "gpu_busy_share": s["utilization"]["all"]["busy_share"],
                      "compute_utilization": s["utilization"]["all"]["compute_utilization"],
                      "requests": s["requests"], "refused": s["refused"], "event_log_hash": s["event_log_hash"]}
    figure = plot(rows, ctx)
    p50 = {k: v["ttft_ms"]["p50"] for k, v in rows.items()}
    order_ok = p50["edge"] < p50["multi-region"] < p50["central"]
    in_range = {k: _within(rows[k]["ttft_ms"]["p50"], ARTICLE[k][0]) for k in rows}
    table = ["| infrastructure | TTFT p50 / p90 / p99 (ms) | article TTFT | GPU busy | article utilization |",
             "|---|---|---|---|---|"]
    for k, v in rows.items():
        t = v["ttft_ms"]
        table.append(f"| {k} | {t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | {ARTICLE[k][0]} | "
                     f"{v['gpu_busy_share']:.0%} | {ARTICLE[k][1]} |")
    verdict = "matches" if order_ok and all(in_range.values()) else ("partly matches" if order_ok else "differs")
    measured = {"infrastructures": rows, "ttft_p50_in_article_range": in_range, "order_edge_lt_multi_lt_central":
                order_ok, "rate_per_metro": rate}
    return Result(
        measured=measured, summary=summarize({"measured": measured}), verdict=verdict,
        why=(f"Order edge < multi-region < central {'holds' if order_ok else 'does not hold'}; p50 TTFT inside the "
             f"article's range: {', '.join(k for k, v in in_range.items() if v) or 'none'}. Our TTFT is network round "
             "trips + queueing + prefill only (no TLS/HTTP set-up, no cold starts, no tokenisation), so it sits "
             "below the article's ranges. GPU busy share with the same GPUs and load: "
             + ", ".join(f"{k} {v['gpu_busy_share']:.0%}" for k, v in rows.items())
             + ". The router packs a pool's load onto its least-loaded replicas, so a big central pool runs big "
             "batches and is busy less of the time, while small edge pools keep each GPU busier: the order matches "
             "the article's, the levels depend on the offered load."),
        setup={"weights": "none (simulated; Llama-8B shape)",
               "workload": (f"8 metros x {rate:g} requests/s, Poisson, {duration:g} s; ShareGPT lengths (SmolLM2 "
                            "tokenizer; prompts <= 1024, answers x0.5 <= 256); 20 ms last mile"),
               "fleet": f"{GPUS_TOTAL} H100 (1 GPU per replica) in each layout; RTTs {RTT_CENTRAL} (to us-east)",
               "assumptions": ASSUMPTIONS, "time": SHARED_MACHINE},
        article={"ttft": "single-region cloud 350-800 ms, multi-region 150-400 ms, edge 80-200 ms",
                 "utilization": "45-60% / 55-70% / 75-85%"},
        clock="simulated",
        clock_detail="roofline step costs on datasheet peaks; network delays from the stated RTTs",
        figures=[figure], tables=["\n".join(table)],
    )


def summarize(record: dict[str, Any]) -> str:
    """The table cell from an R4 record. Our TTFT leaves out what the article's includes beyond the network and
    the GPU (TLS/HTTP set-up, cold starts, tokenisation), so the comparable figure is the order of the three."""
    m = record["measured"]
    rows = m["infrastructures"]
    cells = "; ".join(f"{k} TTFT p50 {v['ttft_ms']['p50']:.0f} ms (p90 {v['ttft_ms']['p90']:.0f}), busy "
                      f"{v['gpu_busy_share']:.0%}" for k, v in rows.items())
    order = "holds" if m["order_edge_lt_multi_lt_central"] else "does NOT hold"
    return (f"cluster simulator, {GPUS_TOTAL} H100s placed three ways: {cells}; the article's order edge < "
            f"multi-region < central {order}; our TTFT is round trips + queueing + prefill only (no TLS/HTTP set-up, "
            "cold starts or tokenisation), so its levels sit below the article's ranges")


def _within(value: float, text: str) -> bool:
    lo, hi = (float(x) for x in text.split()[0].split("-"))
    return lo <= value <= hi


def plot(rows: dict[str, dict[str, Any]], ctx: Context) -> str:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    kinds = list(rows)
    x = np.arange(len(kinds))
    for k, p in enumerate(("p50", "p90", "p99")):
        axes[0].bar(x + (k - 1) * 0.27, [rows[i]["ttft_ms"][p] for i in kinds], 0.27, label=p)
    for i, kind in enumerate(kinds):
        lo, hi = (float(v) for v in ARTICLE[kind][0].split()[0].split("-"))
        axes[0].plot([i - 0.45, i + 0.45], [lo, lo], "k--", lw=0.8)
        axes[0].plot([i - 0.45, i + 0.45], [hi, hi], "k--", lw=0.8)
    axes[0].set_xticks(x, kinds)
    axes[0].set_ylabel("TTFT at the user (ms); dashed: article's range")
    axes[0].legend(fontsize=8)
    axes[1].bar(kinds, [rows[i]["gpu_busy_share"] for i in kinds])
    axes[1].set_ylabel("GPU busy share")
    return save_figure(fig, ctx, "R4.png")


EXPERIMENT = Experiment(claim="R4", title="TTFT and utilization by infrastructure", run=run, quick_minutes=0.25,
                        summarize=summarize, timed=False)
