"""Step cost accounting, the fitted step-time model, and the simulated-time driver."""

from __future__ import annotations

import numpy as np

from reference.engine.cost import StepShape, StepTimeModel, intensity, step_bytes, step_flops
from reference.engine.simulate import SimRequest, service_share, simulate
from reference.model.config import LLAMA_3_1_8B, LlamaConfig
from reference.sched import FCFS, Tenants, make_policy

TINY = LlamaConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4, max_position=64, tie_embeddings=True)


def test_flops_and_bytes_by_hand():
    s = StepShape(new_tokens=(3, 1), context_lens=(3, 5), num_sampled=2)
    assert s.attention_pairs() == (1 + 2 + 3) + 5
    per_token = 2 * 4 * (2 * 4 + 2 * 2) + 2 * 3 * 4 * 6  # q,o: 4x4; k,v: 4x2; gate/up/down: 4x6
    assert step_flops(TINY, s) == 2 * (4 * per_token + 4 * 2 * 2 * 11) + 2 * 2 * 4 * 10
    weights = 2 * (4 * 4 * 2 + 4 * 2 * 2 + 3 * 4 * 6 + 2 * 4) * 2  # layers x params x 2 bytes
    kv = 2 * 2 * 1 * 2 * 2  # layers x (K and V) x kv_heads x head_dim x 2 bytes, per token
    assert step_bytes(TINY, s) == weights + 4 * 4 * 2 + 10 * 4 * 2 + kv * (0 + 4) + kv * 4


def test_prefill_is_more_intense_than_decode():
    prefill = StepShape((512,), (512,), 1)
    decode = StepShape((1,) * 8, (600,) * 8, 8)
    assert intensity(LLAMA_3_1_8B, prefill) > 300 > 10 > intensity(LLAMA_3_1_8B, decode)


def test_step_time_model_recovers_its_coefficients():
    rng = np.random.default_rng(0)
    truth = StepTimeModel(0.05, 0.002, 1e-6, 0.003)
    shapes = [StepShape(tuple(rng.integers(1, 50, size=k)), tuple(rng.integers(50, 200, size=k)), int(k))
              for k in rng.integers(1, 8, size=60)]
    fitted = StepTimeModel.fit(shapes, [truth(s) for s in shapes])
    assert np.allclose([fitted.base, fitted.per_token, fitted.per_pair, fitted.per_sample],
                       [truth.base, truth.per_token, truth.per_pair, truth.per_sample], rtol=1e-6)


def test_simulation_finishes_everything_and_shares_follow_weights():
    plans = {"p": "paid", "f": "free"}
    tenants = Tenants(plans, {"paid": 3.0, "free": 1.0})
    reqs = [SimRequest(0.0, 20, 10, "p" if i % 2 else "f") for i in range(60)]
    steps = simulate(reqs, make_policy("wfq", tenants), StepTimeModel(0.01, 0.001, 0, 0), num_blocks=64,
                     block_size=8, max_num_batched_tokens=64, max_num_seqs=4, tenants=tenants)
    assert all(len(r.token_times) == 10 and r.finish == r.token_times[-1] for r in reqs)
    assert all(r.ttft > 0 for r in reqs)
    share = service_share(steps, 0.0, steps[len(steps) // 3].start)  # both backlogged early on
    assert abs(share["p"] - 0.75) < 0.1
    fcfs = [SimRequest(r.arrival, r.prompt_len, r.output_len, r.tenant) for r in reqs]
    simulate(fcfs, FCFS(), StepTimeModel(0.01, 0.001, 0, 0), num_blocks=64, block_size=8,
             max_num_batched_tokens=64, max_num_seqs=4)
    assert all(r.finish is not None for r in fcfs)


def test_step_time_model_fits_the_extra_cost_of_multi_token_steps():
    """One-token steps run matrix-vector kernels, larger ones matrix-matrix: a fixed extra the fit finds."""
    rng = np.random.default_rng(1)
    truth = StepTimeModel(0.04, 0.0025, 2e-6, 0.004, multi_token=0.05)
    shapes = [StepShape((1,), (int(c),), 1) for c in rng.integers(10, 100, size=20)]
    shapes += [StepShape(tuple(rng.integers(1, 40, size=k)), tuple(rng.integers(50, 200, size=k)), int(k))
               for k in rng.integers(2, 6, size=40)]
    fitted = StepTimeModel.fit(shapes, [truth(s) for s in shapes])
    assert np.isclose(fitted.multi_token, 0.05, rtol=1e-6) and np.isclose(fitted.base, 0.04, rtol=1e-6)
    assert truth(StepShape((1,), (10,), 1)) + 0.05 < truth(StepShape((1, 1), (10, 10), 2))
    only_large = [s for s in shapes if s.num_tokens > 1]  # base and the extra cannot be told apart: not fitted
    assert StepTimeModel.fit(only_large, [truth(s) for s in only_large]).multi_token == 0.0
