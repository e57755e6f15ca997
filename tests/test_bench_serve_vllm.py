"""experiments/engine/bench_serve_vllm.py without servers: its workload file, the agreement and medians, its options.

The benchmark itself starts servers (and vLLM, from an environment of its own): it is run by hand,
never in CI. These check the parts that decide what it measures.
"""

from __future__ import annotations

import json

import pytest

from experiments.engine.bench_serve_vllm import (
    agreement,
    medians,
    parse_args,
    parse_setting,
    random_prompts,
    split_gather,
    write_prompt_file,
)
from serve.bench import file_prompts
from tests.smollm import smollm2_tokenizer


def test_both_load_generators_read_the_same_prompts(tmp_path):
    tok = smollm2_tokenizer()
    prompts = random_prompts(tok, 3, 40, seed=5)
    assert prompts == random_prompts(tok, 3, 40, seed=5) and prompts != random_prompts(tok, 3, 40, seed=6)
    assert all(30 <= len(tok.encode(p)) <= 60 for p in prompts)  # random ids re-encode to about as many
    path = write_prompt_file(prompts, tmp_path / "p.json")
    data = json.loads(path.read_text())  # vLLM's sharegpt loader: >= 2 turns, the first one's "value"
    assert [d["conversations"][0]["value"] for d in data] == prompts and all(len(d["conversations"]) >= 2 for d in data)
    assert file_prompts(path, 3, 10**6) == prompts and file_prompts(path, 2, 5) == [p[:5] for p in prompts[:2]]
    with pytest.raises(SystemExit, match="3 prompts"):
        file_prompts(path, 4, 100)
    (tmp_path / "bad.json").write_text('[{"conversations": []}]')
    with pytest.raises(SystemExit, match="entry 0"):
        file_prompts(tmp_path / "bad.json", 1, 100)


def _summary(tok_s: float, ttft: float, itl99: float) -> dict:
    dist = {"p50": ttft, "p99": 2 * ttft}
    return {"output_throughput_tok_s": tok_s, "ttft_ms": dist, "tpot_ms": dist, "itl_ms": {"p50": 10.0, "p99": itl99}}


def test_agreement_and_medians():
    a, b = _summary(100.0, 200.0, 50.0), _summary(110.0, 190.0, 55.0)
    got = agreement(a, b)
    assert got["output_throughput_tok_s"] == 1.1 and got["ttft_ms.p50"] == 0.95 and got["itl_ms.p99"] == 1.1
    runs = {"ours@256": [{"passes": [{"client": "serve.bench", "summary": s, "server_cpu_ms_per_output_token": c}]}
                         for s, c in ((a, 4.0), (b, 6.0), (_summary(120.0, 100.0, 70.0), 5.0))]}
    med = medians(runs)["ours@256"]["serve.bench"]
    assert med["output_throughput_tok_s"] == 110.0 and med["ttft_ms.p50"] == 190.0
    assert med["server_cpu_ms_per_output_token"] == 5.0


def test_options(monkeypatch):
    monkeypatch.delenv("UNFIRE_VLLM_PYTHON", raising=False)
    a = parse_args(["--ours", "256, 2048/256", "--cpus", "0"])
    assert a.ours == ["256", "2048/256"] and a.vllm_python is None  # without vLLM: only our server runs
    assert [parse_setting(x) for x in ("2048", "2048/256", "2048//1024", "2048/256/512")] == [
        (2048, None, None), (2048, 256, None), (2048, None, 1024), (2048, 256, 512)]
    assert split_gather("2048/256+g30") == ("2048/256", 30.0) and split_gather("2048") == ("2048", None)
    for bad in (["--ours", "256/x"], ["--ours", "0"], ["--num-prompts", "0"], ["--vllm-python", "/no/such/python"],
                ["--ours", "2048//0"], ["--ours", "2048/1/2/3"], ["--ours", "/256"], ["--ours", "2048+g0"],
                ["--ours", "2048+gx"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_burst_policy_figure_and_table(tmp_path):
    """burst_policy_figure: one point per setting and client, the README's table with each setting's label."""
    from experiments.engine.burst_policy_figure import figure, table

    def med(tps, ttft, itl):
        return {"output_throughput_tok_s": tps, "ttft_ms.p50": ttft, "itl_ms.p50": 40.0, "itl_ms.p99": itl,
                "server_cpu_ms_per_output_token": 5.0}

    both = ("serve.bench", "vllm bench serve")
    result = {"setup": {"workload": "w", "servers_on_cpus": "0", "repeats": 1, "passes": 1, "commit": "c",
                        "ours": {"2048//1024": {"max_num_batched_tokens": 2048, "max_prefill_tokens_with_decodes": None,
                                                "decode_stall_budget": 1024},
                                 "2048/256": {"max_num_batched_tokens": 2048, "max_prefill_tokens_with_decodes": 256,
                                              "decode_stall_budget": None},
                                 "2048/256+g100": {"max_num_batched_tokens": 2048,
                                                   "max_prefill_tokens_with_decodes": 256,
                                                   "decode_stall_budget": None, "burst_gather_ms": 100.0}}},
              "median": {"ours@2048//1024": {c: med(180.0, 950.0, 120.0) for c in both},
                         "ours@2048/256": {c: med(150.0, 1150.0, 230.0) for c in both},
                         "ours@2048/256+g100": {c: med(160.0, 1200.0, 75.0) for c in both},
                         "vllm@2048": {c: med(170.0, 1000.0, 80.0) for c in both}},
              "runs": {"ours@2048//1024": [{"passes": [{"load_average": [1.0, 2.0]}]}]}}
    assert figure(result, tmp_path / "f.png").stat().st_size > 0
    rows = table(result).splitlines()
    assert "S=1024" in rows[2] and "180.0 / 180.0" in rows[2] and "cap 256" in rows[3] and "vLLM" in rows[5]
    assert "cap 256, gather 100 ms" in rows[4]
