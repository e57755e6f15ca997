"""Fused element-wise steps of the bf16 model on a CPU, in C (``native/fused_ops.c``).

    h = rms_norm(x, w, eps)                   # bf16(x / sqrt(mean(x^2) + eps) * w), x float32 [n, hidden]
    h = add_rms_norm(x, delta, w, eps)        # x += delta (bf16, in place), then the norm; w None: the add alone
    q = rope_write(qkv, model, positions, slots, cache, layer)   # RoPE on q and k; k, v into the cache

Between two matrix products torch runs 4-8 small calls (the norm alone is seven), each reading and writing
the whole activation and paying its dispatch cost; each group here is one pass. What they compute is what the
torch lines of ``fast/engine/model.py`` compute: RoPE, the adds, the products and every bf16 rounding are the
same operations in the same order (bit for bit); only the norm's sum of squares is added in another order
(float32, before the bf16 rounding).
Conformance: *bounded*, as the bf16 model it belongs to (the engine cases compare the float32 model with the
reference; in bf16 compressed and plain weights run this same code, so their tokens stay equal).

Built on first use like the C attention; no compiler, ``UNFIRE_NATIVE=0`` or ``UNFIRE_NATIVE_FUSED=0``:
``applies`` is False and the model runs its torch lines. ``UNFIRE_NATIVE_SIMD=0`` forces the plain C loops
(the AVX-512 ones give the same bits; the tests compare them). Rows are split between torch's threads.
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
_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "unf_rms_norm_bf16": (None, [_P, _P, _I64, _I64, _F, _P, _INT]),
    "unf_add_rms_norm_bf16": (None, [_P, _P, _P, _I64, _I64, _F, _P, _INT]),
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


def _vector(w: torch.Tensor, h: int, name: str) -> None:
    if w.dtype != torch.float32 or tuple(w.shape) != (h,) or not w.is_contiguous():
        raise KernelInputError(f"{name} must be contiguous float32 of shape ({h},), got {w.dtype} {tuple(w.shape)}")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16(x / sqrt(mean(x^2) + eps) * w) per row of x (float32 [n, h])."""
    _rows(x, torch.float32, "x")
    n, h = x.shape
    _vector(w, h, "the norm weight")
    out = torch.empty((n, h), dtype=torch.bfloat16)
    lib, simd = _state["lib"], _simd()
    _split(n, lambda lo, hi: lib.unf_rms_norm_bf16(x.data_ptr() + lo * h * 4, w.data_ptr(), hi - lo, h, eps,
                                                   out.data_ptr() + lo * h * 2, simd))
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """x += delta in place (delta bf16 [n, h], widened exactly), then ``rms_norm(x, w, eps)``; None if w is None."""
    _rows(x, torch.float32, "x")
    delta = delta.contiguous()
    _rows(delta, torch.bfloat16, "delta")
    if delta.shape != x.shape:
        raise KernelInputError(f"delta has shape {tuple(delta.shape)}, x {tuple(x.shape)}")
    n, h = x.shape
    if w is not None:
        _vector(w, h, "the norm weight")
    out = None if w is None else torch.empty((n, h), dtype=torch.bfloat16)
    lib, simd = _state["lib"], _simd()
    _split(n, lambda lo, hi: lib.unf_add_rms_norm_bf16(
        x.data_ptr() + lo * h * 4, delta.data_ptr() + lo * h * 2, None if w is None else w.data_ptr(), hi - lo, h,
        eps, None if out is None else out.data_ptr() + lo * h * 2, simd))
    return out


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
