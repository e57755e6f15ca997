"""The Llama forward pass in torch over the paged KV cache of ``fast/kv``: the fast engine's model.

It computes what ``reference/model/llama.py`` computes (read that first), arranged for speed:

* weights are torch tensors in bfloat16 or float32, loaded by the reference loaders (every
  checkpoint the reference reads); q/k/v are one fused matrix and gate/up another, so a layer is
  four matrix multiplications over all tokens of the step, whatever mix of prefill and decode;
* the residual stream stays float32 (norms and RoPE too); only matmul inputs are cast to the dtype;
* attention is ``fast.kv.paged_attention``: Triton kernels on a GPU, gather + SDPA on a CPU;
* the output head runs only on the rows whose logits the engine wants (last token of a chunk);
* with ``compressed=True`` the four projection matrices of every layer are ``UnweightLinear``s:
  held in the palette form (12 bits per weight) and decoded on the fly (``fast/engine/linear.py``);
* from an Unweight container (``python -m reference.codec compress``), the article's flow: a matrix
  stored alone in the Huffman form (o, down) is transcoded straight to the palette form it is served
  in; the fused ones (q/k/v, gate/up: one palette for the whole fused matrix) and the matrices left
  plain are decoded to bf16 by the reference loader (every CRC checked) and, if served compressed,
  encoded again. Lossless either way (``tests/test_compressed_model.py`` compares the forms).

Conformance (``conformance/cases/engine_cases.py``): *bounded*. In float32 the logits differ from the
reference's only by summation order, and the greedy tokens and scheduling decisions on the
conformance workload are equal; compressed weights are lossless, so their tokens equal the plain
bf16 weights' tokens exactly.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fast.engine import fused_c
from fast.engine.elementwise_torch import apply_rope, rms_norm, signed
from fast.engine.linear import CompressedLinear, DenseLinear, Linear, compress
from fast.errors import KernelInputError
from fast.kv import KVStep, PagedKVCache, attention_rows, attention_torch, paged_attention, write_kv
from reference.model.carried import ContainerFile
from reference.model.config import LlamaConfig
from reference.model.loader import GGUF_NAMES, HF_NAMES, LlamaWeights, load_llama
from reference.model.rope import inverse_frequencies, rope_tables
from reference.model.weights import WeightSource, open_weights

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


class TorchLlama:
    """A Llama checkpoint as torch tensors on one device; ``forward`` runs one engine step."""

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, *, dtype: str = "bfloat16",
                 device: str | torch.device = "cpu", compressed: bool | Sequence[str] = False,
                 stored: dict[tuple[int, str], CompressedLinear] | None = None):
        """``stored``: compressed matrices already built (layer, projection name) -> matrix, e.g.
        transcoded from a container (``stored_projections``); used where ``compressed`` names them."""
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

        def linear(i: int, name: str, *parts: np.ndarray) -> Linear:
            if name in which and (i, name) in (stored or {}):
                return stored[(i, name)]
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
                                  qkv=linear(i, "qkv", lw.wq, lw.wk, lw.wv), o=linear(i, "o", lw.wo),
                                  mlp_norm=tensor(lw.mlp_norm, torch.float32),
                                  gate_up=linear(i, "gate_up", lw.w_gate, lw.w_up),
                                  down=linear(i, "down", lw.w_down), qkv_bias=qkv_bias(lw),
                                  o_bias=None if lw.bo is None else tensor(lw.bo, torch.float32))
                       for i, lw in enumerate(weights.layers)]
        self.embedding = tensor(weights.embedding)
        tied = weights.lm_head is weights.embedding
        self.lm_head = self.embedding if tied else tensor(weights.lm_head)
        self.head = DenseLinear(self.lm_head)  # the output projection (tiles or a packed copy on a CPU in bf16)
        self.final_norm = tensor(weights.final_norm, torch.float32)
        # RoPE tables for every position, computed by the reference's own code (identical values)
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling,
                                       weights.rope_freq_factors)
        cos, sin = rope_tables(np.arange(config.max_position), inv_freq)
        self.cos, self.signed_sin = tensor(cos, torch.float32), signed(tensor(sin, torch.float32))

    @classmethod
    def load(cls, source: str | Path | WeightSource = "smollm2", **kwargs: object) -> TorchLlama:
        """Load a checkpoint with the reference loaders (a packaged name, a path, a container, or a
        WeightSource); a container's single matrices served compressed are transcoded, not re-encoded."""
        src = source if isinstance(source, WeightSource) else open_weights(source, **native_decoders())
        config, weights = load_llama(src)
        compressed = kwargs.get("compressed", False)
        which = PROJECTIONS if compressed is True else tuple(compressed or ())  # type: ignore[arg-type]
        dtype = DTYPES.get(str(kwargs.get("dtype", "bfloat16")), torch.bfloat16)
        stored = stored_projections(src, config.num_layers, which, dtype, kwargs.get("device", "cpu"))  # type: ignore[arg-type]
        return cls(config, weights, stored=stored, **kwargs)  # type: ignore[arg-type]

    def weight_nbytes(self) -> dict[str, int]:
        """Resident bytes of the weights: ``dense`` (plain tensors: embedding, head if untied, plain
        matrices, in tile order where the CPU's tile products run, norms), ``compressed`` (the palette
        forms' buffers) and ``packed`` (oneDNN's copies of plain bf16 matrices, ``DenseLinear.packed``,
        on a CPU without the tile products; 0 on a GPU and where the tiles are the one copy)."""
        out = {"dense": 0, "compressed": 0, "packed": 0}

        def nb(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        for layer in self.layers:
            out["dense"] += nb(layer.attn_norm) + nb(layer.mlp_norm)
            out["dense"] += sum(nb(b) for b in (layer.qkv_bias, layer.o_bias) if b is not None)
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                if isinstance(lin, CompressedLinear):
                    out["compressed"] += lin.nbytes()
                else:
                    out["dense"] += lin.nbytes() - (nb(lin.packed) if lin.packed is not None else 0)
                    out["packed"] += nb(lin.packed) if lin.packed is not None else 0
        out["dense"] += nb(self.embedding) + nb(self.final_norm)
        if self.lm_head is not self.embedding:
            out["dense"] += nb(self.lm_head)
        out["packed"] += nb(self.head.packed) if self.head.packed is not None else 0
        return out

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
        x = self.run_layers(self.embed(tokens), positions, step, cache, keep=logit_rows)
        return self._head(x)

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: float32 [T, hidden] rows of the embedding."""
        return self.embedding[tokens].to(torch.float32)

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, step: KVStep, cache: PagedKVCache,
                   keep: torch.Tensor | None = None) -> torch.Tensor:
        """Every layer of this model over the residual stream x [T, hidden] (float32); layer i uses cache layer i.
        A pipeline stage is a model holding a range of a checkpoint's layers (``fast/pipeline``).

        ``keep`` (int64 row indices): return only those rows of the result. Then the last layer, once every row's
        K and V are in the cache, runs attention, the output projection and the MLP on those rows alone where the
        attention kernel takes single rows (the CPU's C kernel; ``UNFIRE_PRUNE_LAST_LAYER=0`` switches this off):
        a prefill step's other rows feed nothing but the cache. Each row's arithmetic does not depend on the
        other rows (the products' rows are computed alike for any row count, checked in the tests), so the kept
        rows' values are the same bits either way."""
        c = self.config
        heads, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
        n = x.shape[0]
        fused_rope = self._fused(cache)  # the same bits as the three torch lines below, in one pass
        fused_norm = self._fused_norm()  # the residual adds and norms in C, the same bits as their torch lines
        fused_silu = fused_c.silu_applies(self.dtype, self.device)  # silu(gate) * up in C, the same bits
        positions = positions.contiguous()
        cos, sin = (None, None) if fused_rope else (self.cos[positions], self.signed_sin[positions])
        eps = c.rms_norm_eps
        # on one CPU thread with every C op in use: the ops and the attention bound to this step, their shared
        # arguments checked once (fused_c.StepOps, attention_c.bind); the same C calls as below, less Python
        ops = (fused_c.StepOps.bind(cache, heads, self.cos, self.signed_sin, positions, step.slots)
               if fused_rope and fused_norm and fused_silu and not any(lw.o_bias is not None for lw in self.layers)
               else None)
        attend = attention_torch.bound(cache, step, heads, 1.0 / math.sqrt(d)) if ops is not None else None
        rope_write = ops.rope_write if ops is not None else None
        add_rms_norm = ops.add_rms_norm if ops is not None else fused_c.add_rms_norm
        silu_mul = ops.silu_mul if ops is not None else fused_c.silu_mul
        if fused_norm:
            x = x.contiguous()
            h = add_rms_norm(x, None, self.layers[0].attn_norm, eps) if self.layers else None
        last = len(self.layers) - 1
        prune = keep is not None and keep.numel() < n and os.environ.get("UNFIRE_PRUNE_LAST_LAYER", "1") != "0"
        for i, layer in enumerate(self.layers):
            if not fused_norm:
                h = rms_norm(x, layer.attn_norm, eps).to(self.dtype)
            qkv = layer.qkv(h)
            if layer.qkv_bias is not None:
                qkv = (qkv.float() + layer.qkv_bias).to(self.dtype)
            if rope_write is not None:
                q = rope_write(qkv, i)
            elif fused_rope:
                q = fused_c.rope_write(qkv, self.cos, self.signed_sin, positions, step.slots, cache, i, heads)
            else:
                qk = apply_rope(qkv[:, :(heads + kv) * d].reshape(n, heads + kv, d).float(), cos, sin)  # q, k at once
                write_kv(cache, i, step.slots, qk[:, heads:], qkv[:, (heads + kv) * d:].reshape(n, kv, d))
                q = qk[:, :heads].to(self.dtype).contiguous()
            out = attention_rows(q, cache, i, step, keep) if prune and i == last else None
            if out is not None:  # the kept rows alone from here on
                x, n, keep = x[keep].contiguous(), keep.numel(), None
            else:
                out = attend(q, i) if attend is not None else paged_attention(q, cache, i, step)
            attn = layer.o(out.reshape(n, heads * d))
            if fused_norm and layer.o_bias is None:
                # the first add writes a new tensor (x may be the caller's), the later ones add in place
                x_out = torch.empty_like(x) if i == 0 else x
                h = add_rms_norm(x, attn, layer.mlp_norm, eps, x_out)
                x = x_out
            else:
                attn = attn.float()
                x = x + (attn if layer.o_bias is None else attn + layer.o_bias)
                h = rms_norm(x, layer.mlp_norm, eps).to(self.dtype)
                if fused_norm:
                    x = x.contiguous()
            gate_up = layer.gate_up(h)
            if fused_silu:
                down = layer.down(silu_mul(gate_up))
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                down = layer.down(F.silu(gate) * up)
            if fused_norm:  # the add, and the next layer's first norm with it
                nxt = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else None
                h = add_rms_norm(x, down, nxt, eps, x)
            else:
                x = x + down.float()
        return x if keep is None else x[keep]

    def _fused_norm(self) -> bool:
        """Whether the residual adds and RMSNorms run in C (bf16 on a CPU; fast/engine/fused_c.py)."""
        return fused_c.norm_applies(self.dtype, self.device)

    def _fused(self, cache: PagedKVCache) -> bool:
        """Whether this step's RoPE and cache write run as one C pass (bf16 on a CPU, no q/k/v bias)."""
        return (self.dtype == torch.bfloat16 and self.device.type == "cpu"
                and fused_c.applies(self.dtype, self.device, cache))

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        """Final norm and output head on the rows ``logit_rows`` of x: float32 [len(logit_rows), vocab]."""
        return self._head(x[logit_rows])

    def _head(self, rows: torch.Tensor) -> torch.Tensor:
        """Final norm and output head on every row of ``rows`` (float32 [m, hidden]): float32 [m, vocab]."""
        if self._fused_norm():
            last = fused_c.add_rms_norm(rows.contiguous(), None, self.final_norm, self.config.rms_norm_eps)
        else:
            last = rms_norm(rows, self.final_norm, self.config.rms_norm_eps).to(self.dtype)
        return self.head(last).float()


def native_decoders() -> dict[str, object]:
    """A container's decoders for the loaders: the C ones of fast/codec (every check kept), which fall
    back to the NumPy decoders by themselves where no C compiler is found."""
    from fast.codec.__main__ import decode_batch, decode_rans_batch

    return {"decoder": decode_batch, "rans_decoder": decode_rans_batch}


SINGLE = {"o": "wo", "down": "w_down"}  # projections that are one stored matrix (no fusion, no GGUF row permutation)


def stored_projections(src: WeightSource, num_layers: int, which: Sequence[str], dtype: torch.dtype,
                       device: str | torch.device = "cpu") -> dict[tuple[int, str], CompressedLinear]:
    """The single matrices (o, down) to serve compressed that a container holds in the Huffman form,
    transcoded to the palette form (FORMAT.md section 5), without a bf16 copy on the way."""
    from fast.codec.convert import huffman_from_reference
    from fast.codec.decode_c import library
    from fast.codec.decode_torch import transcode_torch
    from fast.codec.linear import UnweightLinear
    from fast.codec.transcode_c import transcode_cpu
    from reference.codec import CompressedTensor

    out: dict[tuple[int, str], CompressedLinear] = {}
    files = {n: f for f in src.files if isinstance(f, ContainerFile) for n in f.names()}
    for proj in set(which) & set(SINGLE):
        for i in range(num_layers):
            names = (f"blk.{i}.{GGUF_NAMES[SINGLE[proj]]}.weight", f"model.layers.{i}.{HF_NAMES[SINGLE[proj]]}.weight")
            name = next((n for n in names if n in files), None)
            if name is None or not files[name].is_compressed(name):
                continue
            native = torch.device(device).type == "cpu" and library() is not None
            # every array checked: by the C decoder (native) or here
            ct = files[name].compressed(name, check_arrays=not native)
            if isinstance(ct, CompressedTensor) and len(ct.palette) <= 16 and len(ct.shape) == 2:
                if native:  # the C decoder's exponents as palette indices: transcode_torch's bytes
                    unweight = UnweightLinear(transcode_cpu(ct))
                else:  # a GPU's Triton transcode, or torch's (never Triton's interpreter: far too slow)
                    form = huffman_from_reference(ct, torch.device(device))
                    unweight = UnweightLinear.from_huffman(form) if form.device.type == "cuda" else UnweightLinear(
                        transcode_torch(form))
                out[(i, proj)] = CompressedLinear(unweight, dtype)
    return out
