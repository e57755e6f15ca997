"""The Llama forward pass in torch over the paged KV cache of ``fast/kv``: the fast engine's model.

It computes what ``reference/model/llama.py`` computes (read that first), arranged for speed:

* weights are torch tensors in bfloat16 or float32, loaded by the reference loaders (every
  checkpoint the reference reads); q/k/v are one fused matrix and gate/up another, so a layer is
  four matrix multiplications over all tokens of the step, whatever mix of prefill and decode;
* the residual stream stays float32 (norms and RoPE too); only matmul inputs are cast to the dtype;
* attention is ``fast.kv.paged_attention``: Triton kernels on a GPU, gather + SDPA on a CPU;
* the output head runs only on the rows whose logits the engine wants (last token of a chunk);
* with ``compressed=True`` the four projection matrices of every layer are ``UnweightLinear``s:
  held in the palette form (12 bits per weight) and decoded on the fly (``fast/engine/linear.py``).

Conformance (``conformance/cases/engine_cases.py``): *bounded*. In float32 the logits differ from the
reference's only by summation order, and the greedy tokens and scheduling decisions on the
conformance workload are equal; compressed weights are lossless, so their tokens equal the plain
bf16 weights' tokens exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fast.engine.linear import DenseLinear, Linear, compress
from fast.errors import KernelInputError
from fast.kv import KVStep, PagedKVCache, paged_attention
from reference.model.config import LlamaConfig
from reference.model.loader import LlamaWeights, load_llama
from reference.model.rope import inverse_frequencies, rope_tables
from reference.model.weights import WeightSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the matrices of a layer, as ``compressed=`` names them


@dataclass
class TorchLayer:
    attn_norm: torch.Tensor  # float32 [hidden]
    qkv: Linear  # [(heads + 2 kv_heads) * head_dim, hidden]
    o: Linear  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear  # [hidden, intermediate]
    qkv_bias: torch.Tensor | None = None  # float32 [(heads + 2 kv_heads) * head_dim] (Qwen2, attention_bias)
    o_bias: torch.Tensor | None = None  # float32 [hidden]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, per row (float32, as the reference)."""
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by per-token tables [tokens, head_dim] (the reference's rule).

    The reference computes ``x * cos + [-x2, x1] * sin`` (x1, x2 the halves of x). With ``signed_sin =
    [-sin1, sin2]`` (``signed``) that is ``x * cos + [x2, x1] * signed_sin``: the same products (negation
    is exact), in three torch calls instead of six.
    """
    return x * cos[:, None, :] + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin[:, None, :]


def signed(sin: torch.Tensor) -> torch.Tensor:
    """The sine table with its first half negated (what ``apply_rope`` takes)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


class TorchLlama:
    """A Llama checkpoint as torch tensors on one device; ``forward`` runs one engine step."""

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, *, dtype: str = "bfloat16",
                 device: str | torch.device = "cpu", compressed: bool | Sequence[str] = False):
        if dtype not in DTYPES:
            raise KernelInputError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        which = PROJECTIONS if compressed is True else tuple(compressed or ())
        unknown = sorted(set(which) - set(PROJECTIONS))
        if unknown:
            raise KernelInputError(f"compressed= names unknown matrices {unknown}; choose from {PROJECTIONS}")
        self.config, self.dtype_name, self.dtype = config, dtype, DTYPES[dtype]
        self.device, self.compressed = torch.device(device), which

        def tensor(a: np.ndarray, dt: torch.dtype | None = None) -> torch.Tensor:
            return torch.tensor(np.asarray(a), device=self.device, dtype=dt or self.dtype)

        def linear(name: str, *parts: np.ndarray) -> Linear:
            w = tensor(np.concatenate(parts) if len(parts) > 1 else parts[0])
            return compress(w, self.dtype) if name in which else DenseLinear(w)

        def qkv_bias(lw: object) -> torch.Tensor | None:
            # the reference adds each projection's bias (when the checkpoint has one) after the matmul
            parts = [(getattr(lw, b), w.shape[0]) for b, w in (("bq", lw.wq), ("bk", lw.wk), ("bv", lw.wv))]
            if all(b is None for b, _ in parts):
                return None
            return tensor(np.concatenate([np.zeros(n, np.float32) if b is None else b for b, n in parts]),
                          torch.float32)

        self.layers = [TorchLayer(attn_norm=tensor(lw.attn_norm, torch.float32),
                                  qkv=linear("qkv", lw.wq, lw.wk, lw.wv), o=linear("o", lw.wo),
                                  mlp_norm=tensor(lw.mlp_norm, torch.float32),
                                  gate_up=linear("gate_up", lw.w_gate, lw.w_up), down=linear("down", lw.w_down),
                                  qkv_bias=qkv_bias(lw),
                                  o_bias=None if lw.bo is None else tensor(lw.bo, torch.float32))
                       for lw in weights.layers]
        self.embedding = tensor(weights.embedding)
        tied = weights.lm_head is weights.embedding
        self.lm_head = self.embedding if tied else tensor(weights.lm_head)
        self.head = DenseLinear(self.lm_head)  # the output projection (a packed copy on a CPU in bf16)
        self.final_norm = tensor(weights.final_norm, torch.float32)
        # RoPE tables for every position, computed by the reference's own code (identical values)
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling,
                                       weights.rope_freq_factors)
        cos, sin = rope_tables(np.arange(config.max_position), inv_freq)
        self.cos, self.signed_sin = tensor(cos, torch.float32), signed(tensor(sin, torch.float32))

    @classmethod
    def load(cls, source: str | Path | WeightSource = "smollm2", **kwargs: object) -> TorchLlama:
        """Load a checkpoint with the reference loaders (a packaged name, a path, or a WeightSource)."""
        return cls(*load_llama(source), **kwargs)  # type: ignore[arg-type]

    def new_cache(self, num_blocks: int, block_size: int = 16, dtype: str | None = None) -> PagedKVCache:
        """A paged KV cache for this model; ``dtype`` None: the model's dtype ("float32" | "bfloat16" | "fp8")."""
        c = self.config
        return PagedKVCache(num_layers=c.num_layers, num_blocks=num_blocks, block_size=block_size,
                            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=dtype or self.dtype_name,
                            device=self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, step: KVStep, cache: PagedKVCache,
                logit_rows: torch.Tensor) -> torch.Tensor:
        """Run one step: tokens, positions [T] (int64), the step's KV layout; returns float32 logits
        [len(logit_rows), vocab] of the rows ``logit_rows`` (the last token of each chunk that wants them)."""
        return self.logits(self.run_layers(self.embed(tokens), positions, step, cache), logit_rows)

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: float32 [T, hidden] rows of the embedding."""
        return self.embedding[tokens].to(torch.float32)

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, step: KVStep, cache: PagedKVCache) -> torch.Tensor:
        """Every layer of this model over the residual stream x [T, hidden] (float32); layer i uses cache layer i.
        A pipeline stage is a model holding a range of a checkpoint's layers (``fast/pipeline``)."""
        c = self.config
        heads, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
        n = x.shape[0]
        cos, sin = self.cos[positions], self.signed_sin[positions]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_norm_eps).to(self.dtype)
            qkv = layer.qkv(h)
            if layer.qkv_bias is not None:
                qkv = (qkv.float() + layer.qkv_bias).to(self.dtype)
            qk = apply_rope(qkv[:, :(heads + kv) * d].reshape(n, heads + kv, d).float(), cos, sin)  # q and k at once
            cache.write(i, step.slots, qk[:, heads:], qkv[:, (heads + kv) * d:].reshape(n, kv, d))
            out = paged_attention(qk[:, :heads].to(self.dtype).contiguous(), cache, i, step)
            attn = layer.o(out.reshape(n, heads * d)).float()
            x = x + (attn if layer.o_bias is None else attn + layer.o_bias)
            h = rms_norm(x, layer.mlp_norm, c.rms_norm_eps).to(self.dtype)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up).float()
        return x

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        """Final norm and output head on the rows ``logit_rows`` of x: float32 [len(logit_rows), vocab]."""
        last = rms_norm(x[logit_rows], self.final_norm, self.config.rms_norm_eps).to(self.dtype)
        return self.head(last).float()
