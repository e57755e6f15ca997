"""E4's regime study: the rule that picks each setup's best configuration, the cut, the verdict, one point."""

from __future__ import annotations

from experiments.claims.e4_disagg import verdict_of
from experiments.disagg import disagg_regimes as regimes
from experiments.engine.stats import spread


def cfg(setup: str, ttft_p90: float, itl_p90: float) -> dict:
    return {"setup": setup, "ttft_ms": {"p90": ttft_p90}, "itl_ms": {"p90": itl_p90, "p99": 2 * itl_p90},
            "goodput_per_s": dict.fromkeys(regimes.SLOS, 1.0)}


def test_best_is_the_lowest_itl_within_the_ttft_slo_else_the_lowest_ttft() -> None:
    configs = {"colocated x2 budget 256": cfg("colocated", 2500, 8),
               "colocated x2 budget 2048": cfg("colocated", 900, 40),
               "colocated x2 budget 8192": cfg("colocated", 800, 60), "1P+1D": cfg("disaggregated", 1500, 10)}
    assert regimes.best(configs, "colocated") == ("colocated x2 budget 2048", True)  # 256 breaks the TTFT SLO
    s = regimes.summarize(configs)
    assert s["p90_itl_cut"] == 4.0 and s["in_regime"] and s["p90_itl_cut_vs_budget_2048"] == 4.0
    configs["1P+1D"] = cfg("disaggregated", 2600, 10)  # disaggregation no longer meets the TTFT SLO
    s = regimes.summarize(configs)
    assert not s["disaggregated_meets_ttft"] and not s["in_regime"]
    configs = {k: cfg("colocated", 3000 + i, 50) for i, k in enumerate(["colocated x2 budget 2048", "c2"])}
    assert regimes.best(configs, "colocated") == ("colocated x2 budget 2048", False)


def test_verdict_rule() -> None:
    inside, outside = {"in_regime": True}, {"in_regime": False}
    assert verdict_of([outside], spread([5.0, 6.0])) == "differs"
    assert verdict_of([inside, outside], spread([3.2, 4.0])) == "matches"
    assert verdict_of([inside], spread([2.5, 3.5])).startswith("inconclusive (CPU p90 ITL cut spread 2.50-3.50")
    assert verdict_of([inside], spread([1.0, 1.4])) == "partly matches"


def test_workloads_and_one_simulated_point() -> None:
    w = regimes.WORKLOADS
    assert w["chat"].uncached_prompt() < w["rag 4k reuse"].uncached_prompt() + 300 < w["rag 2k"].uncached_prompt()
    assert w["rag 2k"].uncached_prompt() < w["rag 4k"].uncached_prompt() < w["rag 8k"].uncached_prompt()
    assert min(w["rag 8k"].lengths()[:, 0]) > 8192 and w["rag 4k reuse"].lengths()[:, 0].max() <= regimes.QUESTION_MAX
    assert 0.3 < (w["mix chat+rag4k"].lengths()[:, 0] > 4096).mean() < 0.7
    assert all(regimes.capacity_per_gpu(x) > 0 for x in w.values())
    a = regimes.run_point(2, 1, regimes.DISAGG_BUDGET, w["rag 2k"], 4.0, 30, seed=1)
    b = regimes.run_point(2, 1, regimes.DISAGG_BUDGET, w["rag 2k"], 4.0, 30, seed=1)
    assert a == b and a["requests"] > 0  # deterministic: a rerun of the sweep gives the same numbers
    assert 0 <= a["slo_share"]["ttft2s_itl50ms"] <= 1 and a["itl_ms"]["p90"] > 0
    assert set(regimes.configurations(4)) >= {"1P+3D", "3P+1D", "colocated x4 budget unchunked"}
