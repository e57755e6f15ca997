"""Pipeline placement: the DP is exact (equals brute force), the LP bounds it, bad input is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.cluster.pipeline import ChainGpu, chain_problem, tokens_per_s
from reference.cluster.placement import (
    INF,
    PlacementError,
    Problem,
    best_split,
    brute_force_split,
    lp_upper_bound,
    uniform_split,
)
from reference.cluster.scenario import GpuType, ModelSpec
from reference.engine.cost import StepShape

H100 = GpuType("H100", 80, 989, 3.35)
A100 = GpuType("A100", 80, 312, 2.0)
L4 = GpuType("L4", 24, 121, 0.3)
LLAMA_70B = ModelSpec("llama-70b", 80, 8192, 28672, 64, 8, 128, 128256)
DECODE = StepShape((1,) * 64, (1024,) * 64, 64)


@st.composite
def problems(draw: st.DrawFn, same_layers: bool = False) -> Problem:
    k = draw(st.integers(1, 4))
    n = draw(st.integers(k, 9))
    small = st.floats(0.1, 10, allow_nan=False)
    if same_layers:
        per_gpu = [draw(small) for _ in range(k)]
        times = tuple(tuple([t] * n) for t in per_gpu)
        mem = tuple([draw(small)] * n)
    else:
        times = tuple(tuple(draw(small) for _ in range(n)) for _ in range(k))
        mem = tuple(draw(small) for _ in range(n))
    return Problem(layer_time=times, layer_mem=mem, capacity=tuple(draw(st.floats(1, 60)) for _ in range(k)),
                   first_mem=draw(st.floats(0, 5)), last_mem=draw(st.floats(0, 5)),
                   last_time=tuple(draw(st.floats(0, 5)) for _ in range(k)),
                   comm_time=tuple(draw(st.floats(0, 3)) for _ in range(k)))


@given(problems())
def test_dp_equals_brute_force(p: Problem) -> None:
    dp, brute = best_split(p), brute_force_split(p)
    assert dp.bottleneck_s == brute.bottleneck_s
    if dp.feasible:
        assert p.bottleneck(dp.bounds) == dp.bottleneck_s and min(dp.layers) >= 1 and sum(dp.layers) == p.num_layers
        assert dp.bottleneck_s <= uniform_split(p).bottleneck_s


@given(st.lists(problems(same_layers=True), min_size=1, max_size=3))
def test_lp_bounds_every_chain_of_the_pool(pool: list[Problem]) -> None:
    exact = sum(1 / s.bottleneck_s for s in map(best_split, pool) if s.feasible)
    assert exact <= lp_upper_bound(pool) * (1 + 1e-6) + 1e-9


def test_mixed_chain_beats_uniform_and_respects_memory() -> None:
    p = chain_problem(LLAMA_70B, [ChainGpu(H100, 0), ChainGpu(A100, 0), ChainGpu(L4, 1)], DECODE, kv_tokens=16384)
    best, uniform = best_split(p), uniform_split(p)
    assert not uniform.feasible  # 27 layers of a 70B model do not fit a 24 GB L4
    assert best.feasible and best.layers[2] < best.layers[1] < best.layers[0]
    assert best == brute_force_split(p)
    assert tokens_per_s(best, DECODE) <= DECODE.num_tokens * lp_upper_bound([p]) * (1 + 1e-9)
    for k, (a, b) in enumerate(zip(best.bounds, best.bounds[1:], strict=False)):
        assert p.stage_time(k, a, b) < INF  # each stage fits its GPU


def test_bad_problems_are_refused() -> None:
    with pytest.raises(PlacementError, match="at least as many layers as GPUs"):
        Problem(layer_time=((1.0,),) * 2, layer_mem=(1.0,), capacity=(1.0, 1.0))
    with pytest.raises(PlacementError, match="one row per GPU"):
        Problem(layer_time=((1.0, 1.0),), layer_mem=(1.0, 1.0), capacity=(1.0, 1.0))
    nothing_fits = Problem(layer_time=((1.0, 1.0),), layer_mem=(5.0, 5.0), capacity=(1.0,))
    assert not best_split(nothing_fits).feasible and not brute_force_split(nothing_fits).feasible
    assert lp_upper_bound([nothing_fits]) == 0.0
