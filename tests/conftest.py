"""Test configuration: the slow-test sample, and hypothesis profiles.

Tests marked ``slow`` are sampled: by default a deterministic third of them runs (chosen by a hash
of the test id, so the same ones run every time). ``UNFIRE_SLOW=all`` runs all, ``none`` none.
"""

from __future__ import annotations

import importlib.util
import os
import zlib

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mode = os.environ.get("UNFIRE_SLOW", "sample")
    for item in items:
        if "slow" not in item.keywords or mode == "all":
            continue
        if mode == "none" or zlib.crc32(item.nodeid.encode()) % 3 != 0:
            item.add_marker(pytest.mark.skip(reason=f"slow test not in the sample (UNFIRE_SLOW={mode})"))
