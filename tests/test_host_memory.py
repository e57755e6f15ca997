"""fast/engine/host_memory.py: freed activations are reused instead of faulted in again (counted in fresh processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# 20 rounds of a prefill layer's temporaries (2048 rows of SmolLM2: the residual, the norm's output, q/k/v, the
# attention output, gate/up, silu's output), alive together, written and freed; minor page faults counted
SCRIPT = """
import json, resource, sys
import torch
from fast.engine.host_memory import keep_freed_memory
tuned = keep_freed_memory() if sys.argv[1] == "1" else False
SIZES = [(2048, 576, torch.float32), (2048, 576, torch.bfloat16), (2048, 960, torch.bfloat16),
         (2048, 576, torch.bfloat16), (2048, 3072, torch.bfloat16), (2048, 1536, torch.bfloat16)]
def layer():
    return [torch.empty(n, m, dtype=dt).fill_(1) for n, m, dt in SIZES]
layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    layer()
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def faults(tune: bool, env: dict[str, str] | None = None) -> dict[str, object]:
    """Run SCRIPT in a fresh process. glibc's default policy adapts (the mmap threshold rises to the largest block
    freed; the heap top is given back only if nothing was allocated above it), so without the tuning the count
    depends on what the process did before (9,000 to 124,000 faults here, with the environment). The process
    starts with glibc's static default instead (a 128 KiB mmap threshold, fixed: every larger block is mapped
    afresh), the same for both runs, so the untuned count is the worst case and does not drift with the
    environment; ``keep_freed_memory`` must override it."""
    base = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, "1" if tune else "0"], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={**base, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=120)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_are_reused_not_faulted_again() -> None:
    plain, tuned = faults(False), faults(True)
    if not tuned["tuned"]:
        pytest.skip("mallopt not available (not glibc)")
    # 20 x 31 MiB = ~160,000 pages: without the tuning most are faulted in again, with it hardly any
    assert int(plain["faults"]) > 20_000, plain
    assert int(tuned["faults"]) < 5_000, tuned


def test_switch_off() -> None:
    assert faults(True, {"UNFIRE_MALLOC_TUNE": "0"})["tuned"] is False


def test_cpu_runner_tunes() -> None:
    """The fast engine's runner on a CPU asks for it (every entry point of the engine builds one)."""
    from fast.engine import host_memory
    from fast.engine.model import TorchLlama
    from fast.engine.torch_runner import TorchRunner
    from tests.tiny_llama import CONFIG, tiny_weights

    host_memory._done.clear()
    TorchRunner(TorchLlama(CONFIG, tiny_weights(), dtype="bfloat16"), num_blocks=4)
    assert "ok" in host_memory._done
