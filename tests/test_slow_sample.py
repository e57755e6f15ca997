"""The slow-test sample rotates with the commit: any three consecutive commits run every slow test."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import SLOW_ROUNDS, in_slow_sample


@given(nodeid=st.text(min_size=1, max_size=80), commits=st.integers(0, 10**6))
def test_three_consecutive_commits_run_every_slow_test(nodeid: str, commits: int) -> None:
    rounds = [(commits + k) % SLOW_ROUNDS for k in range(SLOW_ROUNDS)]
    assert sum(in_slow_sample(nodeid, r) for r in rounds) == 1


def test_unknown_round_runs_everything() -> None:
    assert in_slow_sample("tests/test_x.py::test_y", None)
