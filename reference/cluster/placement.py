"""Non-uniform pipeline placement: contiguous layer ranges over a chain of unlike GPUs.

A chain is a list of GPUs in pipeline order; stage ``k`` runs on GPU ``k`` and holds layers
``bounds[k] .. bounds[k+1] - 1`` (every stage at least one layer). The first stage also holds the
embedding, the last the output head. A stage's time per micro-batch is its layers' time on its GPU,
plus the head on the last stage, plus sending the activations to the next GPU (NVLink inside a
node, the network between nodes). In steady state a pipeline delivers one micro-batch per
*slowest* stage time, so the best split minimises the bottleneck, subject to each stage's memory
(weights + a KV reserve per layer) fitting its GPU.

``best_split`` finds it exactly by dynamic programming over (stage, layers placed so far):

    f[k][j] = min over i < j of max(f[k-1][i], time of stage k holding layers i .. j-1)

``brute_force_split`` tries every split (for checking); ``uniform_split`` gives every GPU the same
number of layers (the baseline); ``lp_upper_bound`` relaxes layer counts to real numbers and solves
a linear program (scipy) over a pool of chains: an upper bound on what any split can reach.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

INF = float("inf")


class PlacementError(ValueError):
    """A placement problem that is malformed (no GPUs, fewer layers than stages, ...)."""


@dataclass(frozen=True)
class Problem:
    """A pipeline placement problem in plain numbers (seconds and bytes)."""

    layer_time: tuple[tuple[float, ...], ...]  # [gpu k][layer i]: seconds of layer i on gpu k
    layer_mem: tuple[float, ...]  # bytes of layer i (weights + KV reserve)
    capacity: tuple[float, ...]  # bytes usable on gpu k
    first_mem: float = 0.0  # embedding, on the first stage
    last_mem: float = 0.0  # output head, on the last stage
    last_time: tuple[float, ...] = ()  # [gpu k]: seconds of the head if gpu k runs the last stage
    comm_time: tuple[float, ...] = ()  # [gpu k]: seconds to send activations from gpu k to gpu k+1

    def __post_init__(self) -> None:
        k, n = len(self.capacity), len(self.layer_mem)
        if k < 1 or n < k:
            raise PlacementError("need at least one GPU and at least as many layers as GPUs; got "
                                 f"{k} GPUs, "
                                 f"{n} layers")
        if len(self.layer_time) != k or any(len(row) != n for row in self.layer_time):
            raise PlacementError("layer_time must have one row per GPU and one entry per layer")
        if (
            self.last_time
            and len(self.last_time) != k
            or self.comm_time
            and len(self.comm_time) != k
        ):
            raise PlacementError("last_time and comm_time need one entry per GPU")

    @property
    def num_gpus(self) -> int:
        return len(self.capacity)

    @property
    def num_layers(self) -> int:
        return len(self.layer_mem)

    def stage_time(self, k: int, i: int, j: int) -> float:
        """Seconds of stage k holding layers i .. j-1, or INF if they do not fit its memory."""
        last = k == self.num_gpus - 1
        mem = (
            sum(self.layer_mem[i:j])
            + (self.first_mem if k == 0 else 0.0)
            + (self.last_mem if last else 0.0)
        )
        if mem > self.capacity[k]:
            return INF
        t = sum(self.layer_time[k][i:j])
        if last and self.last_time:
            t += self.last_time[k]
        if not last and self.comm_time:
            t += self.comm_time[k]
        return t

    def bottleneck(self, bounds: Sequence[int]) -> float:
        """The slowest stage's time for a split given by its boundaries (0 = b_0 < ... < b_K =
        layers)."""
        return max(self.stage_time(k, bounds[k], bounds[k + 1]) for k in range(self.num_gpus))


@dataclass(frozen=True)
class Split:
    bounds: tuple[int, ...]  # stage k holds layers bounds[k] .. bounds[k+1]-1
    bottleneck_s: float  # INF: no split fits

    @property
    def feasible(self) -> bool:
        return self.bottleneck_s < INF

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False))


def best_split(p: Problem) -> Split:
    """The split with the smallest bottleneck (exact dynamic programming, O(GPUs x layers^2))."""
    K, L = p.num_gpus, p.num_layers
    # f[k][j]: best bottleneck of stages 0..k-1 over layers 0..j-1
    f = [[INF] * (L + 1) for _ in range(K + 1)]
    arg = [[-1] * (L + 1) for _ in range(K + 1)]
    f[0][0] = 0.0
    for k in range(1, K + 1):
        for j in range(k, L - (K - k) + 1):  # leave at least one layer for every later stage
            for i in range(k - 1, j):
                if f[k - 1][i] == INF:
                    continue
                value = max(f[k - 1][i], p.stage_time(k - 1, i, j))
                if value < f[k][j]:
                    f[k][j], arg[k][j] = value, i
    if f[K][L] == INF:
        return Split(tuple(), INF)
    bounds, j = [L], L
    for k in range(K, 0, -1):
        j = arg[k][j]
        bounds.append(j)
    return Split(tuple(reversed(bounds)), f[K][L])


def brute_force_split(p: Problem) -> Split:
    """Every split tried (C(layers-1, GPUs-1) of them): the check for ``best_split``."""
    best = Split(tuple(), INF)
    for cuts in itertools.combinations(range(1, p.num_layers), p.num_gpus - 1):
        bounds = (0, *cuts, p.num_layers)
        value = p.bottleneck(bounds)
        if value < best.bottleneck_s:
            best = Split(bounds, value)
    return best


def uniform_split(p: Problem) -> Split:
    """Equal layer counts (the first ``layers % GPUs`` stages get one more): the baseline."""
    q, r = divmod(p.num_layers, p.num_gpus)
    bounds = [0]
    for k in range(p.num_gpus):
        bounds.append(bounds[-1] + q + (1 if k < r else 0))
    return Split(tuple(bounds), p.bottleneck(bounds))


def lp_upper_bound(problems: Sequence[Problem]) -> float:
    """Upper bound on the summed throughput (micro-batches/s) of a pool of chains, from a linear
    program.

    Layer counts become real numbers: per chain, throughput tau, and z_k = tau * (layers on gpu k).
    Then sum_k z_k = L tau (every layer placed), z_k >= tau (a layer at least), and per GPU
    z_k * t_k + tau * (fixed time of stage k) <= 1 (busy at most all the time) and
    z_k * m <= tau * (memory left for layers). With t_k the GPU's fastest layer and m the smallest
    layer, any integer split is a feasible point, so the optimum bounds every real split from above.
    """
    try:
        from scipy.optimize import linprog
    except ImportError:
        raise PlacementError("the LP upper bound needs scipy: pip install 'scipy>=1.11' (in the "
                             "[experiments] "
                             "extra)") from None

    bound = 0.0
    for p in problems:
        K, L = p.num_gpus, p.num_layers
        t = [min(row) for row in p.layer_time]
        m = min(p.layer_mem)
        # variables: z_0 .. z_{K-1}, tau
        c = [0.0] * K + [-1.0]
        a_ub, b_ub = [], []
        for k in range(K):
            fixed = (p.last_time[k] if p.last_time and k == K - 1 else 0.0) + \
                (p.comm_time[k] if p.comm_time and k < K - 1 else 0.0)
            free = (
                p.capacity[k]
                - (p.first_mem if k == 0 else 0.0)
                - (p.last_mem if k == K - 1 else 0.0)
            )
            row = [0.0] * (K + 1)
            row[k], row[K] = t[k], fixed
            a_ub.append(row), b_ub.append(1.0)
            row = [0.0] * (K + 1)
            row[k], row[K] = m, -free
            a_ub.append(row), b_ub.append(0.0)
            row = [0.0] * (K + 1)
            row[k], row[K] = -1.0, 1.0
            a_ub.append(row), b_ub.append(0.0)
        a_eq = [[1.0] * K + [-float(L)]]
        res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=[0.0], bounds=[(0, None)] * (K + 1),
                      method="highs")
        if res.status == 0:
            bound += -res.fun
        elif res.status != 2:  # 2: infeasible, this chain contributes nothing
            raise PlacementError(f"linear program failed: {res.message}")
    return bound
