"""Test configuration: the slow-test sample, and hypothesis profiles.

Tests marked ``slow`` are sampled: by default a third of them runs, and which third rotates with the
commit: a slow test runs when ``crc32(test id) % 3 == (number of commits in HEAD's history) % 3``, so
any three consecutive commits run every slow test between them. ``UNFIRE_SLOW=all`` runs all, ``none``
none; ``UNFIRE_SLOW_ROUND=N`` picks the round by hand (e.g. to run the third a given commit skips).
Where the round cannot be read (no git, or a shallow clone whose history is cut), every slow test runs.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Triton kernels (fast/) run in Triton's interpreter where there is no GPU. triton reads the variable
# when it is imported, so it is set here, before any test module imports triton.
if "TRITON_INTERPRET" not in os.environ and importlib.util.find_spec("torch") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


SLOW_ROUNDS = 3  # every slow test runs once in any SLOW_ROUNDS consecutive commits
REPO = Path(__file__).resolve().parent.parent


@functools.cache
def slow_round() -> int | None:
    """Which third of the slow tests runs: from UNFIRE_SLOW_ROUND, else HEAD's commit count; None: unknown."""
    if os.environ.get("UNFIRE_SLOW_ROUND"):
        return int(os.environ["UNFIRE_SLOW_ROUND"]) % SLOW_ROUNDS
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

        if git("rev-parse", "--is-shallow-repository") != "false":
            return None
        return int(git("rev-list", "--count", "HEAD")) % SLOW_ROUNDS
    except (OSError, ValueError, subprocess.CalledProcessError):
        return None


def in_slow_sample(nodeid: str, round_: int | None) -> bool:
    """True if the slow test ``nodeid`` runs in this round (every test runs in exactly one of the rounds)."""
    return round_ is None or zlib.crc32(nodeid.encode()) % SLOW_ROUNDS == round_


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mode = os.environ.get("UNFIRE_SLOW", "sample")
    for item in items:
        if "slow" not in item.keywords or mode == "all":
            continue
        if mode == "none" or not in_slow_sample(item.nodeid, slow_round()):
            item.add_marker(pytest.mark.skip(reason=f"slow test not in this commit's third (round {slow_round()}; "
                                                    f"UNFIRE_SLOW=all runs every one)"))


def pytest_report_header(config: pytest.Config) -> str:
    mode = os.environ.get("UNFIRE_SLOW", "sample")
    return f"slow tests: UNFIRE_SLOW={mode}, round {slow_round()} of {SLOW_ROUNDS} (None: all run)"
