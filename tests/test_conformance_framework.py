"""The conformance framework itself: comparisons, selection, the CLI's exit codes and its messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fast  # noqa: F401  (switches the Triton interpreter on when there is no GPU)
from conformance.__main__ import main
from conformance.compare import compare_bounded, compare_exact
from conformance.registry import Bound, Case, Level, load_cases
from conformance.run_cases import run_case, select


def test_exact_reports_first_difference_in_hex():
    ref = np.array([[0x3F80, 0x7FC1], [0x8000, 0x0001]], dtype=np.uint16)
    fast_bits = ref.copy()
    fast_bits[1, 0] = 0x0000  # -0.0 became +0.0: a bit difference, though the values compare equal
    out = compare_exact(torch.from_numpy(fast_bits.view(np.int16)).view(torch.bfloat16), ref)
    assert not out.ok
    assert "index [1, 0]" in out.detail and "0x0000" in out.detail and "0x8000" in out.detail
    assert "1 of 4 elements differ" in out.detail


def test_exact_counts_nan_payloads():
    ref = np.array([0x7FC1], dtype=np.uint16)
    assert not compare_exact(np.array([0x7FC0], dtype=np.uint16), ref).ok
    assert compare_exact(ref.copy(), ref).ok


def test_exact_rejects_shape_and_dtype_mismatch():
    assert "shape differs" in compare_exact(np.zeros(3, np.uint16), np.zeros(4, np.uint16)).detail
    assert "dtype differs" in compare_exact(np.zeros(3, np.uint8), np.zeros(3, np.uint16)).detail


def test_bounded_checks_every_element():
    ref = np.array([1.0, 2.0, np.nan, np.inf])
    ok = compare_bounded(np.array([1.001, 2.0, np.nan, np.inf], np.float32), ref, 0.01)
    assert ok.ok and 0.09 < ok.bound_used < 0.11
    bad = compare_bounded(np.array([1.0, 2.5, np.nan, np.inf], np.float32), ref, 0.01)
    assert not bad.ok and "index [1]" in bad.detail
    assert not compare_bounded(np.array([1.0, 2.0, 0.0, np.inf]), ref, 0.01).ok  # NaN must stay NaN


def test_select_by_substring_and_glob():
    cases = load_cases()
    assert {c.name for c in select(cases, ["round_rne.SPECIAL"])} == {"bf16.round_rne.special"}
    assert len(select(cases, ["bf16.*"])) >= 2
    assert select(cases, ["no-such-case"]) == []


def test_bound_required_exactly_for_bounded_cases():
    with pytest.raises(ValueError, match="bound"):
        Case("x", Level.BOUNDED, dict, dict, dict)
    with pytest.raises(ValueError, match="bound"):
        Case("x", Level.BIT_EXACT, dict, dict, dict, bound=Bound("b", lambda i, r: r))


def test_a_crashing_kernel_is_an_error_not_a_crash():
    def boom(inputs):
        raise RuntimeError("kernel exploded")

    case = Case("t.boom", Level.BIT_EXACT, lambda g: {}, lambda i: np.zeros(1), boom)
    r = run_case(case, torch.device("cpu"), large=False)
    assert r.status == "error" and "kernel exploded" in r.detail


def test_cli_runs_and_exits_zero(capsys, tmp_path):
    out = tmp_path / "r.json"
    assert main(["--device", "cpu", "-k", "bf16.round_rne", "--json", str(out)]) == 0
    assert "passed" in capsys.readouterr().out
    assert '"passed": true' in out.read_text()


def test_cli_no_match_is_a_usage_error():
    assert main(["--device", "cpu", "-k", "no-such-case"]) == 2


def test_float_inputs_are_embedded_amid_nan_poison() -> None:
    import torch

    from conformance.poison import GUARD_CELLS, embed

    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = torch.arange(5, dtype=dtype)
        e = embed(x)
        assert e.dtype == dtype and torch.equal(e, x)
        storage = torch.empty(0, dtype=dtype).set_(e.untyped_storage(), 0, (2 * GUARD_CELLS + 5,))
        assert storage[:GUARD_CELLS].isnan().all() and storage[GUARD_CELLS + 5:].isnan().all()
