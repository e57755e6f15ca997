"""Serving latency statistics, the way serving benchmarks report them (vLLM's ``bench serve``).

Per request: TTFT (send to first token), TPOT (time per output token after the first:
``(e2e - ttft) / (output_tokens - 1)``), ITL (every gap between two pieces of streamed text) and
end-to-end latency. Over a run: mean, p50, p90, p99 of each (milliseconds), output tokens per second
and requests per second over the run's duration, and goodput: requests per second that met both
SLOs (TTFT <= ``slo_ttft_ms`` and TPOT <= ``slo_tpot_ms``; a one-token answer has no TPOT to miss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """What one request measured (seconds). ``ok`` False: it failed, with ``error`` saying why."""

    ok: bool = False
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def distribution_ms(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of ``values`` (seconds) in milliseconds; None when there are none."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(records: Sequence[RequestRecord], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """The run's summary (see the module docstring); ``duration_s`` is first send to last answer."""
    done = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in done)
    duration_s = max(duration_s, 1e-9)

    def meets(r: RequestRecord) -> bool:
        ttft_ok = slo_ttft_ms is None or (r.ttft is not None and r.ttft * 1e3 <= slo_ttft_ms)
        tpot_ok = slo_tpot_ms is None or r.tpot is None or r.tpot * 1e3 <= slo_tpot_ms
        return ttft_ok and tpot_ok

    good = sum(meets(r) for r in done)
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "output_tokens": tokens,
        "request_throughput_rps": len(done) / duration_s,
        "output_throughput_tok_s": tokens / duration_s,
        "goodput_rps": good / duration_s,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "met": good},
        "ttft_ms": distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": distribution_ms([g for r in done for g in r.itl]),
        "e2e_ms": distribution_ms([r.e2e for r in done if r.e2e is not None]),
        "errors": sorted({r.error for r in records if r.error})[:10],
    }
