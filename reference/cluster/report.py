"""What a simulation measured: latencies per request, outcomes, utilization, and the residency
audit."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Milliseconds at the given percentiles (and the mean) of values in seconds; NaN when empty."""
    if not values:
        return {**{f"p{p}": float("nan") for p in ps}, "mean": float("nan")}
    v = np.asarray(values, dtype=np.float64) * 1000
    return {**{f"p{p}": round(float(np.percentile(v, p)), 3) for p in ps},
            "mean": round(float(v.mean()), 3)}


@dataclass
class SimResult:
    ttft: list[float] = field(default_factory=list)  # seconds, client side, completed requests
    e2e: list[float] = field(default_factory=list)
    # mean inter-token gap per request (>= 2 tokens)
    tpot: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # every inter-token gap (when recorded)
    # request id -> TTFT, when asked for (paired comparisons)
    ttft_by_id: dict[int, float] | None = None
    tier: Counter = field(default_factory=Counter)  # tier of the replica that took the prompt
    tier_by_traffic: dict[int, Counter] = field(default_factory=dict)
    ttft_by_traffic: dict[int, list[float]] = field(default_factory=dict)
    outcomes: Counter = field(default_factory=Counter)
    refusals: Counter = field(default_factory=Counter)
    # request ids that touched a disallowed site
    violations: list[int] = field(default_factory=list)
    retries: int = 0
    failures: int = 0
    requests: int = 0
    events: int = 0  # events logged (every step counts, also inside a macro step)
    queue_events: int = 0  # events the simulator took from its queue (a macro step is one)
    end_time: float = 0.0
    event_hash: str = ""
    utilization: dict[str, Any] = field(default_factory=dict)

    def add(self, r: Any, jurisdiction: dict[str, str]) -> None:
        """Record one request that left the system (done or refused), and audit where it went."""
        self.requests += 1
        self.outcomes[r.outcome] += 1
        self.retries += r.retries
        if any(jurisdiction[site] not in r.allowed for site in r.visited):
            self.violations.append(r.rid)
        if r.outcome != "done":
            self.refusals[
                r.reason.split(":")[0] + ": " + r.reason.split(":", 1)[-1].strip()[:60]
            ] += 1
            return
        self.ttft.append(r.first_token - r.arrival)
        if self.ttft_by_id is not None:
            self.ttft_by_id[r.rid] = r.first_token - r.arrival
        self.e2e.append(r.finish - r.arrival)
        if r.output_len > 1:
            self.tpot.append((r.finish - r.first_token) / (r.output_len - 1))
        self.gaps += r.gaps
        tier = r.decision.prefill.tier
        self.tier[tier] += 1
        self.tier_by_traffic.setdefault(r.traffic, Counter())[tier] += 1
        self.ttft_by_traffic.setdefault(r.traffic, []).append(r.first_token - r.arrival)

    def finalize(self, replicas: list[Any], end_time: float, events: int, event_hash: str,
                 window: float) -> None:
        """Utilization is measured over [0, window): while requests arrive, not while the last ones
        drain."""
        self.end_time, self.events, self.event_hash = end_time, events, event_hash
        span = max(min(end_time, window), 1e-9)
        by_role: dict[str, dict[str, float]] = {}
        for rep in replicas:
            role = by_role.setdefault(rep.role, {"busy_s": 0.0, "flops": 0.0, "peak": 0.0, "n": 0,
                                                 "prefill_busy_s": 0.0, "prefill_flops": 0.0})
            role["busy_s"] += rep.busy_s
            role["flops"] += rep.flops_done
            role["peak"] += rep.peak_flops_per_s
            role["prefill_busy_s"] += rep.prefill_busy_s
            role["prefill_flops"] += rep.prefill_flops
            role["n"] += 1
        self.utilization = {
            role: {
                "replicas": v["n"],
                "busy_share": round(v["busy_s"] / (v["n"] * span), 4),
                "compute_utilization": round(v["flops"] / (v["peak"] * span), 4),
                "compute_utilization_while_busy": round(
                    v["flops"] / max(v["peak"] / v["n"] * v["busy_s"], 1e-12), 4
                ),
            }
            for role, v in sorted(by_role.items())
        }
        total_busy = sum(r.busy_s for r in replicas)
        total_flops, total_peak = (
            sum(r.flops_done for r in replicas),
            sum(r.peak_flops_per_s for r in replicas),
        )
        self.utilization["all"] = {
            "replicas": len(replicas),
            "busy_share": round(total_busy / (len(replicas) * span), 4),
            "compute_utilization": round(total_flops / (total_peak * span), 4),
        }

    def summary(self) -> dict[str, Any]:
        done = self.outcomes.get("done", 0)
        return {
            "requests": self.requests, "done": done, "refused": self.outcomes.get("refused", 0),
            "refusal_reasons": dict(self.refusals.most_common(5)), "retries": self.retries,
            "failures": self.failures, "residency_violations": len(self.violations),
            "tier_share": {t: round(n / max(done, 1), 4) for t, n in sorted(self.tier.items())},
            "ttft_ms": percentiles(self.ttft), "tpot_ms": percentiles(self.tpot),
            "e2e_ms": percentiles(self.e2e),
            **({"itl_ms": percentiles(self.gaps)} if self.gaps else {}),
            "utilization": self.utilization, "events": self.events,
            "queue_events": self.queue_events, "simulated_s": round(self.end_time, 3),
            "event_log_hash": self.event_hash,
        }


def trace_record(r: Any, jurisdiction: dict[str, str]) -> str:
    """One JSON line of the decision trace: where the request went, why, and how it ended."""
    d = r.decision
    pre = d.prefill.site if d is not None and d.prefill is not None else None
    dec = d.decode.site if d is not None and d.decode is not None else None
    rec = {"id": r.rid, "origin": r.origin, "allowed": list(r.allowed), "models": list(r.models),
           "model": d.prefill.model if pre else None,
           "prefill_site": pre, "prefill_jurisdiction": jurisdiction.get(pre), "decode_site": dec,
           "decode_jurisdiction": jurisdiction.get(dec),
           "kv_path": list(d.kv_path.sites) if pre and d.kv_path else None,
           "reason": r.reason, "outcome": r.outcome, "retries": r.retries, "ttft_ms": None,
           "e2e_ms": None}
    if r.outcome == "done":
        rec["ttft_ms"] = round((r.first_token - r.arrival) * 1e3, 3)
        rec["e2e_ms"] = round((r.finish - r.arrival) * 1e3, 3)
    return json.dumps(rec, sort_keys=True)
