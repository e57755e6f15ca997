"""Reruns next to the stored results: runs/<date>-<commit>/, the agreement table, verdicts robust to noise."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments import report
from experiments.__main__ import main
from experiments.claims.e1_continuous_batching import ratios_of, verdict_of
from experiments.engine import agreement
from experiments.engine.stats import against, spread
from experiments.registry import RESULTS_DIR, discover
from experiments.report import PAPER, REPO, load_results

E1_STORED = json.loads((RESULTS_DIR / "E1.json").read_text())["measured"]
E1_REPEATS = [E1_STORED["runs"], *E1_STORED["repeat_runs"]]


@given(st.permutations(E1_REPEATS))
def test_e1_stored_repeats_give_one_verdict_in_any_order(order: list) -> None:
    assert verdict_of(ratios_of(order)) == verdict_of(ratios_of(E1_REPEATS))


def test_a_spread_that_straddles_its_threshold_is_inconclusive() -> None:
    assert against(spread([1.2, 1.5]), 1.0) == "clears"
    assert against(spread([0.7, 0.9]), 1.0) == "fails"
    assert against(spread([0.95, 1.05]), 1.0) == "straddles"
    assert against(spread([1.0, 1.1]), 1.0) == "clears" and against(spread([1.0, 1.1]), 1.0, strict=True) == "straddles"
    ratios = ratios_of(E1_REPEATS)  # TTFT cleared, whatever the stored repeats say
    ratios["ttft_p50_static_over_continuous"] = spread([2.0, 2.5])
    ratios["ttft_p90_static_over_continuous"] = spread([1.5, 1.6])
    ratios["itl_p50_static_over_continuous"] = spread([0.98, 1.03])
    ratios["itl_p99_static_over_continuous"] = spread([1.1, 1.2])
    assert verdict_of(ratios).startswith("inconclusive (ITL p50 ratio spread 0.98-1.03 straddles 1)")
    ratios["itl_p50_static_over_continuous"] = spread([1.01, 1.03])
    assert verdict_of(ratios) == "matches"
    ratios["ttft_p50_static_over_continuous"] = spread([0.5, 0.9])
    assert verdict_of(ratios) == "differs"


def test_r2_executed_ratio_straddling_1_is_inconclusive() -> None:
    from experiments.claims.r2_pipeline_placement import verdict_of as r2_verdict

    run = {"throughput_ratio": spread([0.95, 1.3, 1.2])}
    assert r2_verdict(True, against(run["throughput_ratio"], 1.0, strict=True), run).startswith(
        "inconclusive (executed optimal/uniform tokens/s spread 0.95-1.30 straddles 1)")
    assert r2_verdict(True, "clears", run) == "matches"
    assert r2_verdict(True, "fails", run) == r2_verdict(False, "clears", run) == "partly matches"


@given(st.lists(st.floats(0.1, 10, allow_nan=False), min_size=1, max_size=6), st.floats(0.1, 10))
def test_against_depends_on_the_spread_only(values: list[float], threshold: float) -> None:
    assert against(spread(values), threshold) == against(spread(values[::-1]), threshold)


def test_verdict_classes_and_agreement() -> None:
    assert agreement.verdict_class("partly matches (stored, 2026-12-01 @ abc)") == "partly matches"
    assert agreement.verdicts_agree("matches", "matches") == "yes"
    assert agreement.verdicts_agree("matches", "differs") == "no"
    assert agreement.verdicts_agree("matches", "inconclusive (x spread 0.9-1.1 straddles 1)") == "inconclusive"
    stored = {"headline": {"name": "r", "value": 2.0, "min": 1.8, "max": 2.2}}
    assert agreement.spread_cell(stored, {"headline": {"name": "r", "value": 2.1}}).startswith("inside")
    assert agreement.spread_cell(stored, {"headline": {"name": "r", "value": 2.5}}).startswith("outside")
    old = {"measured": {"a": spread([1.0, 1.2]), "b": {"c": spread([3.0, 3.1])}}}
    new = {"measured": {"a": spread([1.1, 1.3]), "b": {"c": spread([4.0])}}}
    assert agreement.spread_cell(old, new) == "1/2 medians inside (outside: b.c)"


def test_new_run_dir_never_reuses_a_run(tmp_path: Path) -> None:
    a, b = agreement.new_run_dir(tmp_path), agreement.new_run_dir(tmp_path)
    assert a != b and a.is_dir() and b.name == a.name + "-2"


def _fingerprint() -> dict[str, str]:
    files = sorted(RESULTS_DIR.iterdir()) + [PAPER]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.is_file()}


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout


def test_two_reruns_leave_stored_results_alone_and_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # R4: a simulated claim (deterministic, seconds); R2 now also times a real pipeline, so its headline moves
    before, status = _fingerprint(), _git_status()
    for k in (1, 2):
        assert main(["reproduce", "--only", "R4", "--out", str(tmp_path / f"run{k}")]) == 0
        out = capsys.readouterr().out
        assert "This run vs the results stored before it" in out and "1 of 1 agree" in out
        assert (tmp_path / f"run{k}" / "R4.json").is_file() and (tmp_path / f"run{k}" / "report.md").is_file()
    report_md = (tmp_path / "run1" / "report.md").read_text()
    assert "## R4" in report_md and "](./R4.png)" in report_md  # the run's own figure, linked beside it
    assert _fingerprint() == before and _git_status() == status
    r1, r2 = (json.loads((tmp_path / f"run{k}" / "R4.json").read_text()) for k in (1, 2))
    assert r1["verdict"] == r2["verdict"]
    # what each tracked part cost, so a quick size's time can be read per part
    assert [p["phase"] for p in r1["setup"]["phases"]] == ["R4 infrastructures"]
    assert 0 <= r1["setup"]["phases"][0]["cpu_seconds"] and 0 <= r1["setup"]["phases"][0]["seconds"] <= \
        r1["setup"]["seconds"]
    assert main(["compare", str(tmp_path / "run2"), "--against", str(tmp_path / "run1")]) == 0
    out = capsys.readouterr().out
    assert "R4" in out and "1 of 1 agree" in out and "the same headline" in out
    with pytest.raises(SystemExit):  # a rerun never overwrites another
        main(["reproduce", "--only", "R4", "--out", str(tmp_path / "run1")])
    assert main(["compare", str(tmp_path / "empty")]) == 2


def test_default_run_dir_is_under_runs_and_ignored_by_git() -> None:
    assert agreement.RUNS_DIR == REPO / "runs"
    probe = agreement.RUNS_DIR / "2026-01-01-abc" / "E4.json"
    assert subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=REPO).returncode == 0


NUMBER = re.compile(r"\d[\d,]*\.?\d*")


def test_stored_cells_rebuild_in_todays_wording_with_the_stored_numbers() -> None:
    """A claim's ``summarize`` restates a stored record: every number of the stored cell is still there."""
    exps, stored = discover(), load_results()
    rebuilt = [c for c, e in exps.items() if e.summarize is not None and c in stored]
    assert {"U3", "U4", "E4", "E5", "E8", "E10", "R2", "R4"} <= set(rebuilt)
    for cid in rebuilt:
        cell = exps[cid].summarize(stored[cid])  # no fallback here: every stored record carries what it reads
        assert set(NUMBER.findall(stored[cid]["summary"])) <= set(NUMBER.findall(cell)), cid


def test_u3_cell_names_the_comparable_mlp_only_saving_and_the_decoder() -> None:
    record = load_results()["U3"]
    smol = record["measured"]["models"][1]
    assert smol["weights"] == "smollm2" and smol["saving"]["mlp_only"] < smol["saving"]["all_compressible"]
    cell = discover()["U3"].summarize(record)
    assert f"MLP-only on the Llama-shaped SmolLM2* {100 * smol['saving']['mlp_only']:.1f}%" in cell
    assert "NumPy reference decoder" in cell


def test_every_speed_in_the_table_names_the_code_that_produced_it() -> None:
    code = ("NumPy", "torch", "Triton", "cuBLAS", "simulat", "roofline", "native/")  # native/: our C kernels
    speed = re.compile(r"(MB|GB|TB|tok|tokens)/s\b|\d ms\b")
    rows = report.table_rows(discover(), load_results(), ran=set())
    timed = [(cid, ours) for cid, _, _, ours, _ in rows if speed.search(ours)]
    assert {"U3", "E1", "E4", "E8", "E10", "R2"} <= {cid for cid, _ in timed}
    for cid, ours in timed:
        assert any(c in ours for c in code), f"{cid}: {ours}"


def test_the_paper_and_the_agreement_table_use_todays_wording_of_stored_numbers(tmp_path: Path) -> None:
    exps = discover()
    record = json.loads((RESULTS_DIR / "U3.json").read_text())
    (tmp_path / "U3.json").write_text(json.dumps({**record, "summary": "OLD WORDING 1.490x"}))
    paper = report.build_paper(exps, tmp_path, tmp_path / "report.md").read_text()
    assert "OLD WORDING" not in paper and "comparable with the article's 22%" in paper
    rows = agreement.agreement_rows({"U3": record}, {"U3": {**record, "summary": "OLD WORDING"}}, exps)
    assert rows[0][1] == rows[0][2] and "OLD" not in rows[0][1]
    # a record written before the claim read a field keeps its stored cell (the paper does not need a rerun)
    old = {**record, "measured": {k: v for k, v in record["measured"].items() if k != "rans_mode"}}
    assert report.summary_of(exps["U3"], {**old, "summary": "as stored"}) == "as stored"
    assert report.summary_of(exps["U1"], {**record, "summary": "as stored"}) == "as stored"  # U1: no summarize


def test_jobs_2_puts_the_claims_no_clock_enters_in_a_second_process() -> None:
    from experiments.__main__ import split_claims

    exps = discover()
    claims = [exps[c] for c in exps]
    mine, theirs = split_claims(claims, 2)
    assert {e.claim for e in theirs} == {"U1", "U2", "E2", "E7", "R1", "R3", "R4"}
    assert all(e.timed for e in mine) and {e.claim for e in mine} == {e.claim for e in claims if e.timed}
    assert [e.claim for e in mine][-3:] == ["E1", "E4", "R2"] and [e for e in mine if e.alone] == mine[-3:]  # wait
    assert split_claims(claims, 1) == (claims, [])
    assert split_claims([exps["R4"], exps["R1"]], 2) == ([exps["R4"], exps["R1"]], [])  # one kind: no second process


def test_a_second_process_writes_the_same_numbers_into_the_same_run(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--only", "R4,E6", "--jobs", "2", "--out", str(tmp_path / "two")]) == 0
    out = capsys.readouterr().out
    assert "second process: R4" in out and "[second process] == R4" in out and "2 of 2 agree" in out
    assert main(["reproduce", "--only", "R4", "--jobs", "1", "--out", str(tmp_path / "one")]) == 0
    two, one = (json.loads((tmp_path / d / "R4.json").read_text()) for d in ("two", "one"))
    assert two["measured"] == one["measured"] and (tmp_path / "two" / "E6.json").is_file()
