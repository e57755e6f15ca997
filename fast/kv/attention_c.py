"""Paged attention in C on a CPU (``native/decode_attention.c``): bf16 cache, bf16 queries, one query per row.

    ok = decode_rows(q, cache, layer, step, chunks, rows, scale, out)            # decode rows
    ok = decode_rows(q, cache, layer, step, chunks, rows, scale, out, lengths)   # prefill rows, causal
    # False: not applicable, use torch

Each sequence's keys and values are read in place through its block table, up to the row's length
(a decode row: the whole sequence; a prefill chunk's row: the positions up to its own): no gather
into padded scratch copies (the torch path's largest cost), no zeroing of unused slots (they are
never read), and grouped-query heads read their kv head once. Products and the softmax are float32
(the torch path rounds scores and weights to bf16), the output is rounded to bf16 once, so it meets
the tighter of the two attention bounds of ``conformance/cases/kv_cases.py`` (level *bounded*:
bound B1 of ``kv.decode_attention.bf16_query.bfloat16.native`` and of the prefill case's rows).

Four paths, one answer within one bf16 step (``UNFIRE_NATIVE_SIMD`` picks for tests): on a CPU with AMX
(Sapphire Rapids and later; head sizes 32/64/128) tile products for every row, decode and prefill alike: scores
by TDPBF16PS, the float32 weights split exactly into three bf16 parts for the values' products, so nothing is
rounded below float32 (prefill attention 2.3-4.1x the loops below, a 2048-token prompt's whole prefill step
2.5x; decode rows with their K/V cold 0.93x, the bench_engine workload 1.01x:
experiments/engine/bench_attention_cpu.py);
on a CPU with AVX-512 BF16 (Zen 4/5; ``=3`` forces it where AMX is there too) and head sizes 16/32/64/128,
VDPBF16PS scores of 16 positions at a time (exact bf16 products, float32 sums; 2.2x the float32 AVX-512 loops
on SmolLM2's decode, where it then runs at the memory's speed); AVX-512 float32 loops (``=2``); plain C (``=0``).
Whichever path a CPU takes, it takes it for every row: a row's bits do not depend on whether it is a decode row,
one of a prefill chunk's, or beside decode rows in a mixed step, so chunking, prefix caching, preemption and the
disaggregated and pipelined topologies give the same tokens.

``UNFIRE_CPU_ISA`` (``fast.cpu_isa``) caps the paths: ``amx`` as above; ``avx512`` the AVX-512 BF16 loops (where
``UNFIRE_NATIVE_SIMD`` says 1; 2 and 0 as said); ``avx2`` the plain C loops compiled for AVX2 (the compiler
vectorises their explicit lanes; the same bits as the portable build), ``neon`` and ``scalar`` the plain C loops.
Each row is then computed alone, whatever its batch (the torch path's padded batch products are not
batch-invariant), so every CPU keeps the topologies' tokens equal. A set this CPU lacks raises ``CpuIsaError`` at
the first call.

Built on first use by ``fast.build_c`` with the system compiler; no compiler, a failed
build, ``UNFIRE_NATIVE=0`` or ``UNFIRE_NATIVE_ATTENTION=0``: ``decode_rows`` returns False and the
torch path runs. Single-threaded (the engine's benchmark runs one thread; with more threads the rows
are split between them, each call releasing the GIL).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fast import build_c
from fast.errors import KernelInputError
from fast.kv.cache import PagedKVCache
from fast.kv.step import KVStep

SOURCE = Path(__file__).with_name("native") / "decode_attention.c"
_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {"unf_decode_attention": (ctypes.c_int, [_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64,
                                                       _I64, _I64, _I64, _F, _P, _P, ctypes.c_int]),
               "unf_decode_attention_simd": (ctypes.c_int, []), "unf_decode_attention_amx": (ctypes.c_int, []),
               "unf_decode_attention_last_path": (ctypes.c_int, []),
               "unf_decode_attention_scratch": (ctypes.c_int64, [_I64, _I64, _I64, _I64])}
ERRORS = {1: "a length outside [1, block table width * block_size], past the host lengths or past its sequence's",
          2: "a block id outside [0, num_blocks)", 3: "head sizes the C kernel does not take"}
MAX_HEAD_DIM = 256
_pool: dict[int, ThreadPoolExecutor] = {}
_simd_found: dict[str, bool] = {}


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None if it cannot be (or native code is switched off)."""
    if os.environ.get("UNFIRE_NATIVE_ATTENTION", "1") == "0":
        return None
    return build_c.load(_state, _lock, SOURCE, _SIGNATURES, "the C decode attention", "the torch path")


def applies(q: torch.Tensor, cache: PagedKVCache) -> bool:
    """Whether the C kernel serves these queries and cache (CPU, bf16 both, head sizes it takes)."""
    d, kv = cache.head_dim, cache.num_kv_heads
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and cache.dtype == "bfloat16"
            and d % 16 == 0 and d <= MAX_HEAD_DIM and q.shape[1] % kv == 0 and _usable())


def has_simd() -> bool:
    """Whether the kernel is built and runs its AVX-512 loops here: this CPU has them and ``UNFIRE_CPU_ISA``
    allows ``avx512``."""
    lib = library()
    if lib is None or not build_c.isa_allows("avx512"):
        return False
    if "simd" not in _simd_found:  # the CPU does not change: asked once
        _simd_found["simd"] = bool(lib.unf_decode_attention_simd())
    return _simd_found["simd"]


def has_amx() -> bool:
    """Whether the kernel is built and runs its AMX path here (tile products; Sapphire Rapids and later):
    this CPU has it and ``UNFIRE_CPU_ISA`` allows ``amx``."""
    lib = library()
    if lib is None or not build_c.isa_allows("amx"):
        return False
    if "amx" not in _simd_found:
        _simd_found["amx"] = bool(lib.unf_decode_attention_amx())
    return _simd_found["amx"]


def last_path() -> str:
    """The path the kernel's last call in this process took ("amx", "avx512-bf16", "avx512", "plain", "none")."""
    lib = library()
    code = lib.unf_decode_attention_last_path() if lib is not None else -1
    return {4: "amx", 3: "avx512-bf16", 2: "avx512", 5: "plain-avx2", 0: "plain"}.get(code, "none")


def simd_level() -> int:
    """``UNFIRE_NATIVE_SIMD`` as the kernel's ``simd`` argument: 1 (default) the best path this CPU has (AMX, then
    AVX-512 BF16), 3 the AVX-512 BF16 loops even where AMX is there, 2 AVX-512 float32 loops, 0 plain C loops;
    capped by ``UNFIRE_CPU_ISA``: 1 is 3 below ``amx``; below ``avx512`` the plain loops, in their AVX2 build (4)
    where ``avx2`` is allowed and ``UNFIRE_NATIVE_SIMD`` is not 0."""
    simd = {"0": 0, "2": 2, "3": 3}.get(os.environ.get("UNFIRE_NATIVE_SIMD", "1"), 1)
    if not build_c.isa_allows("avx512"):
        return 4 if simd and build_c.isa_allows("avx2") else 0
    return 3 if simd == 1 and not build_c.isa_allows("amx") else simd


def _usable() -> bool:
    """Built (on every CPU: below AVX-512 the plain loops serve, one row at a time, batch-invariant)."""
    if library() is None:
        return False
    build_c.isa_allows("scalar")  # an UNFIRE_CPU_ISA this CPU lacks is refused here, at the first call
    return True


def decode_rows(q: torch.Tensor, cache: PagedKVCache, layer: int, step: KVStep, chunks: torch.Tensor,
                rows: torch.Tensor, scale: float, out: torch.Tensor, lengths: torch.Tensor | None = None,
                max_len: int | None = None) -> bool:
    """Attention of query rows ``rows`` (int64) of q [T, H, D], row i belonging to chunk ``chunks[i]`` (int64
    chunk ids of ``step``), written into those rows of ``out`` [T, H, D]. Row i attends to the first
    ``lengths[i]`` positions of its sequence (int32; a prefill chunk's rows: causal), or with ``lengths`` None to
    all of them (one-token chunks: decode rows); ``max_len``: the largest length (computed if None). False
    (nothing written) where the kernel does not apply; raises KernelInputError where the lengths or block ids
    are out of range."""
    if not applies(q, cache):
        return False
    lib = _state["lib"]
    q, out_c = q.contiguous(), out if out.is_contiguous() else torch.empty_like(out)
    tables = step.block_tables if step.block_tables.is_contiguous() else step.block_tables.contiguous()
    lens = step.seq_lens
    n = chunks.numel()
    heads, d = q.shape[1], q.shape[2]
    _check_lengths(lengths, chunks)
    if max_len is None:  # for whole sequences the step's longest bounds them (it only sizes the scratch)
        max_len = (int(lengths.max()) if n else 1) if lengths is not None else max(step.max_seq_len, 1)
    threads = max(1, min(torch.get_num_threads(), n // 8))
    per_thread = lib.unf_decode_attention_scratch(heads, cache.num_kv_heads, d, max_len)
    scratch = _scratch(cache, threads * per_thread)
    k, v = cache.k[layer], cache.v[layer]
    share = -(-n // threads)
    simd = simd_level()

    def run(t: int) -> int:
        lo, hi = t * share, min(n, (t + 1) * share)
        if lo >= hi:
            return 0
        return lib.unf_decode_attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            chunks.data_ptr() + lo * 8, rows.data_ptr() + lo * 8, 0 if lengths is None else lengths.data_ptr() + lo * 4,
            hi - lo, heads, cache.num_kv_heads, d,
            cache.block_size, cache.num_blocks, tables.shape[1], max_len, scale,
            scratch.data_ptr() + t * per_thread * 4, out_c.data_ptr(), simd)

    if threads == 1:
        codes = [run(0)]
    else:
        pool = _pool.get(threads) or _pool.setdefault(threads, ThreadPoolExecutor(threads - 1))
        rest = [pool.submit(run, t) for t in range(1, threads)]
        codes = [run(0)] + [f.result() for f in rest]
    bad = next((c for c in codes if c), 0)
    if bad:
        raise KernelInputError(f"decode attention (C): {ERRORS.get(bad, f'error {bad}')}")
    if out_c is not out:
        out.copy_(out_c)
    return True


def _check_lengths(lengths: torch.Tensor | None, chunks: torch.Tensor) -> None:
    if lengths is not None and (lengths.dtype != torch.int32 or lengths.shape != chunks.shape
                                or not lengths.is_contiguous()):
        raise KernelInputError(f"lengths must be contiguous int32 of shape {tuple(chunks.shape)}")


def _scratch(cache: PagedKVCache, n: int) -> torch.Tensor:
    buf = cache.scratch.get("native.scores")
    if buf is None or buf.numel() < n:
        buf = cache.scratch["native.scores"] = torch.empty(max(n, 4096), dtype=torch.float32)
    return buf


def bind(cache: PagedKVCache, step: KVStep, heads: int, scale: float, chunks: torch.Tensor, rows: torch.Tensor,
         lengths: torch.Tensor | None, max_len: int) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
    """``decode_rows`` for every layer of one step, its arguments checked and laid out once: returns
    ``attend(q, layer) -> out`` (q bf16 [T, heads, D] contiguous, the step's T rows; out a new tensor whose rows
    ``rows`` are written: every row, as the model binds it), or None where the kernel does not apply or torch runs
    more than one thread (``decode_rows`` splits rows between threads)."""
    d, kv = cache.head_dim, cache.num_kv_heads
    probe = torch.empty((0, heads, d), dtype=torch.bfloat16)
    if torch.get_num_threads() != 1 or not applies(probe, cache):
        return None
    _check_lengths(lengths, chunks)
    lib = _state["lib"]
    tables = step.block_tables if step.block_tables.is_contiguous() else step.block_tables.contiguous()
    chunks, rows = chunks.contiguous(), rows.contiguous()
    scratch = _scratch(cache, lib.unf_decode_attention_scratch(heads, kv, d, max_len))
    simd = simd_level()
    k, v = [t.data_ptr() for t in cache.k], [t.data_ptr() for t in cache.v]
    shape = (step.num_tokens, heads, d)
    args = (tables.data_ptr(), step.seq_lens.data_ptr(), chunks.data_ptr(), rows.data_ptr(),
            None if lengths is None else lengths.data_ptr(), chunks.numel(), heads, kv, d, cache.block_size,
            cache.num_blocks, tables.shape[1], max_len, scale, scratch.data_ptr())
    keep = (tables, chunks, rows, lengths, scratch)  # alive as long as the closure: the pointers above are theirs

    def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
        if q.dtype != torch.bfloat16 or q.shape != shape or not q.is_contiguous():
            raise KernelInputError(f"q must be contiguous bf16 {list(shape)}, got {q.dtype} {tuple(q.shape)}")
        out = torch.empty(shape, dtype=torch.bfloat16)
        bad = lib.unf_decode_attention(q.data_ptr(), k[layer], v[layer], *args, out.data_ptr(), simd)
        if bad:
            raise KernelInputError(f"decode attention (C): {ERRORS.get(bad, f'error {bad}')}")
        assert keep
        return out

    return attend
