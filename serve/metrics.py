"""Prometheus metrics of the server, written in the text exposition format (version 0.0.4).

Latency histograms come from the engine's own per-request metrics (engine clock): time to first
token is arrival in the engine to the first generated token, inter-token latency every gap between
two tokens of a request. Gauges (queue depth, running sequences, KV blocks, prefix-cache hit rate)
are the engine thread's latest snapshot; token counters are per tenant.

Beside the project's own ``unfire_*`` series, the same measurements are exported under the names
vLLM uses (``vllm:*``, as vLLM's ``vllm/v1/metrics/loggers.py`` names them, with vLLM's buckets and
its ``model_name`` and ``engine`` labels), so routers and dashboards made for vLLM read a server of
ours as they read vLLM: ``VLLM_SERIES`` lists them. ``RequestLatencies`` is the part a gateway
shares (it observes the latencies its clients see, per model).
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
# vLLM's buckets, so that quantiles from a board made for vLLM compare like with like
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_SERIES = {  # name -> Prometheus type
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}
ENGINE = "0"  # vLLM's engine label: the index of the engine core (one here)
REASONS = ("stop", "length", "abort")  # finished_reason values written before any request ends
Labels = tuple[tuple[str, str], ...]


def label_text(labels: Labels) -> str:
    """``{a="x",b="y"}`` ("" for no labels), values escaped as the text format wants."""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}" if labels else ""


class Histogram:
    """One histogram family: a series per label set (``()``: the one unlabelled series)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.series: dict[Labels, list] = {}  # labels -> [bucket counts (last: +Inf), sum, count]

    def observe(self, value: float, labels: Labels = ()) -> None:
        s = self.series.setdefault(labels, self._empty())
        s[0][bisect.bisect_left(self.buckets, value)] += 1
        s[1] += value
        s[2] += 1

    def _empty(self) -> list:
        return [[0] * (len(self.buckets) + 1), 0.0, 0]

    def lines(self, shown: tuple[Labels, ...] = ((),)) -> list[str]:
        """The family's lines; ``shown``: label sets written (at zero) before any observation."""
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        series = {labels: self._empty() for labels in shown} | self.series
        for labels, (counts, total, count) in sorted(series.items()):
            cumulative = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                cumulative += n
                le = "+Inf" if bound == math.inf else repr(bound)
                out.append(f"{self.name}_bucket{label_text((*labels, ('le', le)))} {cumulative}")
            out.append(f"{self.name}_sum{label_text(labels)} {total!r}")
            out.append(f"{self.name}_count{label_text(labels)} {count}")
        return out


def family(name: str, kind: str, help_text: str, values: dict[Labels, float]) -> list[str]:
    """A counter or gauge family: HELP, TYPE and one line per label set."""
    out = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    return out + [f"{name}{label_text(labels)} {v!r}" for labels, v in sorted(values.items())]


def vllm_labels(model: str) -> Labels:
    return (("engine", ENGINE), ("model_name", model))


class RequestLatencies:
    """Per-request latencies and token counts, under the project's names and vLLM's (by model)."""

    def __init__(self) -> None:
        self.ttft = Histogram("unfire_time_to_first_token_seconds",
                              "Engine arrival to first token.", TTFT_BUCKETS)
        self.itl = Histogram("unfire_inter_token_latency_seconds",
                             "Gap between two tokens of a request.", ITL_BUCKETS)
        self.e2e = Histogram("unfire_e2e_request_latency_seconds",
                             "Engine arrival to the last token.", E2E_BUCKETS)
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds",
                                "Histogram of time to first token in seconds.", VLLM_TTFT_BUCKETS)
        self.v_itl = Histogram("vllm:inter_token_latency_seconds",
                               "Histogram of inter-token latency in seconds.", VLLM_ITL_BUCKETS)
        self.v_tpot = Histogram("vllm:time_per_output_token_seconds",
                                "Histogram of time per output token in seconds. DEPRECATED: Use "
                                "vllm:inter_token_latency_seconds instead.", VLLM_ITL_BUCKETS)
        self.v_req_tpot = Histogram("vllm:request_time_per_output_token_seconds",
                                    "Histogram of time_per_output_token_seconds per request.",
                                    VLLM_ITL_BUCKETS)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds",
                               "Histogram of e2e request latency in seconds.", VLLM_E2E_BUCKETS)
        self.prompt_tokens: dict[str, int] = defaultdict(int)  # by tenant
        self.completion_tokens: dict[str, int] = defaultdict(int)
        self.model_prompt: dict[str, int] = defaultdict(int)  # by model (vLLM's counters)
        self.model_generation: dict[str, int] = defaultdict(int)
        self.success: dict[tuple[str, str], int] = defaultdict(int)  # (model, finished_reason)

    def record(self, *, model: str, tenant: str, prompt: int, generated: int, ttft: float | None,
               gaps: list[float], e2e: float | None, finish_reason: str | None) -> None:
        """One finished request: token counts, time to first token, inter-token gaps, end to end."""
        v = vllm_labels(model)
        if ttft is not None:
            self.ttft.observe(ttft)
            self.v_ttft.observe(ttft, v)
        for gap in gaps:
            self.itl.observe(gap)
            self.v_itl.observe(gap, v)
            self.v_tpot.observe(gap, v)
        if gaps:
            self.v_req_tpot.observe(sum(gaps) / len(gaps), v)
        if e2e is not None:
            self.e2e.observe(e2e)
            self.v_e2e.observe(e2e, v)
        self.prompt_tokens[tenant] += prompt
        self.completion_tokens[tenant] += generated
        self.model_prompt[model] += prompt
        self.model_generation[model] += generated
        self.success[(model, finish_reason or "stop")] += 1

    def lines(self, models: list[str]) -> list[str]:
        """Every series; ``models``: those whose vLLM series are written before their first
        request too."""
        lines: list[str] = []
        for h in (self.ttft, self.itl, self.e2e):
            lines += h.lines()
        shown = tuple(vllm_labels(m) for m in models)
        for h in (self.v_ttft, self.v_itl, self.v_tpot, self.v_req_tpot, self.v_e2e):
            lines += h.lines(shown)
        by_tenant = [
            ("unfire_prompt_tokens_total", "Prompt tokens of finished requests, per tenant.",
             self.prompt_tokens),
            ("unfire_generation_tokens_total", "Generated tokens of finished requests, per tenant.",
             self.completion_tokens),
        ]
        for name, help_text, values in by_tenant:
            lines += family(name, "counter", help_text,
                            {(("tenant", k),): v for k, v in values.items()})
        by_model = [
            ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", self.model_prompt),
            ("vllm:generation_tokens_total", "Number of generation tokens processed.",
             self.model_generation),
        ]
        for name, help_text, values in by_model:
            lines += family(name, "counter", help_text,
                            {vllm_labels(m): values.get(m, 0) for m in {*models, *values}})
        success = {(*vllm_labels(m), ("finished_reason", r)): 0 for m in models for r in REASONS}
        success |= {(*vllm_labels(m), ("finished_reason", r)): n
                    for (m, r), n in self.success.items()}
        lines += family("vllm:request_success_total", "counter",
                        "Count of successfully processed requests.", success)
        return lines


class ServerMetrics:
    """Everything /metrics reports; updated by the HTTP handlers (one event loop, no locking)."""

    def __init__(self, model_name: str = "model") -> None:
        self.model_name = model_name
        self.latencies = RequestLatencies()
        self.requests: dict[str, int] = defaultdict(int)  # by outcome: finished, aborted, ...
        self.in_flight = 0

    def finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.latencies.record(model=self.model_name, tenant=out.tenant,
                              prompt=len(out.prompt_token_ids), generated=len(out.output_token_ids),
                              ttft=m.ttft, gaps=[float(g) for g in m.inter_token_latencies],
                              e2e=m.e2e_latency, finish_reason=out.finish_reason)
        self.requests["finished"] += 1

    def count(self, outcome: str) -> None:
        self.requests[outcome] += 1

    def render(self, stats: Stats) -> str:
        lines = self.latencies.lines([self.model_name])
        looked_up = stats.prefix_lookup_tokens
        hit_rate = stats.prefix_hit_tokens / looked_up if looked_up else 0.0
        gauges = [
            ("unfire_queue_depth", "Requests waiting to be admitted by the scheduler.",
             stats.waiting),
            ("unfire_running_sequences", "Sequences admitted and holding KV blocks.",
             stats.running),
            ("unfire_requests_in_flight", "HTTP requests accepted and not yet answered.",
             self.in_flight),
            ("unfire_kv_blocks_used", "KV cache blocks referenced by live sequences.",
             stats.kv_blocks_used),
            ("unfire_kv_blocks_total", "KV cache blocks in all.", stats.kv_blocks_total),
            ("unfire_prefix_cache_hit_rate",
             "Prompt tokens found in the prefix cache / tokens looked up.", hit_rate),
        ]
        for name, help_text, value in gauges:
            lines += family(name, "gauge", help_text, {(): value})
        lines += family("unfire_burst_gathered_requests_total", "counter",
                        "Requests that joined an idle engine's first step while it waited for a burst "
                        "(--burst-gather-ms).", {(): stats.gathered})
        lines += family("unfire_requests_total", "counter", "Requests by outcome.",
                        {(("outcome", k),): v for k, v in self.requests.items()})
        v = vllm_labels(self.model_name)
        total = stats.kv_blocks_total
        vllm = [
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
             stats.running),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
             stats.waiting),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             stats.kv_blocks_used / total if total else 0.0),
            ("vllm:prefix_cache_queries_total", "counter",
             "Prefix cache queries, in terms of number of queried tokens.", looked_up),
            ("vllm:prefix_cache_hits_total", "counter",
             "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_hit_tokens),
        ]
        for name, kind, help_text, value in vllm:
            lines += family(name, kind, help_text, {v: value})
        lines += getattr(stats, "extra_lines", [])  # e.g. the disaggregated workers' (disagg.py)
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
