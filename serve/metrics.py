"""Prometheus metrics of the server, written in the text exposition format (version 0.0.4).

Latency histograms come from the engine's own per-request metrics (engine clock): time to first token
is arrival in the engine to the first generated token, inter-token latency every gap between two
tokens of a request. Gauges (queue depth, running sequences, KV blocks, prefix-cache hit rate) are the
engine thread's latest snapshot; token counters are per tenant.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict

from reference.engine.request import RequestOutput
from serve.engine_thread import Stats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == math.inf else repr(bound)
            out.append(f'{self.name}_bucket{{le="{le}"}} {cumulative}')
        out += [f"{self.name}_sum {self.total!r}", f"{self.name}_count {self.count}"]
        return out


class ServerMetrics:
    """Everything /metrics reports; updated by the HTTP handlers (one event loop, no locking)."""

    def __init__(self) -> None:
        self.ttft = Histogram("unfire_time_to_first_token_seconds", "Engine arrival to first token.", TTFT_BUCKETS)
        self.itl = Histogram("unfire_inter_token_latency_seconds", "Gap between two tokens of a request.",
                             ITL_BUCKETS)
        self.e2e = Histogram("unfire_e2e_request_latency_seconds", "Engine arrival to the last token.", E2E_BUCKETS)
        self.requests: dict[str, int] = defaultdict(int)  # by outcome: finished, aborted, rejected, ...
        self.prompt_tokens: dict[str, int] = defaultdict(int)  # by tenant
        self.completion_tokens: dict[str, int] = defaultdict(int)
        self.in_flight = 0

    def finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.inter_token_latencies:
            self.itl.observe(float(gap))
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        self.requests["finished"] += 1
        self.prompt_tokens[out.tenant] += len(out.prompt_token_ids)
        self.completion_tokens[out.tenant] += len(out.output_token_ids)

    def count(self, outcome: str) -> None:
        self.requests[outcome] += 1

    def render(self, stats: Stats) -> str:
        lines: list[str] = []
        for h in (self.ttft, self.itl, self.e2e):
            lines += h.lines()
        hit_rate = stats.prefix_hit_tokens / stats.prefix_lookup_tokens if stats.prefix_lookup_tokens else 0.0
        gauges = [
            ("unfire_queue_depth", "Requests waiting to be admitted by the scheduler.", stats.waiting),
            ("unfire_running_sequences", "Sequences admitted and holding KV blocks.", stats.running),
            ("unfire_requests_in_flight", "HTTP requests accepted and not yet answered.", self.in_flight),
            ("unfire_kv_blocks_used", "KV cache blocks referenced by live sequences.", stats.kv_blocks_used),
            ("unfire_kv_blocks_total", "KV cache blocks in all.", stats.kv_blocks_total),
            ("unfire_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / tokens looked up.",
             hit_rate),
        ]
        for name, help_text, value in gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value!r}"]
        counters = [
            ("unfire_requests_total", "Requests by outcome.", "outcome", self.requests),
            ("unfire_prompt_tokens_total", "Prompt tokens of finished requests, per tenant.", "tenant",
             self.prompt_tokens),
            ("unfire_generation_tokens_total", "Generated tokens of finished requests, per tenant.", "tenant",
             self.completion_tokens),
        ]
        for name, help_text, label, values in counters:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            lines += [f'{name}{{{label}="{_escape(k)}"}} {v}' for k, v in sorted(values.items())]
        lines += getattr(stats, "extra_lines", [])  # e.g. the disaggregated workers' (serve/disagg.py)
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
