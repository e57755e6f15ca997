"""The paged KV cache: the data plane. Storage, writes into slots, reads through block tables.

Per layer, keys and values live in arrays of shape [num_blocks, block_size, num_kv_heads, head_dim].
A sequence owns a list of block ids (its block table, kept by the block manager); token position p
of that sequence lives in slot ``table[p // block_size] * block_size + p % block_size``. Which block
belongs to whom is the control plane's business (``reference/kv/block_manager.py``); this file only
stores numbers where it is told to.

Two storage kinds: ``"float32"`` (exact) and ``"fp8"`` (e4m3 codes with one power-of-two scale per
(block, kv-head); rules in ``reference/kv/fp8.py``). The model writes a step's new K/V first and
then reads every position back through the table, the new ones included, so with fp8 attention
always sees the stored (rounded) values, in prefill and decode alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from reference.kv import fp8
from reference.kv.errors import KVCacheError


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: str = "float32"):
        if dtype not in ("float32", "fp8"):
            raise KVCacheError(f"KV dtype must be 'float32' or 'fp8', got {dtype!r}")
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise KVCacheError("KV cache sizes must all be positive")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        store = np.float32 if dtype == "float32" else np.uint8
        self.k = [np.zeros(shape, dtype=store) for _ in range(num_layers)]
        self.v = [np.zeros(shape, dtype=store) for _ in range(num_layers)]
        # scale exponents per (block, kv-head), int8 as the fast path stores them
        if dtype == "fp8":
            self.k_exp = [np.full((num_blocks, num_kv_heads), fp8.MIN_SCALE_EXP,
                                  np.int8) for _ in range(num_layers)]
            self.v_exp = [np.full((num_blocks, num_kv_heads), fp8.MIN_SCALE_EXP,
                                  np.int8) for _ in range(num_layers)]

    # -- addressing -------------------------------------------------------------------------
    def slots(self, block_table: Sequence[int], start: int, count: int) -> np.ndarray:
        """Slot ids of positions [start, start + count) of a sequence with this block table."""
        pos = np.arange(start, start + count)
        if count and (pos[-1] // self.block_size) >= len(block_table):
            raise KVCacheError(f"position {pos[-1]} needs block {pos[-1] // self.block_size} but "
                               "the table "
                               f"has {len(block_table)} blocks")
        table = np.asarray(block_table, dtype=np.int64)
        if table.size and (table.min() < 0 or table.max() >= self.num_blocks):
            raise KVCacheError(f"block table has ids outside [0, {self.num_blocks})")
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    # -- writes -----------------------------------------------------------------------------
    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store K and V of new tokens ([n, kv_heads, head_dim] each) at ``slots``."""
        slots = np.asarray(slots, dtype=np.int64)
        if self.dtype == "float32":
            self._flat(self.k[layer])[slots] = k
            self._flat(self.v[layer])[slots] = v
            return
        self._write_fp8(self.k[layer], self.k_exp[layer], slots, k)
        self._write_fp8(self.v[layer], self.v_exp[layer], slots, v)

    def _flat(self, store: np.ndarray) -> np.ndarray:
        return store.reshape(self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)

    def _write_fp8(self, codes: np.ndarray, exps: np.ndarray, slots: np.ndarray,
                   x: np.ndarray) -> None:
        """The four fp8 write rules of ``reference/kv/fp8.py``, vectorised over blocks and heads."""
        blocks, offsets = slots // self.block_size, slots % self.block_size
        fresh = np.unique(blocks[offsets == 0])  # rule 1
        codes[fresh] = 0
        exps[fresh] = fp8.MIN_SCALE_EXP
        touched, which = np.unique(blocks, return_inverse=True)
        amax = np.zeros((len(touched), self.num_kv_heads), dtype=np.float32)
        np.maximum.at(amax, which, fp8.finite_abs_max(x, axis=-1))
        old = exps[touched]
        new = np.maximum(old, fp8.scale_exponent(amax))  # rule 2
        # rule 3: rescale what is already there
        for i, h in zip(*np.nonzero(new > old), strict=True):
            b = touched[i]
            values = fp8.decode(codes[b, :, h, :], old[i, h])
            codes[b, :, h, :] = fp8.encode(values, new[i, h])
        exps[touched] = new
        codes[blocks, offsets] = fp8.encode(x, new[which][:, :, None])  # rule 4

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into ``dst`` in every layer (copy-on-write), scales included."""
        for layer in range(self.num_layers):
            self.k[layer][dst] = self.k[layer][src]
            self.v[layer][dst] = self.v[layer][src]
            if self.dtype == "fp8":
                self.k_exp[layer][dst] = self.k_exp[layer][src]
                self.v_exp[layer][dst] = self.v_exp[layer][src]

    # -- reads ------------------------------------------------------------------------------
    def read(
        self, layer: int, block_table: Sequence[int], length: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """K and V of positions [0, length) as float32 [length, kv_heads, head_dim], via the
        table."""
        n_blocks = -(-length // self.block_size)
        if n_blocks > len(block_table):
            raise KVCacheError(f"length {length} needs {n_blocks} blocks, the table has "
                               f"{len(block_table)}")
        table = np.asarray(block_table[:n_blocks], dtype=np.int64)
        k, v = self.k[layer][table], self.v[layer][table]  # [n_blocks, block_size, heads, dim]
        if self.dtype == "fp8":
            k = fp8.decode(k, self.k_exp[layer][table][:, None, :, None])
            v = fp8.decode(v, self.v_exp[layer][table][:, None, :, None])
        shape = (n_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        return k.reshape(shape)[:length], v.reshape(shape)[:length]

    # -- sizes ------------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """Storage bytes one token takes over all layers (K and V; fp8 scales amortised per
        block)."""
        per_elem = 4 if self.dtype == "float32" else 1
        data = 2 * self.num_layers * self.num_kv_heads * self.head_dim * per_elem
        scales = (
            0
            if self.dtype == "float32"
            else 2 * self.num_layers * self.num_kv_heads / self.block_size
        )
        return int(np.ceil(data + scales))

    def nbytes(self) -> int:
        total = sum(a.nbytes for a in self.k + self.v)
        if self.dtype == "fp8":
            total += sum(a.nbytes for a in self.k_exp + self.v_exp)
        return total
