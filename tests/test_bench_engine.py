"""The engine benchmark and the engine's GPU stage run end to end on a tiny random Llama (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from experiments import report  # noqa: E402
from experiments.engine import bench_engine, gpu_engine  # noqa: E402
from experiments.engine.stats import Job  # noqa: E402


def test_bench_engine_tiny_scores_every_system(tmp_path: Path) -> None:
    out = tmp_path / "bench_engine.json"
    result = bench_engine.main(["--tiny", "--threads", "1", "--out", str(out)])
    stored = json.loads(out.read_text())
    assert stored["figures"] == ["bench_engine.png"] and (tmp_path / "bench_engine.png").exists()
    tok_s = stored["measured"]["useful_tok_s"]
    assert set(tok_s) == {"fast_bf16", "fast_fp32", "transformers_bf16", "reference"}  # no llama_cpp here
    assert all(v > 0 for v in tok_s.values())
    assert set(stored["measured"]["transformers_by_batch"]) == {"8", "16", "32"}
    assert stored["measured"]["fast_over_transformers"] == pytest.approx(
        max(tok_s["fast_bf16"], tok_s["fast_fp32"]) / tok_s["transformers_bf16"], rel=0.01)
    assert stored["verdict"] in ("goal met", "goal missed") and result["summary"].startswith("useful tok/s")
    for system in tok_s:
        assert stored["measured"]["ttft_ms"][system]["p50"] <= stored["measured"]["ttft_ms"][system]["p99"]
    section = "\n".join(report.engine_bench_section(tmp_path))  # the paper's section, from the JSON alone
    assert f"| fast_bf16 | {tok_s['fast_bf16']:.1f} |" in section and "bench_engine.png" in section
    assert "**Rerun**" not in section and "Where the time went: fast_bf16" in stored["why"]
    (tmp_path / "bench_engine_run1.json").write_text(out.read_text())  # a second run is quoted next to the first
    section = "\n".join(report.engine_bench_section(tmp_path))
    assert "**Other run** (`bench_engine_run1.json`" in section and f"fast_bf16 {tok_s['fast_bf16']:.1f}" in section


def test_single_system_runs_merge_into_one_result(tmp_path: Path) -> None:
    for system in ("fast_bf16", "reference"):
        bench_engine.main(["--tiny", "--threads", "1", "--clock", "cpu", "--systems", system,
                           "--out", str(tmp_path / f"{system}.json")])
    merged = bench_engine.main(["--merge", str(tmp_path / "fast_bf16.json"), str(tmp_path / "reference.json"),
                                "--out", str(tmp_path / "bench_engine.json")])
    assert set(merged["measured"]["useful_tok_s"]) == {"fast_bf16", "reference"}
    assert merged["verdict"] == "not compared" and merged["setup"]["clock"] == "cpu"
    assert len(merged["setup"]["runs"]) == 2 and (tmp_path / "bench_engine.png").exists()


def test_score_counts_useful_tokens_and_refuses_a_wrong_count() -> None:
    jobs = [Job([1, 2], 2), Job([3], 1)]
    s = bench_engine.score([[0.5, 1.0], [2.0]], jobs)
    assert s["useful_tok_s"] == 1.5 and s["ttft_ms"]["p50"] == 1250 and s["itl_ms"]["p50"] == 500
    with pytest.raises(RuntimeError, match="number of tokens"):
        bench_engine.score([[0.5], [2.0]], jobs)


def test_gpu_engine_tiny_splits_the_step(tmp_path: Path) -> None:
    out = tmp_path / "gpu_engine.json"
    result = gpu_engine.main(["--tiny", "--json", str(out)])
    assert set(result["rows"]) == {"bf16", "compressed"}
    for rows in result["rows"].values():
        assert set(rows) == {"1", "4"}
        for r in rows.values():
            parts = r["model_ms"] + r["schedule_ms"] + r["step_tensors_ms"] + r["bookkeeping_ms"]
            assert parts == pytest.approx(r["step_ms"], rel=0.01, abs=0.01)
            assert 0 < r["control_share"] < 1 and r["tok_s"] > 0
    assert json.loads(out.read_text())["rows"] == result["rows"]


def test_llama_cpp_baseline_batches_and_greedy_decodes() -> None:
    """Only where llama-cpp-python is installed (an optional extra CI does not build)."""
    pytest.importorskip("llama_cpp")
    from experiments.engine.engine_baselines import run_llama_cpp
    from reference.model.tokenizer import load_tokenizer
    from reference.model.weights import packaged_path

    tok = load_tokenizer("smollm2")
    prompt = "The capital of France is"
    jobs = [Job(tok.encode(prompt), 6), Job(tok.encode("Once upon a time"), 3), Job(tok.encode(prompt), 6)]
    tokens: list[list[int]] = []
    times = run_llama_cpp(str(packaged_path("smollm2")), jobs, 1, max_seqs=2, max_batch_tokens=16, tokens=tokens)
    assert [len(t) for t in times] == [6, 3, 6] and [len(t) for t in tokens] == [6, 3, 6]
    assert all(a <= b for t in times for a, b in zip(t, t[1:], strict=False))
    assert tokens[0] == tokens[2] and "Paris" in tok.decode(tokens[0])  # same prompt, other slot: same answer


def test_repeats_alternate_and_report_every_run(tmp_path: Path) -> None:
    out = tmp_path / "bench_engine.json"
    bench_engine.main(["--tiny", "--threads", "1", "--systems", "fast_bf16", "reference", "--repeats", "2",
                       "--warmup", "--out", str(out)])
    m = json.loads(out.read_text())["measured"]
    assert {k: len(v) for k, v in m["runs"].items()} == {"fast_bf16": 2, "reference": 2}
    assert m["useful_tok_s"]["fast_bf16"] in m["runs"]["fast_bf16"]  # the median run, not an average
    assert all(c > 0 for c in m["cpu_s_per_token"].values())


def test_vllm_ratio_verdict_uses_the_spread_of_the_repeats() -> None:
    from experiments.engine.bench_engine_report import vs_vllm

    tok = {"fast_bf16": 120.0, "vllm_bf16": 100.0}
    cpu = {"fast_bf16": 0.004, "vllm_bf16": 0.008}
    met = vs_vllm({"fast_over_vllm_runs": [1.25, 1.3, 1.21]}, tok, cpu)
    assert met["verdict"] == "goal met" and met["median"] == 1.25 and met["cpu_over_vllm"] == 0.5
    assert vs_vllm({"fast_over_vllm_runs": [0.9, 1.0, 1.1]}, tok, cpu)["verdict"] == "goal missed"
    straddles = vs_vllm({"fast_over_vllm_runs": [1.1, 1.3, 1.25]}, tok, cpu)
    assert straddles["verdict"] == "inconclusive (spread 1.10-1.30)"
    assert vs_vllm({"fast_over_vllm_runs": [1.3, 1.1, 1.25]}, tok, cpu) == straddles  # order does not matter


def test_vllm_baseline_without_vllm_fails_with_its_reason(tmp_path: Path) -> None:
    """The runner process in an environment without vLLM (this one): a clear error, not a hang or a traceback."""
    import importlib.util
    import sys

    from experiments.engine.engine_baselines import run_vllm

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 128}))
    with pytest.raises(RuntimeError, match="vLLM does not import"):
        run_vllm(sys.executable, tmp_path, [Job([1, 2, 3], 2)], max_num_seqs=1, max_num_batched_tokens=64,
                 timeout_s=120)
