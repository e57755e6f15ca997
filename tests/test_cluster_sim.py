"""The cluster simulator: determinism, no wall clock, the residency rule, tiers, failures, KV hand-off."""

from __future__ import annotations

import copy
import dataclasses
import json
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.cluster import ScenarioError, Simulator, load_scenario, scenario_from_dict, simulate
from reference.cluster.network import Network
from reference.cluster.randomized import random_scenario, random_scenario_dict
from reference.cluster.router import Router
from reference.cluster.scenario import TIERS

EXAMPLE = "reference/cluster/examples/two_regions.toml"


def small(**traffic: object) -> dict:
    """Two EU sites (edge, regional) and one US central site, tiny models, fixed lengths."""
    d = random_scenario_dict(np.random.default_rng(0))
    d["failures"] = []
    d["gpu_types"].append({"name": "S", "memory_gb": 1.0, "peak_tflops": 0.01, "bandwidth_tbps": 0.01})  # slow
    d["sites"] = [
        {"name": "edge", "tier": "edge", "jurisdiction": "EU", "gpus": {"S": 1},
         "replicas": [{"model": "a", "gpu": "S"}]},
        {"name": "core", "tier": "regional", "jurisdiction": "EU", "gpus": {"G": 2},
         "replicas": [{"model": "b", "gpu": "G", "role": "prefill"}, {"model": "b", "gpu": "G", "role": "decode"}]},
        {"name": "central", "tier": "central", "jurisdiction": "US", "gpus": {"G": 1},
         "replicas": [{"model": "b", "gpu": "G"}]},
    ]
    d["links"] = [{"a": "edge", "b": "core", "rtt_ms": 4, "gbps": 10}, {"a": "core", "b": "central", "rtt_ms": 80,
                                                                      "gbps": 10}]
    d["traffic"] = [{"name": "t", "origins": ["edge"], "rate_per_s": 20, "models": ["a", "b"], "allowed": ["EU"],
                     "lengths": "fixed", "prompt_tokens": 40, "output_tokens": 5, **traffic}]
    return d


def test_example_runs_and_is_deterministic() -> None:
    s = dataclasses.replace(load_scenario(EXAMPLE), duration_s=6.0)
    lengths = np.array([[100, 50], [300, 120], [20, 10]])  # stand-in for ShareGPT: no tokenizer in this test
    a = simulate(s, 3, lengths=lengths).summary()
    b = simulate(s, 3, lengths=lengths).summary()
    c = simulate(s, 4, lengths=lengths).summary()
    assert a == b
    assert a["event_log_hash"] != c["event_log_hash"]
    assert a["done"] > 50 and a["residency_violations"] == 0 and a["failures"] == 1


@given(st.integers(0, 2**32 - 1))
def test_same_seed_same_event_log_hash(seed: int) -> None:
    s = random_scenario(np.random.default_rng(seed))
    assert simulate(s, seed).event_hash == simulate(s, seed).event_hash


def test_no_wall_clock_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    s = scenario_from_dict(small())
    sim = Simulator(s, 1)  # built before the clocks break (the scenario parse may import lazily)

    def broken() -> float:
        raise AssertionError("the simulator read the wall clock")

    for name in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"):
        monkeypatch.setattr(time, name, broken)
    result = sim.run()
    assert result.outcomes["done"] > 5


@given(st.integers(0, 2**32 - 1))
def test_residency_never_violated_with_failures(seed: int) -> None:
    rng = np.random.default_rng(seed)
    s = random_scenario(rng)
    lines: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            lines.append(text)

    result = Simulator(s, seed, trace=Sink()).run()
    assert result.violations == []
    assert len(lines) == result.requests
    allowed_by_name = {t.name: set(t.allowed) for t in s.traffic}
    for line in lines:
        rec = json.loads(line)
        allowed = set(rec["allowed"])
        assert allowed in allowed_by_name.values()
        if rec["outcome"] == "done":
            assert rec["prefill_jurisdiction"] in allowed and rec["decode_jurisdiction"] in allowed
            for site in rec["kv_path"] or []:  # the KV transfer edge, every hop
                assert s.sites[site].jurisdiction in allowed
        else:
            assert rec["reason"].startswith("refused")


def test_the_audit_catches_a_router_that_ignores_residency(monkeypatch: pytest.MonkeyPatch) -> None:
    everywhere = ("EU", "US", "CN")
    paths_from = Network.paths_from

    def careless(self: Router, req: object) -> dict:
        return {t: [r for r in self.entry if r.tier == t and r.model in req.models] for t in TIERS}

    def careless_paths(self: Network, source: str, allowed: tuple, also: str | None = None) -> dict:
        return paths_from(self, source, everywhere, also)

    d = small()
    d["sites"][1]["replicas"] = []
    d["sites"][1]["gpus"] = {"G": 0}
    d["sites"][0]["replicas"] = []
    d["sites"][0]["gpus"] = {"G": 0}  # only the US site serves: an EU request must be refused
    s = scenario_from_dict(d)
    honest = simulate(s, 0)
    assert honest.outcomes["done"] == 0 and honest.outcomes["refused"] > 0
    assert "refused: no replica" in next(iter(honest.refusals))
    monkeypatch.setattr(Router, "candidates", careless)
    monkeypatch.setattr(Network, "paths_from", careless_paths)
    assert len(simulate(s, 0).violations) > 0


def test_edge_first_then_spill_on_load_and_model_absence() -> None:
    light = simulate(scenario_from_dict(small(rate_per_s=2)), 0)
    assert light.tier["edge"] == light.outcomes["done"]  # the edge's small model takes everything
    heavy = simulate(scenario_from_dict(small(rate_per_s=50, prompt_tokens=200)), 0)
    assert heavy.tier["edge"] > 0 and heavy.tier["regional"] > 0  # spill on load
    assert heavy.tier["central"] == 0  # the US central site is outside EU-only traffic's jurisdictions
    absent = simulate(scenario_from_dict(small(models=["b"])), 0)
    assert absent.tier["regional"] == absent.outcomes["done"] > 0  # the edge lacks model b


def test_disaggregated_kv_lands_in_the_decode_prefix_cache() -> None:
    sim = Simulator(scenario_from_dict(small(models=["b"], prompt_tokens=100)), 0)
    result = sim.run()
    decode = [r for r in sim.replicas if r.role == "decode"][0]
    assert result.outcomes["done"] > 5 and decode.kv_recomputed == 0
    bm = decode.scheduler.block_manager
    # every admission of a 101-token sequence (prompt + first token) follows an import of the same 101 tokens
    # (counted as a lookup with no hit); the admission then finds all 6 full blocks (96 tokens) cached
    admissions = bm.num_lookup_tokens // (2 * 101)
    assert admissions >= result.outcomes["done"] and bm.num_hit_tokens == 96 * admissions


def test_site_failure_reroutes_inside_the_jurisdiction() -> None:
    d = small(rate_per_s=50, models=["b"])
    d["sites"][0]["replicas"] = [{"model": "b", "gpu": "S"}]
    d["failures"] = [{"site": "edge", "at_s": 0.2, "duration_s": 0.5}]
    result = simulate(scenario_from_dict(d), 0)
    assert result.failures == 1 and result.retries > 0
    assert result.outcomes["done"] == result.requests and not result.violations


def test_no_live_replica_waits_then_refuses_with_reason() -> None:
    d = small(models=["b"])
    d["simulation"]["duration_s"] = 0.5
    d["routing"]["max_wait_s"] = 0.6
    d["failures"] = [{"site": "core", "at_s": 0.0, "duration_s": 10.0}]
    result = simulate(scenario_from_dict(d), 0)
    assert result.outcomes["done"] == 0
    assert any("no live replica" in reason for reason in result.refusals)


def test_scenario_errors_name_the_field(tmp_path) -> None:
    d = small()
    bad = copy.deepcopy(d)
    bad["sites"][0]["replicas"][0]["gpus"] = 3
    with pytest.raises(ScenarioError, match=r"sites\[edge\]: replicas use 3 S GPUs, the site has 1"):
        scenario_from_dict(bad)
    bad = copy.deepcopy(d)
    bad["traffic"][0]["models"] = ["nope"]
    with pytest.raises(ScenarioError, match=r"traffic\[t\]\.models: unknown model 'nope'"):
        scenario_from_dict(bad)
    bad = copy.deepcopy(d)
    bad["gpu_types"][0]["colour"] = "red"
    with pytest.raises(ScenarioError, match=r"gpu_types\[0\]: unknown field\(s\) \['colour'\]"):
        scenario_from_dict(bad)
    bad = copy.deepcopy(d)
    bad["traffic"][0]["rate_per_s"] = "fast"
    with pytest.raises(ScenarioError, match=r"rate_per_s: expected a finite number"):
        scenario_from_dict(bad)
    bad = copy.deepcopy(d)
    bad["routing"]["spill_wait_ms"] = {"edge": "soon"}
    with pytest.raises(ScenarioError, match=r"routing\.spill_wait_ms: edge = 'soon'"):
        scenario_from_dict(bad)
    bad = copy.deepcopy(d)
    bad["models"][0]["layers"] = 4000  # the weights no longer fit the 1 GB GPU
    with pytest.raises(ScenarioError, match="KV blocks"):
        Simulator(scenario_from_dict(bad), 0)
    path = tmp_path / "broken.toml"
    path.write_text("[simulation\nduration_s = 1")
    with pytest.raises(ScenarioError, match="broken.toml: not valid TOML"):
        load_scenario(path)
    path = tmp_path / "same.json"
    path.write_text(json.dumps(d))
    assert simulate(load_scenario(path), 1).event_hash == simulate(scenario_from_dict(d), 1).event_hash


def test_prefix_affinity_sends_shared_prompts_where_their_blocks_are_cached() -> None:
    def run(affinity: bool) -> tuple[int, int]:
        d = small(rate_per_s=40, models=["a"], system_prompts=3, system_prompt_tokens=64, prompt_tokens=20)
        d["sites"][0]["gpus"] = {"G": 4}
        d["sites"][0]["replicas"] = [{"model": "a", "gpu": "G", "count": 4}]
        d["routing"]["prefix_affinity"] = affinity
        d["routing"]["spill_wait_ms"] = {"edge": 1000.0}
        lines: list[str] = []

        class Sink:
            def write(self, text: str) -> None:
                lines.append(text)

        sim = Simulator(scenario_from_dict(d), 0, trace=Sink())
        sim.run()
        hits = sum(r.scheduler.block_manager.num_hit_tokens for r in sim.replicas)
        return hits, sum("prefix affinity" in json.loads(line)["reason"] for line in lines)

    hits_on, chosen_on = run(True)
    hits_off, chosen_off = run(False)
    assert chosen_off == 0 and chosen_on > 0
    assert hits_on > 1.2 * hits_off


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every place in a nested dict/list structure (for mutating one of them)."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


JUNK = st.sampled_from([None, -1, 0, 1e309, float("nan"), "x", "", True, [], {}, [1], {"a": 1}, 10**30])


@given(st.data())
def test_corrupt_scenarios_are_refused_with_a_scenario_error(data: st.DataObject) -> None:
    d = copy.deepcopy(small())
    path = data.draw(st.sampled_from(_paths(d)))
    target = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = data.draw(JUNK)
    try:
        s = scenario_from_dict(d)
    except ScenarioError:
        return
    try:
        Simulator(s, 0).run()
    except ScenarioError:
        pass
