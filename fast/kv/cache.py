"""The paged KV cache in torch: the layout and fp8 rule of ``reference/kv/cache.py``, on any device.

Per layer, ``k[layer]`` and ``v[layer]`` have shape [num_blocks, block_size, num_kv_heads, head_dim]:
float32 or bfloat16 values, or (dtype "fp8") uint8 e4m3 codes with int8 scale exponents
``k_exp[layer]``, ``v_exp[layer]`` of shape [num_blocks, num_kv_heads]. A stored code c in block b,
kv head h means ``decode(c) * 2^exp[b, h]``. Writes follow the reference's four rules exactly (a
write at offset 0 starts a block afresh; a scale only grows; a grown scale re-encodes the block's
codes once; new values are encoded with the new scale), so the stored bytes equal the reference's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fast.errors import KernelInputError
from fast.kv import fp8_torch as fp8
from reference.kv.errors import KVCacheError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.uint8}


class PagedKVCache:
    """K/V storage for all layers; who owns which block is the block manager's business."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: str = "float32", device: torch.device | str = "cpu"):
        if dtype not in DTYPES:
            raise KVCacheError(f"KV dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise KVCacheError("KV cache sizes must all be positive")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=DTYPES[dtype], device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=DTYPES[dtype], device=self.device) for _ in range(num_layers)]
        self.scratch: dict[str, torch.Tensor] = {}  # reusable buffers of the torch attention path
        # called with the layer after each write of new tokens' K/V (``wrote``: by ``write``, the Triton write
        # or the fused RoPE write of fast/engine/fused_c.py): a disaggregated prefill worker sends that layer's KV then
        self.on_write: Callable[[int], None] | None = None
        self.k_exp: list[torch.Tensor] = []
        self.v_exp: list[torch.Tensor] = []
        if dtype == "fp8":
            def exps() -> torch.Tensor:
                return torch.full((num_blocks, num_kv_heads), fp8.MIN_SCALE_EXP, dtype=torch.int8, device=self.device)
            self.k_exp = [exps() for _ in range(num_layers)]
            self.v_exp = [exps() for _ in range(num_layers)]

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "fp8"

    # -- writes -----------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V of new tokens (each [n, kv_heads, head_dim], float32 or bfloat16) at int64 ``slots`` [n],
        in torch (any device). Slots must be distinct (one token per slot per step). ``fast.kv.ops.write_kv``
        picks between this and the Triton kernel."""
        self.check_write(layer, slots, k, v)
        if not self.is_fp8:
            flat = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
            self.k[layer].view(flat)[slots] = to_store(k, self.k[layer].dtype)
            self.v[layer].view(flat)[slots] = to_store(v, self.v[layer].dtype)
        else:
            write_fp8(self.k[layer], self.k_exp[layer], slots, k)
            write_fp8(self.v[layer], self.v_exp[layer], slots, v)
        self.wrote(layer)

    def wrote(self, layer: int) -> None:
        """Announce that new tokens' K/V of ``layer`` are stored (``on_write``), whoever stored them."""
        if self.on_write is not None:
            self.on_write(layer)

    def check_write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise KernelInputError(f"layer {layer} is outside [0, {self.num_layers})")
        if slots.dtype != torch.int64 or slots.dim() != 1:
            raise KernelInputError(f"slots must be a 1-D int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
        want = (slots.shape[0], self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want or t.dtype not in (torch.float32, torch.bfloat16):
                raise KernelInputError(f"{name} must be float32/bfloat16 of shape {want}, got {t.dtype} "
                                       f"{tuple(t.shape)}")
            if t.device != self.device:
                raise KernelInputError(f"{name} is on {t.device}, the cache on {self.device}")
        if slots.device != self.device:
            raise KernelInputError(f"slots are on {slots.device}, the cache on {self.device}")

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into ``dst`` in every layer (copy-on-write), scales included."""
        for layer in range(self.num_layers):
            self.k[layer][dst] = self.k[layer][src]
            self.v[layer][dst] = self.v[layer][src]
            if self.is_fp8:
                self.k_exp[layer][dst] = self.k_exp[layer][src]
                self.v_exp[layer][dst] = self.v_exp[layer][src]

    # -- reads (for tests and the torch path) ----------------------------------------------------
    def blocks_as_float(self, layer: int, blocks: torch.Tensor, which: str = "k") -> torch.Tensor:
        """Values of ``blocks`` (any int shape S) as float32 [*S, block_size, kv_heads, head_dim] (fp8 dequantized)."""
        store = self.k[layer] if which == "k" else self.v[layer]
        codes = store[blocks.long()]
        if not self.is_fp8:
            return codes.to(torch.float32)
        exps = (self.k_exp[layer] if which == "k" else self.v_exp[layer])[blocks.long()]
        return fp8.decode(codes, exps.unsqueeze(-2).unsqueeze(-1).to(torch.int32))

    def read(self, layer: int, block_table: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [0, length) as float32 [length, kv_heads, head_dim] (as the reference's ``read``)."""
        n_blocks = -(-length // self.block_size)
        if n_blocks > len(block_table):
            raise KVCacheError(f"length {length} needs {n_blocks} blocks, the table has {len(block_table)}")
        table = torch.as_tensor(list(block_table[:n_blocks]), dtype=torch.int64, device=self.device)
        shape = (n_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        k = self.blocks_as_float(layer, table, "k").reshape(shape)[:length]
        v = self.blocks_as_float(layer, table, "v").reshape(shape)[:length]
        return k, v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.k_exp + self.v_exp)


def to_store(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache's dtype; float32 -> bfloat16 rounds to nearest even by integer operations.

    That is ``reference.bf16.float32_to_bf16``'s rule, NaN included (torch's own cast turns every
    NaN into 0xFFFF on the CPU), so a bf16 cache holds the same bits on every path.
    """
    if dtype != torch.bfloat16 or x.dtype != torch.float32 or not bool(torch.isnan(x).any()):
        return x.to(dtype)  # torch's cast rounds every non-NaN value to nearest even as well
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    out = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, quiet_nan, rounded)
    return out.to(torch.int32).to(torch.int16).view(torch.bfloat16)  # low 16 bits, as a bit pattern


def write_fp8(codes: torch.Tensor, exps: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """The four fp8 write rules (``reference/kv/fp8.py``) in torch, vectorised over blocks and heads."""
    block_size = codes.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    fresh = torch.unique(blocks[offsets == 0])  # rule 1
    codes[fresh] = 0
    exps[fresh] = fp8.MIN_SCALE_EXP
    touched, which = torch.unique(blocks, return_inverse=True)
    heads = codes.shape[2]
    amax = torch.zeros((len(touched), heads), dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, which[:, None].expand(-1, heads), fp8.finite_abs_max(x, -1), "amax")
    old = exps[touched].to(torch.int32)
    new = torch.maximum(old, fp8.scale_exponent(amax))  # rule 2
    grown_i, grown_h = torch.nonzero(new > old, as_tuple=True)
    if grown_i.numel():  # rule 3: re-encode what is already in the block with the larger scale
        b = touched[grown_i]
        block_codes = codes[b, :, grown_h, :]  # [g, block_size, head_dim]
        values = fp8.decode(block_codes, old[grown_i, grown_h][:, None, None])
        codes[b, :, grown_h, :] = fp8.encode(values, new[grown_i, grown_h][:, None, None])
    exps[touched] = new.to(torch.int8)
    codes[blocks, offsets] = fp8.encode(x, new[which][:, :, None])  # rule 4
