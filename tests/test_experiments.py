"""The reproduction runner: discovery, the table, result files, and the U1 experiment end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments import report
from experiments.__main__ import main
from experiments.claims import CLAIM_IDS, claim
from experiments.registry import Context, Result, clock_problem, discover


def test_every_claim_of_claims_md_has_a_row() -> None:
    text = (Path(__file__).resolve().parents[2] / "shared" / "CLAIMS.md")
    if text.is_file():
        ids = [line.split("|")[1].strip() for line in text.read_text().splitlines()
               if line.startswith("| ") and line.split("|")[1].strip()[:1] in "UER"
               and line.split("|")[1].strip()[1:].isdigit()]
        assert ids == CLAIM_IDS
    with pytest.raises(KeyError, match="unknown claim"):
        claim("Z9")


def test_discovery_finds_u1_and_table_marks_the_rest() -> None:
    found = discover()
    assert "U1" in found
    rows = report.table_rows(found, results={}, ran=set())
    assert [r[0] for r in rows] == CLAIM_IDS
    for cid, *_, verdict in rows:
        assert verdict == ("not run yet" if cid in found else "not implemented yet")


def test_unknown_claim_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["reproduce", "--only", "U1,Q7"])
    assert "unknown claim id(s) Q7" in capsys.readouterr().err


def test_u1_on_minilm_end_to_end(tmp_path: Path) -> None:
    exp = discover()["U1"]
    ctx = Context(results_dir=tmp_path)
    result = exp.run(ctx)
    path = report.write_result(exp, result, full=False, seconds=1.0, results_dir=tmp_path)
    record = json.loads(path.read_text())
    for key in ("claim", "setup", "measured", "article", "verdict"):
        assert key in record
    assert {"weights", "workload", "machine", "commit"} <= set(record["setup"])
    minilm, smol = record["measured"]["weights"][:2]
    assert minilm["weights"] == "minilm" and minilm["representative"]
    assert not smol["representative"] and "4-bit" in smol["note"]
    assert 2.3 < minilm["pooled"]["exponent_bits"] < 3.0  # measured, whatever it is; sanity only
    assert minilm["pooled"]["mantissa_bits"] > 6.5
    assert (tmp_path / "U1.png").stat().st_size > 10_000
    out = report.build_paper({"U1": exp}, results_dir=tmp_path, out=tmp_path / "report.md")
    assert "## U1" in out.read_text()


def _result(clock: str | None, measured: dict) -> Result:
    return Result(measured=measured, summary="s", verdict="matches", why="w", clock=clock)


def test_a_result_without_a_clock_is_refused(tmp_path: Path) -> None:
    exp = discover()["U1"]
    with pytest.raises(ValueError, match="no clock stated"):
        report.write_result(exp, _result(None, {"n": 1}), full=False, seconds=1.0, results_dir=tmp_path)
    with pytest.raises(ValueError, match="look timed.*ttft_ms"):
        report.write_result(exp, _result("none", {"runs": [{"ttft_ms": {"p50": 3.0}}]}), full=False, seconds=1.0,
                            results_dir=tmp_path)
    with pytest.raises(ValueError, match="must be one of"):
        _result("cpu", {})
    assert not (tmp_path / "U1.json").exists()


def test_the_paper_names_each_sections_clock_and_refuses_a_stored_result_without_one(tmp_path: Path) -> None:
    exp = discover()["U1"]
    timed = _result("cpu-process", {"ttft_ms": {"p50": 3.0}})
    timed.clock_detail = "1 BLAS thread"
    timed.notes = ["a caveat next to the number"]
    report.write_result(exp, timed, full=False, seconds=1.0, results_dir=tmp_path)
    text = report.build_paper({"U1": exp}, results_dir=tmp_path, out=tmp_path / "report.md").read_text()
    assert "**Clock:** cpu-process (1 BLAS thread)." in text and "**Note:** a caveat next to the number" in text
    record = json.loads((tmp_path / "U1.json").read_text())
    del record["clock"]  # a result stored before clocks existed, or written by hand
    (tmp_path / "U1.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="U1: no clock stated"):
        report.build_paper({"U1": exp}, results_dir=tmp_path, out=tmp_path / "report.md")


def test_every_stored_result_states_a_valid_clock() -> None:
    """The committed results: each names its clock (a reviewer reads no time without one)."""
    for claim_id, record in report.load_results().items():
        assert clock_problem(record.get("clock"), record.get("measured", {})) is None, claim_id


def test_paper_carries_the_fleet_table_from_its_result(tmp_path) -> None:
    import json as _json

    from experiments.report import _fleet_section

    assert _fleet_section(tmp_path) == []  # not measured: no section
    doc = {"title": "Tiered routing: sim vs fleet", "figure": "R1_fleet.png",
           "setup": {"scenario": "fleet_small.toml", "runs": 3, "weights": "tiny", "clock": "wall", "commit": "abc",
                     "date": "2026-12-01", "machine_before": {"cpu": "X", "cores": 2, "load_average": 1.0}},
           "measured": {"markdown": "| tier | share |\n|---|---|\n| edge | 70% / 57% / **55%** [51%-57%] |"}}
    (tmp_path / "R1_fleet.json").write_text(_json.dumps(doc))
    text = "\n".join(_fleet_section(tmp_path))
    assert "| edge | 70% / 57% / **55%** [51%-57%] |" in text and "median of 3 runs" in text
    assert "R1_fleet.png" in text and "commit abc" in text
