"""The simulated-time regime of E4: every request gets all its tokens in both layouts, and a decode
step of the disaggregated layout never carries a prefill (its gaps stay near one decode step)."""

from __future__ import annotations

import numpy as np

from experiments.disagg.disagg_sim import Gpu, SimReq, colocated, disaggregated, roofline
from reference.engine.cost import StepShape
from reference.model.config import LLAMA_3_1_8B


def requests(seed: int) -> list[SimReq]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(0.05, 40))
    return [SimReq(float(a), int(rng.integers(200, 6000)), int(rng.integers(2, 60))) for a in arrivals]


def test_both_layouts_serve_every_token_and_disaggregation_removes_prefill_from_decode_steps():
    gpu = Gpu()
    decode_step = roofline(LLAMA_3_1_8B, gpu)(StepShape((1,) * 64, (6000,) * 64, 64))
    worst = {}
    for layout in (disaggregated, colocated):
        reqs = requests(0)
        layout(reqs, LLAMA_3_1_8B, gpu)
        assert all(len(r.token_times) == r.output_len for r in reqs)
        assert all(r.token_times[0] > r.arrival and np.all(np.diff(r.token_times) > 0) for r in reqs)
        gaps = np.concatenate([np.diff(r.token_times) for r in reqs])
        worst[layout] = gaps.max()
    assert worst[disaggregated] <= decode_step * 1.01  # a largest decode batch at the longest context, no more
    assert worst[colocated] > 2 * worst[disaggregated]  # some colocated gaps carry a 2048-token prefill chunk
