"""A chain of nodes and the split of a model's layers over it, as the placement computes it.

``--pipeline STAGES`` names the chain: a number of equal nodes (``2``: two CPU stages of one thread
each) or nodes in pipeline order, comma-separated:

    cpu            one CPU thread
    cpu:2          two CPU threads
    cpu:1x2.5      one thread, declared 2.5 times slower (the stage sleeps 1.5x its compute time
                   after each micro-batch: how this CPU machine emulates an unlike, slower node)

A node's speed is its threads divided by its slowdown (assumed linear in threads). The split comes
from ``best_split`` over one of two problems. Calibrated (the default of ``fast.pipeline``): one
layer and the output head are timed on this machine at the micro-batch shape (``calibrate`` in
``pipeline_runner.py``), and each node runs them in that time over its speed. Nominal: each node is
described to the placement model (``reference/cluster/pipeline.chain_problem``: the roofline of
``reference.engine.cost`` per layer, the output head on the last stage, activations sent to the next
stage) as a device with that share of nominal CPU rates (``CPU_TFLOPS``, ``CPU_TBPS`` per thread), all on
one host (loopback at ``LOOPBACK_GBPS``). ``best_split`` over that problem gives the layer ranges; the
same problem predicts every stage's time, which the executed pipeline measures (``experiments/edge/pipeline_exec.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reference.cluster.pipeline import ChainGpu, chain_problem
from reference.cluster.placement import Problem, Split, best_split, uniform_split
from reference.cluster.scenario import GpuType, ModelSpec
from reference.engine.cost import StepShape
from reference.model.config import LlamaConfig

CPU_TFLOPS = 0.1  # nominal bf16 FLOP/s of one CPU thread (oneDNN reaches 150-200 GFLOP/s on this project's EPYC)
CPU_TBPS = 0.008  # nominal bytes/s one thread streams from memory
LOOPBACK_GBPS = 8.0  # nominal gloo over loopback, Gbit/s
CONTEXT = 128  # context of the decode micro-batch the split is chosen for
MAX_STAGES = 16


class PipelineError(RuntimeError):
    """A pipeline that cannot be built or run: a bad chain, a stage that died, a peer that sent garbage."""


@dataclass(frozen=True)
class Node:
    kind: str = "cpu"
    threads: int = 1
    slowdown: float = 1.0  # declared: the stage sleeps (slowdown - 1) x its compute time per micro-batch

    @property
    def speed(self) -> float:
        return self.threads / self.slowdown

    def __str__(self) -> str:
        return f"{self.kind}:{self.threads}" + (f"x{self.slowdown:g}" if self.slowdown != 1 else "")


def parse_chain(spec: str) -> list[Node]:
    """``"2"`` or ``"cpu:2,cpu:1x3"`` -> nodes in pipeline order. Raises ``PipelineError`` naming the bad part."""
    spec = str(spec).strip()
    if spec.isdigit():
        n = int(spec)
        if not 2 <= n <= MAX_STAGES:
            raise PipelineError(f"--pipeline {spec}: a pipeline has 2 to {MAX_STAGES} stages")
        return [Node() for _ in range(n)]
    nodes = []
    for part in spec.split(","):
        kind, _, rest = part.strip().partition(":")
        if kind != "cpu":
            raise PipelineError(f"--pipeline node {part!r}: only 'cpu[:THREADS][xSLOWDOWN]' nodes are implemented "
                                "(GPU stages are not built yet)")
        threads, _, slow = (rest or "1").partition("x")
        try:
            node = Node("cpu", int(threads), float(slow) if slow else 1.0)
        except ValueError:
            raise PipelineError(f"--pipeline node {part!r}: expected cpu:THREADS or cpu:THREADSxSLOWDOWN, "
                                "e.g. cpu:2 or cpu:1x2.5") from None
        if not 1 <= node.threads <= 256 or not (1.0 <= node.slowdown <= 100.0):
            raise PipelineError(f"--pipeline node {part!r}: threads must be 1..256 and the slowdown 1..100")
        nodes.append(node)
    if not 2 <= len(nodes) <= MAX_STAGES:
        raise PipelineError(f"--pipeline {spec!r}: a pipeline has 2 to {MAX_STAGES} stages, got {len(nodes)}")
    return nodes


def model_spec(config: LlamaConfig, dtype: str) -> ModelSpec:
    width = 4.0 if dtype == "float32" else 2.0
    return ModelSpec(name="model", layers=config.num_layers, hidden=config.hidden_size,
                     intermediate=config.intermediate_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
                     head_dim=config.head_dim, vocab=config.vocab_size, bytes_per_param=width, kv_bytes=width)


def micro_batch_shape(max_num_seqs: int, micro_batches: int, context: int = CONTEXT) -> StepShape:
    """The decode micro-batch the split is chosen for: a full batch of decodes cut into ``micro_batches``."""
    b = max(1, math.ceil(max_num_seqs / micro_batches))
    return StepShape((1,) * b, (context,) * b, b)


def placement_problem(config: LlamaConfig, nodes: list[Node], shape: StepShape, dtype: str = "bfloat16") -> Problem:
    """The placement model's problem for this chain of CPU nodes (see the module docstring)."""
    if config.num_layers < len(nodes):
        raise PipelineError(f"a model of {config.num_layers} layers cannot fill {len(nodes)} stages")
    gpus = [ChainGpu(GpuType(name=str(n), memory_gb=1e6, peak_tflops=CPU_TFLOPS * n.speed,
                             bandwidth_tbps=CPU_TBPS * n.speed, mfu=1.0, mbu=1.0, step_overhead_ms=0.0), node=0)
            for n in nodes]
    return chain_problem(model_spec(config, dtype), gpus, shape, kv_tokens=0, intra_gbps=LOOPBACK_GBPS)


def calibrated_problem(config: LlamaConfig, nodes: list[Node], layer_s: float, head_s: float,
                       shape: StepShape) -> Problem:
    """The placement problem with measured times: one layer ``layer_s`` and the output head ``head_s`` seconds
    on one thread at the micro-batch ``shape`` (``calibrate``), divided by each node's speed; no memory limit."""
    if config.num_layers < len(nodes):
        raise PipelineError(f"a model of {config.num_layers} layers cannot fill {len(nodes)} stages")
    comm = shape.num_tokens * config.hidden_size * 4 * 8 / (LOOPBACK_GBPS * 1e9)  # float32 residual stream
    return Problem(layer_time=tuple(tuple([layer_s / n.speed] * config.num_layers) for n in nodes),
                   layer_mem=tuple([0.0] * config.num_layers), capacity=tuple([1e30] * len(nodes)),
                   last_time=tuple(head_s / n.speed for n in nodes),
                   comm_time=tuple([comm] * (len(nodes) - 1) + [0.0]))


@dataclass(frozen=True)
class Plan:
    nodes: tuple[Node, ...]
    split: Split  # what the pipeline runs
    optimal: Split  # best_split's
    uniform: Split  # the same number of layers per stage
    problem: Problem

    @property
    def bounds(self) -> tuple[int, ...]:
        return self.split.bounds

    def stage_times(self, split: Split | None = None) -> list[float]:
        """The placement model's seconds per micro-batch of every stage of ``split`` (default: the one run)."""
        b = (split or self.split).bounds
        return [self.problem.stage_time(k, b[k], b[k + 1]) for k in range(len(self.nodes))]


def plan(config: LlamaConfig, nodes: list[Node], *, max_num_seqs: int = 32, micro_batches: int = 2,
         dtype: str = "bfloat16", split: str = "optimal", calibration: tuple[float, float] | None = None) -> Plan:
    """The split to run: ``best_split``'s (``split="optimal"``), ``"uniform"``, or explicit layer counts "10,20".
    ``calibration``: measured (layer, head) seconds on one thread; without it the nominal roofline is used."""
    shape = micro_batch_shape(max_num_seqs, micro_batches)
    p = calibrated_problem(config, nodes, *calibration, shape) if calibration else \
        placement_problem(config, nodes, shape, dtype)
    optimal, uniform = best_split(p), uniform_split(p)
    if split == "optimal":
        chosen = optimal
    elif split == "uniform":
        chosen = uniform
    else:
        try:
            counts = [int(x) for x in split.split(",")]
        except ValueError:
            raise PipelineError(f"split {split!r}: 'optimal', 'uniform' or layer counts like 10,20") from None
        if len(counts) != len(nodes) or min(counts) < 1 or sum(counts) != config.num_layers:
            raise PipelineError(f"split {split!r}: need {len(nodes)} positive layer counts summing to "
                                f"{config.num_layers}")
        bounds = [0]
        for n in counts:
            bounds.append(bounds[-1] + n)
        chosen = Split(tuple(bounds), p.bottleneck(bounds))
    if not chosen.feasible:
        raise PipelineError("no split of the model fits the chain's memory")
    return Plan(tuple(nodes), chosen, optimal, uniform, p)


def predicted_bubble(stage_times: list[float], micro_batches: int) -> float:
    """Idle share of a step of ``micro_batches`` equal micro-batches through stages of these times.

    The step lasts sum(t) + (M - 1) x max(t) (the first micro-batch crosses every stage, the others
    follow at the bottleneck's pace); each stage is busy M x t_k of it.
    """
    k, m = len(stage_times), micro_batches
    makespan = sum(stage_times) + (m - 1) * max(stage_times)
    return 1.0 - m * sum(stage_times) / (k * makespan)
