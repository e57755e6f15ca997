"""The RoPE rotation and the KV cache write of the bf16 model on a CPU, in one C pass (``native/fused_ops.c``).

    q = rope_write(qkv, cos, signed_sin, positions, slots, cache, layer, heads)   # q, k rotated; k, v stored

Torch needs about ten calls for this per layer (widen q and k, roll, two products, a sum, two roundings, two
indexed stores, a copy of q), each reading and writing the activation and paying its dispatch cost. The C
pass performs the very same float32 operations in the same order with the same roundings, so the model's
outputs are bit for bit those of its torch lines (``fast/engine/model.py``; the tests compare). Fusing the
residual add with the next RMSNorm was tried too and dropped: its sum of squares, added in another order than
torch's, flipped bf16 roundings that SmolLM2 in bf16 amplified into another greedy answer (README's example).

Built on first use like the C attention; no compiler, ``UNFIRE_NATIVE=0`` or ``UNFIRE_NATIVE_FUSED=0``:
``applies`` is False and the model runs its torch lines. ``UNFIRE_NATIVE_SIMD=0`` forces the plain C loops
(the AVX-512 ones give the same bits). Rows are split between torch's threads. Conformance: *exact* with the
torch lines it replaces.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fast.codec import native_build
from fast.errors import KernelInputError
from fast.kv.cache import PagedKVCache

SOURCE = Path(__file__).with_name("native") / "fused_ops.c"
_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "unf_rope_write_bf16": (_INT, [_P, _I64, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _I64, _P, _P, _P, _INT]),
    "unf_fused_simd": (_INT, []),
}
ROPE_ERRORS = {1: "a position outside the RoPE tables", 2: "a slot outside the cache", 3: "an odd head size"}
MIN_ROWS_PER_THREAD = 16
_pool: dict[int, ThreadPoolExecutor] = {}


def library() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None if it cannot be (or is switched off)."""
    if os.environ.get("UNFIRE_NATIVE_FUSED", "1") == "0":
        return None
    return native_build.load(_state, _lock, SOURCE, _SIGNATURES, "the fused C ops", "the torch lines")


def _simd() -> int:
    return int(os.environ.get("UNFIRE_NATIVE_SIMD", "1") != "0")


def applies(dtype: torch.dtype, device: torch.device, cache: PagedKVCache) -> bool:
    """Whether a model in ``dtype`` on ``device`` with this cache runs the fused ops (bf16 both, CPU, built,
    with AVX-512 unless the plain loops are forced: slower than torch's own vector loops otherwise)."""
    if device.type != "cpu" or dtype != torch.bfloat16 or cache.dtype != "bfloat16" or cache.head_dim % 2:
        return False
    lib = library()
    return lib is not None and (not _simd() or bool(lib.unf_fused_simd()))


def _split(n: int, run: Callable[[int, int], int | None]) -> list[int | None]:
    """run(lo, hi) over row ranges covering [0, n): one call, or one per torch thread for many rows."""
    threads = max(1, min(torch.get_num_threads(), n // MIN_ROWS_PER_THREAD))
    if threads == 1:
        return [run(0, n)]
    share = -(-n // threads)
    pool = _pool.get(threads) or _pool.setdefault(threads, ThreadPoolExecutor(threads - 1))
    rest = [pool.submit(run, t * share, min(n, (t + 1) * share)) for t in range(1, threads)]
    return [run(0, min(n, share))] + [f.result() for f in rest]


def _rows(x: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if x.dtype != dtype or x.dim() != 2 or not x.is_contiguous() or x.device.type != "cpu":
        raise KernelInputError(f"{name} must be a contiguous 2-D {dtype} CPU tensor, got {x.dtype} "
                               f"{tuple(x.shape)}")


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, cache: PagedKVCache, layer: int, heads: int) -> torch.Tensor:
    """From a fused projection qkv (bf16 [n, (heads + 2 kv) d]): q and k rotated by RoPE at ``positions``
    (tables float32 [max_position, d]: cos and the sine with its first half negated, ``model.signed``), k and v
    stored at ``slots`` of cache layer ``layer``; returns q (bf16 [n, heads, d])."""
    kv, d = cache.num_kv_heads, cache.head_dim
    qkv = qkv.contiguous()
    _rows(qkv, torch.bfloat16, "qkv")
    n = qkv.shape[0]
    if qkv.shape[1] != (heads + 2 * kv) * d:
        raise KernelInputError(f"qkv has width {qkv.shape[1]}, heads {heads} + 2 x {kv} kv heads of {d} need "
                               f"{(heads + 2 * kv) * d}")
    for name, t in (("positions", positions), ("slots", slots)):
        if t.dtype != torch.int64 or tuple(t.shape) != (n,) or not t.is_contiguous():
            raise KernelInputError(f"{name} must be contiguous int64 of shape ({n},), got {t.dtype} {tuple(t.shape)}")
    for name, t in (("cos", cos), ("signed_sin", signed_sin)):
        if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != d or not t.is_contiguous():
            raise KernelInputError(f"{name} must be a contiguous float32 [positions, {d}] table")
    if not 0 <= layer < cache.num_layers:
        raise KernelInputError(f"layer {layer} is outside [0, {cache.num_layers})")
    k, v = cache.k[layer], cache.v[layer]
    if k.dtype != torch.bfloat16 or not (k.is_contiguous() and v.is_contiguous()):
        raise KernelInputError("rope_write needs a contiguous bf16 cache")
    q = torch.empty((n, heads, d), dtype=torch.bfloat16)
    lib, simd, width = _state["lib"], _simd(), qkv.shape[1]
    codes = _split(n, lambda lo, hi: lib.unf_rope_write_bf16(
        qkv.data_ptr() + lo * width * 2, hi - lo, heads, kv, d, cos.data_ptr(), signed_sin.data_ptr(), cos.shape[0],
        positions.data_ptr() + lo * 8, slots.data_ptr() + lo * 8, cache.num_blocks * cache.block_size,
        k.data_ptr(), v.data_ptr(), q.data_ptr() + lo * heads * d * 2, simd))
    bad = next((c for c in codes if c), 0)
    if bad:
        raise KernelInputError(f"rope_write (C): {ROPE_ERRORS.get(bad, f'error {bad}')}")
    if cache.on_write is not None:  # as PagedKVCache.write does
        cache.on_write(layer)
    return q
