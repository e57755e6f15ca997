"""E4's regime study: where disaggregation cuts the p90 inter-token latency, in simulated time.

Not an experiment itself (``claims/e4_disagg.py`` runs it). Every point is a run of the cluster
simulator (``reference.cluster``: each GPU is the engine's own scheduler and block manager, steps
priced by the roofline of ``reference/engine/cost.py`` on an H100, Llama-3.1-8B shapes, KV handed over
at 400 Gbit/s) at equal GPU counts, two setups:

* colocated: N replicas, each at one chunk budget of BUDGETS (tokens per step; "unchunked" is more
  than any prompt), prompts and decodes in the same steps;
* disaggregated: P prefill + (N - P) decode replicas for every P of 1..N-1 (DistServe's search over
  the P:D ratio), budget DISAGG_BUDGET.

Workloads (WORKLOADS): ShareGPT chat; RAG-like prompts (a 2K, 4K or 8K-token document plus a ShareGPT
question) without prefix reuse and, for 4K, with it (a pool of 8 documents in the prefix cache); and a
mix of chat and 4K RAG. Arrival rates are shares of an estimated capacity (``capacity_per_gpu``: one
GPU's requests/s if it did nothing but this workload's prefills and decodes back to back), from light to
saturation. At each point each setup's configurations run on the same seeded arrivals.

VERDICT_RULE (written before the sweep was first run) says how a point's cut is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from experiments.edge.common import scenario, site
from reference.cluster import scenario_from_dict
from reference.cluster.costs import RooflineCost
from reference.cluster.lengths import sharegpt_lengths
from reference.cluster.report import SimResult, percentiles
from reference.cluster.simulator import Simulator
from reference.engine.cost import StepShape

BUDGETS = {"256": 256, "512": 512, "1024": 1024, "2048": 2048, "8192": 8192, "unchunked": 16384}
DISAGG_BUDGET = 8192
MAX_OUTPUT = 512
QUESTION_MAX = 256  # a RAG question: a ShareGPT prompt truncated to this
SLOS = {"ttft2s_itl50ms": {"ttft_s": 2.0, "itl_p90_s": 0.050},  # interactive chat
        "ttft500ms_itl25ms": {"ttft_s": 0.5, "itl_p90_s": 0.025}}  # tight on both
TTFT_SLO = "ttft2s_itl50ms"  # the SLO whose TTFT bound picks each setup's best configuration
CUT_REGIME = 3.0

VERDICT_RULE = (
    "At each point (GPU count, workload, load) each setup's best configuration is the one with the lowest p90 "
    "ITL among those whose TTFT p90 is within 2 s; if none is, the one with the lowest TTFT p90, and the point "
    "is marked as breaking the TTFT SLO for that setup. The cut is colocated's best p90 ITL over "
    "disaggregated's best. The regime is every point with a cut >= 3 where disaggregated meets the TTFT SLO. "
    "The claim's verdict: 'matches' when the regime is not empty and the real-process configuration the "
    "simulator puts inside it cuts p90 ITL >= 3x in every repeat; 'inconclusive' when that cut's spread over "
    "the repeats straddles 3; 'partly matches' when the regime is not empty but the real cut stays below 3 in "
    "every repeat; 'differs' when no point of the sweep is in the regime (the closest point is named).")


@dataclass(frozen=True)
class Workload:
    name: str
    doc_tokens: int = 0  # a document in front of a question (RAG); 0: a chat prompt
    reuse: bool = False  # the documents come from a small pool and are cached (prefix reuse)
    mix: bool = False  # half chat, half RAG

    def lengths(self) -> np.ndarray:
        """(prompt tokens, answer tokens) rows the simulator draws from (without a reused document)."""
        base = sharegpt_lengths()
        if self.doc_tokens == 0 or self.reuse:
            return base if self.doc_tokens == 0 else np.stack([np.minimum(base[:, 0], QUESTION_MAX), base[:, 1]], 1)
        rag = np.stack([self.doc_tokens + np.minimum(base[:, 0], QUESTION_MAX), base[:, 1]], 1)
        if not self.mix:
            return rag
        rows = np.concatenate([base[::2], rag[1::2]])
        return rows[np.random.default_rng(0).permutation(len(rows))]

    def traffic(self, rate: float) -> dict[str, Any]:
        t = {"name": self.name, "origins": ["dc"], "rate_per_s": rate, "models": ["llama-8b"], "allowed": ["W"],
             "max_prompt": 8192 + QUESTION_MAX, "max_output": MAX_OUTPUT}
        if self.reuse:
            t.update(max_prompt=QUESTION_MAX, system_prompts=8, system_prompt_tokens=self.doc_tokens)
        return t

    def uncached_prompt(self) -> float:
        """Mean prompt tokens a replica computes (a reused document is cached after its first use)."""
        rows = self.lengths()
        return float(np.minimum(rows[:, 0], 8192 + QUESTION_MAX).mean())


WORKLOADS = {w.name: w for w in (
    Workload("chat"), Workload("rag 4k reuse", 4096, reuse=True), Workload("mix chat+rag4k", 4096, mix=True),
    Workload("rag 2k", 2048),
    Workload("rag 4k", 4096), Workload("rag 8k", 8192))}


def fleet(n_gpus: int, prefill: int, budget: int, w: Workload, rate: float, n_requests: int) -> dict[str, Any]:
    model = {"model": "llama-8b", "gpu": "H100"}
    replicas = [{**model, "count": n_gpus}] if prefill == 0 else \
        [{**model, "count": prefill, "role": "prefill"}, {**model, "count": n_gpus - prefill, "role": "decode"}]
    return scenario([site("dc", "central", "W", replicas)], [], [w.traffic(rate)], duration_s=n_requests / rate,
                    models=("llama-8b",), max_wait_s=600.0, max_num_batched_tokens=budget)


@dataclass
class SloResult(SimResult):
    """The simulator's result, plus each finished request's (TTFT, p90 of its own gaps), for goodput."""

    per_request: list[tuple[float, float]] = field(default_factory=list)

    def add(self, r: Any, jurisdiction: dict[str, str]) -> None:
        super().add(r, jurisdiction)
        if r.outcome == "done":
            self.per_request.append((r.first_token - r.arrival, float(np.percentile(r.gaps, 90)) if r.gaps else 0.0))


def run_point(n_gpus: int, prefill: int, budget: int, w: Workload, rate: float, n_requests: int,
              seed: int) -> dict[str, Any]:
    """One simulation: latencies (ms), goodput per SLO pair (share of requests and requests/s), refusals."""
    sim = Simulator(scenario_from_dict(fleet(n_gpus, prefill, budget, w, rate, n_requests)), seed=seed,
                    lengths=w.lengths(), record_gaps=True)
    sim.result = res = SloResult()
    sim.run()
    per = np.array(res.per_request).reshape(-1, 2)
    good = {name: round(float(((per[:, 0] <= s["ttft_s"]) & (per[:, 1] <= s["itl_p90_s"])).sum())
                        / max(res.requests, 1), 4) for name, s in SLOS.items()}
    return {"ttft_ms": percentiles(res.ttft), "itl_ms": percentiles(res.gaps), "requests": res.requests,
            "refused": res.outcomes.get("refused", 0), "slo_share": good,
            "goodput_per_s": {k: round(v * rate, 3) for k, v in good.items()}}


def capacity_per_gpu(w: Workload) -> float:
    """Requests/s one H100 could serve of this workload, prefills (unchunked) and decodes (batch 32) back to
    back: the load scale (a share of it is the x axis). An estimate for scaling the sweep, not a result."""
    s = scenario_from_dict(fleet(1, 0, 2048, w, 1.0, 1))
    cost = RooflineCost(s.models["llama-8b"], s.gpu_types["H100"])
    rows = w.lengths()
    prompt, out = w.uncached_prompt(), float(np.minimum(rows[:, 1], MAX_OUTPUT).mean())
    ctx = int(prompt + w.doc_tokens * w.reuse + out / 2)
    t_prefill = cost(StepShape((int(prompt),), (int(prompt + w.doc_tokens * w.reuse),), 1))
    t_token = cost(StepShape((1,) * 32, (ctx,) * 32, 32)) / 32
    return 1.0 / (t_prefill + out * t_token)


def configurations(n_gpus: int) -> dict[str, tuple[str, int, int]]:
    """name -> (setup, prefill replicas, budget)."""
    out = {f"colocated x{n_gpus} budget {b}": ("colocated", 0, v) for b, v in BUDGETS.items()}
    out |= {f"{p}P+{n_gpus - p}D": ("disaggregated", p, DISAGG_BUDGET) for p in range(1, n_gpus)}
    return out


def best(configs: dict[str, dict[str, Any]], setup: str) -> tuple[str, bool]:
    """The setup's best configuration at a point (VERDICT_RULE), and whether it meets the TTFT SLO."""
    mine = {k: v for k, v in configs.items() if v["setup"] == setup}
    bound = SLOS[TTFT_SLO]["ttft_s"] * 1000
    ok = {k: v for k, v in mine.items() if v["ttft_ms"]["p90"] <= bound}
    if ok:
        return min(ok, key=lambda k: ok[k]["itl_ms"]["p90"]), True
    return min(mine, key=lambda k: mine[k]["ttft_ms"]["p90"]), False


def summarize(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A point's verdict inputs: each setup's best, the cut, and the goodput of each setup's best config."""
    (co, co_ok), (dis, dis_ok) = best(configs, "colocated"), best(configs, "disaggregated")
    cut = configs[co]["itl_ms"]["p90"] / configs[dis]["itl_ms"]["p90"]
    default = next(k for k in configs if k.endswith("budget 2048"))
    goodput = {slo: {setup: max(v["goodput_per_s"][slo] for v in configs.values() if v["setup"] == setup)
                     for setup in ("colocated", "disaggregated")} for slo in SLOS}
    return {"best_colocated": co, "best_disaggregated": dis, "colocated_meets_ttft": co_ok,
            "disaggregated_meets_ttft": dis_ok, "p90_itl_cut": round(cut, 3),
            "p90_itl_cut_vs_budget_2048": round(configs[default]["itl_ms"]["p90"] / configs[dis]["itl_ms"]["p90"], 3),
            "p99_itl_cut": round(configs[co]["itl_ms"]["p99"] / configs[dis]["itl_ms"]["p99"], 3),
            "ttft_p90_ratio_dis_over_co": round(configs[dis]["ttft_ms"]["p90"] / configs[co]["ttft_ms"]["p90"], 3),
            "best_goodput_per_s": goodput,
            "in_regime": bool(cut >= CUT_REGIME and dis_ok)}


def sweep(gpu_counts: Iterable[int], workloads: Iterable[str], loads: Iterable[float], n_requests: int,
          track: Callable[..., Iterable[Any]], seed: int = 4) -> list[dict[str, Any]]:
    """Every point of the grid: its rate, every configuration's numbers and the point's summary."""
    grid = [(n, w, x) for n in gpu_counts for w in workloads for x in loads]
    jobs = [(n, w, x, name, cfg) for n, w, x in grid for name, cfg in configurations(n).items()]
    caps = {w: capacity_per_gpu(WORKLOADS[w]) for w in {w for _, w, _ in grid}}
    runs: dict[tuple, dict[str, dict[str, Any]]] = {}
    for n, w, x, name, (setup, prefill, budget) in track(jobs, "E4 regime sweep (simulated)"):
        rate = x * n * caps[w]
        runs.setdefault((n, w, x), {})[name] = {"setup": setup, **run_point(n, prefill, budget, WORKLOADS[w], rate,
                                                                              n_requests, seed)}
    return [{"gpus": n, "workload": w, "load": x, "rate_per_s": round(x * n * caps[w], 3),
             "uncached_prompt_tokens": round(WORKLOADS[w].uncached_prompt()), **summarize(runs[(n, w, x)]),
             "configs": runs[(n, w, x)]} for n, w, x in grid]


def regime_text(points: list[dict[str, Any]]) -> str:
    """Where the cut reaches CUT_REGIME (or the closest point), in words."""
    inside = [p for p in points if p["in_regime"]]
    if not inside:
        c = max(points, key=lambda p: p["p90_itl_cut"] if p["disaggregated_meets_ttft"] else 0)
        return (f"no point of the sweep has a >= {CUT_REGIME:g}x p90 ITL cut with disaggregation meeting the TTFT "
                f"SLO; closest: {c['p90_itl_cut']:.2f}x at {c['gpus']} GPUs, {c['workload']}, load {c['load']:g}")
    by = {}
    for p in inside:
        by.setdefault((p["gpus"], p["workload"]), []).append(p)
    parts = []
    for (n, w), ps in sorted(by.items()):
        loads = ", ".join(f"{p['load']:g}" for p in ps)
        cuts = ", ".join(f"{p['p90_itl_cut']:.1f}x" for p in ps)
        parts.append(f"{w} on {n} GPUs at load {loads} ({cuts})")
    return f"{len(inside)} of {len(points)} points: " + "; ".join(parts)
