"""Step cost of a replica: the roofline of ``reference.engine.cost`` on a named GPU, or a fitted
model.

A replica of ``gpus`` GPUs (tensor parallel) runs a step in

    overhead + max(FLOPs / (gpus * peak * mfu), bytes / (gpus * bandwidth * mbu))

where FLOPs and bytes are those of the step's shape (``reference.engine.cost.StepCost``): a step is
as slow as the more loaded of the compute units and the memory bus. ``mfu`` and ``mbu`` (the shares
of peak a real kernel reaches) and the per-step overhead are assumptions stated in the scenario. On
the CPU,
``StepTimeModel.fit`` on measured engine steps replaces this formula (calibration, item 3).
"""

from __future__ import annotations

from collections.abc import Callable

from reference.cluster.scenario import GpuType, ModelSpec
from reference.engine.cost import StepCost, StepShape
from reference.model.config import LlamaConfig


def llama_config(m: ModelSpec) -> LlamaConfig:
    """The model's shape as the cost functions read it."""
    return LlamaConfig(vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.intermediate,
                       num_layers=m.layers, num_heads=m.heads, num_kv_heads=m.kv_heads,
                       head_dim=m.head_dim, rms_norm_eps=1e-5, rope_theta=1e4, max_position=1 << 20,
                       tie_embeddings=False)


def weight_bytes(m: ModelSpec) -> float:
    """Bytes of all weights (embedding and output head included)."""
    c = llama_config(m)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = (
        c.hidden_size * (2 * q + 2 * kv)
        + 3 * c.hidden_size * c.intermediate_size
        + 2 * c.hidden_size
    )
    return (c.num_layers * per_layer + 2 * c.vocab_size * c.hidden_size) * m.bytes_per_param


def kv_bytes_per_token(m: ModelSpec) -> float:
    """K and V of one token over all layers: what a KV transfer moves per prompt token."""
    return 2 * m.layers * m.kv_heads * m.head_dim * m.kv_bytes


class RooflineCost:
    """Seconds per step of ``model`` on ``gpus`` GPUs of type ``gpu`` (see the module docstring)."""

    def __init__(self, model: ModelSpec, gpu: GpuType, gpus: int = 1) -> None:
        self.config = llama_config(model)
        self.model, self.gpu, self.gpus = model, gpu, gpus
        self.flops_per_s = gpus * gpu.peak_tflops * 1e12 * gpu.mfu
        self.bytes_per_s = gpus * gpu.bandwidth_tbps * 1e12 * gpu.mbu
        self.peak_flops_per_s = gpus * gpu.peak_tflops * 1e12
        self.overhead = gpu.step_overhead_ms / 1000
        self.step = StepCost.of(self.config, model.bytes_per_param, model.kv_bytes)

    def flops(self, s: StepShape) -> float:
        return self.step.flops(s)

    def flops_of(self, tokens: int, pairs: int, sampled: int) -> float:
        return self.step.flops_of(tokens, pairs, sampled)

    def __call__(self, s: StepShape) -> float:
        return self.seconds_of(s.num_tokens, s.attention_pairs(), s.num_sampled,
                               sum(s.context_lens) - s.num_tokens)

    def seconds_of(self, tokens: int, pairs: int, sampled: int, cached: int) -> float:
        """Seconds of a step from its shape's sums: new tokens, attention pairs, sampled sequences,
        cached tokens attended to (what a macro step prices its steps by, without building each
        shape)."""
        compute = self.step.flops_of(tokens, pairs, sampled) / self.flops_per_s
        memory = self.step.bytes_of(tokens, sampled, cached) / self.bytes_per_s
        return self.overhead + max(compute, memory)


def per_token_prefill_s(cost: Callable[[StepShape], float], chunk: int) -> float:
    """Seconds per prompt token when prefilling in chunks of ``chunk`` tokens (for load
    estimates)."""
    return cost(StepShape((chunk,), (chunk,), 1)) / chunk


def decode_step_s(cost: Callable[[StepShape], float], batch: int, context: int = 512) -> float:
    """Seconds of one decode step of ``batch`` sequences of ``context`` tokens (for load
    estimates)."""
    return cost(StepShape((1,) * batch, (context,) * batch, batch))
