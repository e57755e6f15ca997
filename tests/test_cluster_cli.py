"""The cluster commands, and the simulator's timing on a case worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reference.cluster import Simulator, scenario_from_dict
from reference.cluster.__main__ import main
from reference.cluster.randomized import random_scenario_dict


def one_replica(**traffic: object) -> dict:
    d = random_scenario_dict(np.random.default_rng(0))
    d["failures"] = []
    d["sites"] = [{"name": "host", "tier": "edge", "jurisdiction": "EU", "gpus": {"G": 1},
                   "replicas": [{"model": "a", "gpu": "G"}]}]
    d["links"] = []
    d["traffic"] = [{"name": "t", "origins": ["host"], "rate_per_s": 5, "models": ["a"], "allowed": ["EU"],
                     "lengths": "fixed", "prompt_tokens": 40, "output_tokens": 3, **traffic}]
    return d


def test_replayed_request_timing_by_hand() -> None:
    """One request of 32 prompt tokens and 3 outputs, every step 0.1 s: the prefill step samples the first
    token at 0.1 s, two decode steps follow; the user is 10 ms away (20 ms last-mile round trip)."""
    s = scenario_from_dict(one_replica(access_rtt_ms=20.0))
    sim = Simulator(s, 0, cost_override=lambda shape: 0.1, replay=[(1.0, list(range(32)), 3)], record_gaps=True)
    r = sim.run()
    assert r.requests == 1 and r.outcomes["done"] == 1
    assert r.ttft == [pytest.approx(0.1 + 0.02)]  # up 10 ms, one step, down 10 ms
    assert r.e2e == [pytest.approx(0.3 + 0.02)]
    assert r.gaps == [pytest.approx(0.1), pytest.approx(0.1)]


def test_simulate_command_writes_summary_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "s.json"
    scenario.write_text(json.dumps(one_replica()))
    out, trace = tmp_path / "out.json", tmp_path / "trace.jsonl"
    assert main(["simulate", str(scenario), "--seed", "2", "--json", str(out), "--trace", str(trace)]) == 0
    summary = json.loads(out.read_text())
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert summary["requests"] == len(lines) > 0 and summary["seed"] == 2
    assert {"origin", "allowed", "prefill_site", "prefill_jurisdiction", "decode_site", "decode_jurisdiction",
            "reason"} <= set(lines[0])
    assert main(["simulate", str(scenario), "--seed", "2"]) == 0
    assert json.loads(capsys.readouterr().out.split("\n}\n")[-2] + "\n}")["event_log_hash"] == \
        summary["event_log_hash"]


def test_place_command_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = "reference/cluster/examples/two_regions.toml"
    assert main(["place", example, "--model", "llama-8b", "--chain", "H100,L4", "--nodes", "0,1",
                 "--chain", "L4,L4", "--brute-force"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["brute_force_agrees"] for c in out["chains"]] == [True, True]
    assert out["pool_best_tokens_per_s"] <= out["pool_lp_upper_bound_tokens_per_s"] * (1 + 1e-9)
    assert main(["place", example, "--model", "llama-8b", "--chain", "H100,TPU"]) == 2
    assert "unknown GPU type(s) ['TPU']" in capsys.readouterr().err
    assert main(["place", example, "--model", "llama-8b", "--chain", "H100,L4", "--nodes", "0,x"]) == 2
    assert "node ids must be integers" in capsys.readouterr().err
    missing = tmp_path / "nope.toml"
    assert main(["simulate", str(missing)]) == 2
    assert "cannot read scenario" in capsys.readouterr().err
