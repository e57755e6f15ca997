"""Turn a model and a chain of GPUs into a placement ``Problem`` (the roofline per layer).

The workload is one micro-batch shape (``StepShape``): e.g. a decode batch of 64 sequences with
1,024 tokens of context, or a prefill chunk. Per layer and GPU, time = max(FLOPs / (peak x mfu),
bytes / (bandwidth x mbu)) with the FLOPs and bytes of ``reference.engine.cost``; memory per layer =
its weights + ``kv_tokens`` tokens of KV reserve. GPUs that share a ``node`` id talk over NVLink
(``intra_gbps``), others over the network (``inter_gbps``), so a split that cuts between nodes pays
for it in the stage's time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reference.cluster.costs import llama_config
from reference.cluster.placement import Problem, Split
from reference.cluster.scenario import GpuType, ModelSpec
from reference.engine.cost import StepShape, layer_weight_params, step_bytes, step_flops


@dataclass(frozen=True)
class ChainGpu:
    gpu: GpuType
    node: int = 0  # GPUs with the same node id are joined by NVLink


def chain_problem(model: ModelSpec, chain: Sequence[ChainGpu], shape: StepShape, *,
                  kv_tokens: int = 65_536, memory_fraction: float = 0.9, intra_gbps: float = 3600.0,
                  inter_gbps: float = 100.0, hop_latency_s: float = 20e-6) -> Problem:
    """The placement problem of ``model`` over ``chain`` for micro-batches of ``shape``."""
    c = llama_config(model)
    plain = StepShape(shape.new_tokens, shape.context_lens, 0)  # no output head inside a layer
    embed_bytes = shape.num_tokens * c.hidden_size * model.bytes_per_param
    layer_flops = step_flops(c, plain) / c.num_layers
    layer_bytes = (step_bytes(c, plain, model.bytes_per_param,
                              model.kv_bytes) - embed_bytes) / c.num_layers
    head_params = c.vocab_size * c.hidden_size
    head_flops = 2 * shape.num_sampled * head_params
    head_bytes = head_params * model.bytes_per_param
    kv_per_layer = kv_tokens * 2 * c.num_kv_heads * c.head_dim * model.kv_bytes
    layer_mem = layer_weight_params(c) * model.bytes_per_param + kv_per_layer

    def seconds(g: GpuType, flops: float, nbytes: float) -> float:
        return max(
            flops / (g.peak_tflops * 1e12 * g.mfu), nbytes / (g.bandwidth_tbps * 1e12 * g.mbu)
        )

    activation_bits = shape.num_tokens * c.hidden_size * 2 * 8
    comm = []
    for k, cg in enumerate(chain):
        if k + 1 < len(chain):
            same = chain[k + 1].node == cg.node
            comm.append(
                activation_bits / ((intra_gbps if same else inter_gbps) * 1e9)
                + (0 if same else hop_latency_s)
            )
        else:
            comm.append(0.0)
    return Problem(
        layer_time=tuple(
            tuple([seconds(cg.gpu, layer_flops, layer_bytes)] * c.num_layers) for cg in chain
        ),
        layer_mem=tuple([layer_mem] * c.num_layers),
        capacity=tuple(cg.gpu.memory_gb * 1e9 * memory_fraction for cg in chain),
        first_mem=head_params * model.bytes_per_param,
        last_mem=head_params * model.bytes_per_param,
        last_time=tuple(
            seconds(cg.gpu, head_flops, head_bytes) + cg.gpu.step_overhead_ms / 1000 for cg in chain
        ),
        comm_time=tuple(comm),
    )


def tokens_per_s(split: Split, shape: StepShape) -> float:
    """Steady-state pipeline throughput: new tokens of one micro-batch per bottleneck stage time."""
    return shape.num_tokens / split.bottleneck_s if split.feasible else 0.0
