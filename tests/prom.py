"""Reading a /metrics page as Prometheus does: ``prometheus_client``'s own text parser (strict: a
malformed line raises), and the checks every endpoint's page must pass for the vLLM-named series."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from serve.metrics import VLLM_SERIES


def families(text: str) -> dict[str, tuple[str, list]]:
    """family name -> (type, samples); a counter's family is named without ``_total`` (the parser's
    way)."""
    out = {}
    for f in text_string_to_metric_families(text):
        assert f.name not in out, f"family {f.name} written twice"
        out[f.name] = (f.type, list(f.samples))
    return out


def vllm_values(text: str, required_labels: frozenset[str] = frozenset({"model_name"})
                ) -> dict[tuple, float]:
    """Every sample of the vLLM-named series, checked for its type and labels:
    (sample name, labels) -> value."""
    fams = families(text)
    values: dict[tuple, float] = {}
    for name, kind in VLLM_SERIES.items():
        family = name.removesuffix("_total") if kind == "counter" else name
        assert family in fams, f"{name} missing"
        got_kind, samples = fams[family]
        assert got_kind == kind, (name, got_kind)
        assert samples, f"{name} has no sample"
        for s in samples:
            assert required_labels <= set(s.labels), (name, s.labels)
            if kind == "histogram":
                assert s.name in (f"{name}_bucket", f"{name}_sum", f"{name}_count"), s.name
            if kind == "gauge" and name.endswith("_perc"):
                assert 0.0 <= s.value <= 1.0, (name, s.value)
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return values


def total(values: dict[tuple, float], sample: str, **labels: str) -> float:
    """The sum of ``sample`` over the series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (name, ls), v in values.items() if name == sample and want <= set(ls))
