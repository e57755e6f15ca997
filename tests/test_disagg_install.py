"""The decode worker installs received KV from a queue while sequences run: same tokens, bounded stalls."""

from __future__ import annotations

import numpy as np
import pytest

from reference.disagg.decode import DecodeWorker
from reference.disagg.models import load_model
from reference.disagg.pool import FAST_FAULTS, InProcessPool, WorkerOptions
from reference.engine.engine import Engine
from reference.engine.params import SamplingParams


def two_waves(share: float) -> tuple[list[list[int]], dict[str, int], list[list[int]]]:
    """Wave 1 starts decoding; wave 2 arrives while it runs (its KV lands among running sequences)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 128, size=int(rng.integers(20, 60))).tolist() for _ in range(8)]
    opts = WorkerOptions(num_blocks=256, block_size=8, install_share=share, **FAST_FAULTS)
    with InProcessPool("tiny", 1, 1, opts=opts) as pool:
        coord = pool.coordinator
        decode = next(w for w, _ in pool.workers.values() if isinstance(w, DecodeWorker))
        for i, p in enumerate(prompts[:4]):
            coord.submit(f"a{i}", p, 30)
        while not decode.scheduler.running:
            pool.pump()
        for i, p in enumerate(prompts[4:]):
            coord.submit(f"b{i}", p, 30)
        while coord.unfinished():
            pool.pump()
        outs = [coord.requests[k].result["output_token_ids"] for k in [f"a{i}" for i in range(4)] +
                [f"b{i}" for i in range(4)]]
        counters = dict(decode.counters)
    return outs, counters, prompts


@pytest.mark.parametrize("share", [0.25, 0.0])
def test_queued_install_gives_the_colocated_tokens(share: float) -> None:
    outs, counters, prompts = two_waves(share)
    engine = Engine(load_model("tiny"), num_blocks=256, block_size=8)
    expected = [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=30))]
    assert outs == expected
    assert counters["kv_digest_match"] == 8 and counters.get("prefills_recomputed", 0) == 0
    assert counters["kv_install_us"] > 0 and counters["decode_steps"] > 0
    if share:  # wave 2's frames waited in the queue instead of stalling wave 1's next step
        assert counters["kv_install_deferred"] > 0
    else:
        assert "kv_install_deferred" not in counters
