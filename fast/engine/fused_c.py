"""Element-wise steps of the bf16 model on a CPU, each in one C pass (``native/fused_ops.c``).

    q = rope_write(qkv, cos, signed_sin, positions, slots, cache, layer, heads)   # q, k rotated; k, v stored
    h = add_rms_norm(x, delta, weight, eps, x_out)   # x_out = x + float(delta); h = bf16(rms_norm(x_out))
    h = add_rms_norm(x, None, weight, eps)           # the norm alone;  add_rms_norm(x, d, None, eps, x_out): the add
    act = silu_mul(gate_up)                          # F.silu(gate) * up of a fused gate/up projection (AVX-512 only)

Torch needs about ten calls for each (RoPE: widen q and k, roll, two products, a sum, two roundings, two indexed
stores, a copy of q; the residual add and RMSNorm: widen the product, add, square, sum, divide, add eps, sqrt,
divide, scale, round), each reading and writing the activation and paying its dispatch cost. The C passes perform
the very same float32 operations in the same order with the same roundings, so the model's outputs are bit for bit
those of its torch lines (``fast/engine/model.py``; the tests compare). For the norm that takes two things:
* the order of the sum of squares: ATen adds a float32 row in a cascade of vector-wide partial sums, as wide as the
  sum kernel torch runs on this CPU (8 floats with torch 2.13 on x86, AVX-512 CPUs included); the C adds in that
  order (``native/fused_ops.c`` spells it out), the width found once on a probe (``norm_lanes``: 8 or 16, bit for
  bit against the torch lines, else the torch lines run);
* torch's own sqrt: torch's float32 sqrt on a CPU is MKL's, within about one ulp but not the correctly rounded
  one of C (it differs on ~15% of inputs), so the norm is two C passes (add and mean squares; scale and round)
  around ``torch.sqrt`` of the n row means.
silu(gate) * up (torch: silu widened to float32, g / (1 + exp(-g)) with its vectorised exp, rounded to bf16; then
the product rounded again): a bf16 gate takes only 65536 values, so torch's own ``F.silu`` over all of them, once
per process, is a table of its vectorised results (``silu_table``), which the C looks up 16 gates at a time (one
gather) in the 64-value steps torch's vector loop takes; the rest of a row goes through libm's expf as torch's
scalar loop. Checked on a probe against ``F.silu(gate) * up`` before first use (else the torch lines run). The
table replaced a call of torch's SLEEF exp (found in libtorch) per 16 values: same bits, 0.58 s against 0.67-0.85 s
of silu per bench_engine run (SmolLM2, 64 ShareGPT requests, one EPYC core; 638M values). AVX-512 loops
only (``UNFIRE_NATIVE_SIMD=0`` or ``UNFIRE_NATIVE_SILU=0``: the torch lines). In the other fused ops NaN payloads
may differ from torch's (both NaN).
A first fused norm (16 plain partial sums, C's sqrt) was dropped: its other bits flipped bf16 roundings that
SmolLM2 in bf16 amplified into another greedy answer (README's example).

``UNFIRE_CPU_ISA`` (``fast.cpu_isa``) caps them: ``avx512`` and ``amx`` the AVX-512 loops; ``avx2``, ``neon`` and
``scalar`` the torch lines, as on a CPU without AVX-512 (the plain C loops where ``UNFIRE_NATIVE_SIMD=0`` forces
them). A set this CPU lacks raises ``CpuIsaError`` at the first call.

Built on first use like the C attention; no compiler, ``UNFIRE_NATIVE=0`` or ``UNFIRE_NATIVE_FUSED=0``:
``applies`` / ``norm_applies`` are False and the model runs its torch lines (``UNFIRE_NATIVE_NORM=0``: the norm
alone). ``UNFIRE_NATIVE_SIMD=0`` forces the plain C loops (the AVX-512 ones give the same bits). Rows are split
between torch's threads. Conformance: *exact* with the torch lines they replace (tests/test_fast_fused.py), and
*bounded* against the float64 reference (``conformance/cases/fused_cases.py``).
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
from fast.engine.elementwise_torch import rms_norm  # the torch lines the C norm replaces
from fast.errors import KernelInputError
from fast.kv.cache import PagedKVCache

SOURCE = Path(__file__).with_name("native") / "fused_ops.c"
_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "unf_rope_write_bf16": (_INT, [_P, _I64, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _I64, _P, _P, _P, _INT]),
    "unf_fused_simd": (_INT, []),
    "unf_add_mean_squares": (_INT, [_P, _P, _P, _I64, _I64, ctypes.c_float, _P, _I64, _INT]),
    "unf_scale_rows_bf16": (None, [_P, _P, _P, _I64, _I64, _P, _INT]),
    "unf_silu_mul_bf16": (_INT, [_P, _I64, _I64, _I64, _P, _P, _INT]),
    "unf_add_rms_norm_bf16": (_INT, [_P, _P, _P, _P, _I64, _I64, ctypes.c_float, _P, _I64, _P, _INT]),
}

ROPE_ERRORS = {1: "a position outside the RoPE tables", 2: "a slot outside the cache", 3: "an odd head size"}
MIN_ROWS_PER_THREAD = 16
_pool: dict[int, ThreadPoolExecutor] = {}
_lanes: dict[str, int | None] = {}  # norm_lanes' probe, once per process
_silu: dict[str, torch.Tensor | None] = {}  # silu_applies' probe: the table of torch's silu, once per process


def library() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None if it cannot be (or is switched off)."""
    if os.environ.get("UNFIRE_NATIVE_FUSED", "1") == "0":
        return None
    return build_c.load(_state, _lock, SOURCE, _SIGNATURES, "the fused C ops", "the torch lines")


def _simd() -> int:
    """The C calls' ``simd``: 1 (the AVX-512 loops, where the CPU has them) unless ``UNFIRE_CPU_ISA`` is below
    ``avx512`` or ``UNFIRE_NATIVE_SIMD=0`` forces the plain loops."""
    return int(build_c.isa_allows("avx512") and os.environ.get("UNFIRE_NATIVE_SIMD", "1") != "0")


def _runs_here(lib: ctypes.CDLL) -> bool:
    """Whether the C ops run: with the AVX-512 loops (the CPU has them, ``UNFIRE_CPU_ISA`` allows them), or the plain
    loops forced by ``UNFIRE_NATIVE_SIMD=0`` (slower than torch's own vector loops otherwise: the torch lines run)."""
    return bool(_simd() and lib.unf_fused_simd()) or os.environ.get("UNFIRE_NATIVE_SIMD", "1") == "0"


def applies(dtype: torch.dtype, device: torch.device, cache: PagedKVCache) -> bool:
    """Whether a model in ``dtype`` on ``device`` with this cache runs the fused ops (bf16 both, CPU, built,
    ``_runs_here``)."""
    if device.type != "cpu" or dtype != torch.bfloat16 or cache.dtype != "bfloat16" or cache.head_dim % 2:
        return False
    lib = library()
    return lib is not None and _runs_here(lib)


def norm_lanes() -> int | None:
    """The vector width (floats) of torch's row sums on this CPU, whose summation order the C norm follows, found
    once on a probe: the C norm with 8 and 16 lanes (both loop sets) against the model's torch lines on random rows
    of several lengths, bit for bit; None where neither matches (the torch lines run) or the library is not built."""
    if "lanes" not in _lanes:  # two threads probing at once would both find the same width
        _lanes["lanes"] = _probe_lanes()
    return _lanes["lanes"]


def _probe_lanes() -> int | None:
    lib = library()
    if lib is None:
        return None
    gen = torch.Generator().manual_seed(0)
    rows = [(torch.randn((3, h), generator=gen) * 3, torch.randn(h, generator=gen)) for h in (9, 40, 100, 576, 2500)]
    expected = [rms_norm(x, w, 1e-5).bfloat16().view(torch.int16) for x, w in rows]

    def matches(lanes: int, simd: int) -> bool:
        for (x, w), want in zip(rows, expected, strict=True):
            if not torch.equal(_norm(lib, x, None, None, w, 1e-5, lanes, simd).view(torch.int16), want):
                return False
        return True

    simds = (0, 1) if lib.unf_fused_simd() else (0,)
    lanes = next((lanes for lanes in (8, 16) if all(matches(lanes, simd) for simd in simds)), None)
    sqrt = _torch_symbol("VMSSQRT_") if lanes is not None else None
    if sqrt is not None:  # the one-call norm, MKL's sqrt called from C: kept if its bits are the torch lines' too
        for (x, w), want in zip(rows, expected, strict=True):
            out = torch.empty(x.shape, dtype=torch.bfloat16)
            for simd in simds:
                code = lib.unf_add_rms_norm_bf16(x.data_ptr(), None, None, w.data_ptr(), x.shape[0], x.shape[1], 1e-5,
                                                 out.data_ptr(), lanes, sqrt, simd)
                if code or not torch.equal(out.view(torch.int16), want):
                    sqrt = None
    _lanes["sqrt"] = sqrt
    return lanes


def norm_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model in ``dtype`` on ``device`` runs the C residual add + RMSNorm (bf16 on a CPU, built, a known
    summation order, with AVX-512 unless the plain loops are forced)."""
    if (device.type != "cpu" or dtype != torch.bfloat16 or os.environ.get("UNFIRE_NATIVE_NORM", "1") == "0"
            or norm_lanes() is None):
        return False
    lib = library()
    return lib is not None and _runs_here(lib)


def _torch_symbol(name: str) -> int | None:
    """The address of a function libtorch_cpu exports (the MKL vector maths torch's kernels call), or None."""
    import glob

    for path in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.*"))):
        try:
            fn = getattr(ctypes.CDLL(path), name)  # noqa: B009 (the name is a parameter)
        except (OSError, AttributeError):
            continue
        return ctypes.cast(fn, ctypes.c_void_p).value
    return None


def every_bf16() -> torch.Tensor:
    """All 65536 bf16 values, entry b the one whose bits are b (NaNs and infinities included)."""
    bits = torch.arange(65536, dtype=torch.int32)
    return torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.bfloat16)


def silu_table() -> torch.Tensor:
    """int16 [65538]: entry b is the bits of torch's ``F.silu`` of the bf16 whose bits are b (computed by torch, in
    its vectorised loop: 65536 values, a whole number of its 64-value steps), then two zeros (the C gathers 32 bits
    at entry b)."""
    import torch.nn.functional as F

    with torch.inference_mode():
        table = F.silu(every_bf16()).view(torch.int16)
    return torch.cat([table, torch.zeros(2, dtype=torch.int16)])


def silu_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model in ``dtype`` on ``device`` runs the C silu(gate) * up (bf16 on a CPU with AVX-512, built,
    ``UNFIRE_NATIVE_SILU`` not 0, and the result equal to the torch lines on a probe: rows of several lengths,
    values over the range where the sigmoid saturates)."""
    if (device.type != "cpu" or dtype != torch.bfloat16 or os.environ.get("UNFIRE_NATIVE_SILU", "1") == "0"
            or not _simd()):
        return False
    lib = library()
    if lib is None or not lib.unf_fused_simd():
        return False
    if "table" not in _silu:
        _silu["table"] = _probe_silu(lib)
    return _silu["table"] is not None


def _probe_silu(lib: ctypes.CDLL) -> torch.Tensor | None:
    import torch.nn.functional as F

    table = silu_table()
    gen = torch.Generator().manual_seed(0)
    for n, inter in ((3, 1536), (2, 100), (5, 37), (1, 64), (4, 700)):
        gu = (torch.randn((n, 2 * inter), generator=gen) * 6).bfloat16()
        out = torch.empty((n, inter), dtype=torch.bfloat16)
        if lib.unf_silu_mul_bf16(gu.data_ptr(), n, inter, 2 * inter, out.data_ptr(), table.data_ptr(), 1):
            return None
        gate, up = gu.chunk(2, dim=-1)
        if not torch.equal(out.view(torch.int16), (F.silu(gate) * up).view(torch.int16)):
            return None
    return table


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate, up = gate_up.chunk(2, dim=-1)`` (bf16 [n, 2 inter] -> bf16 [n, inter]),
    torch's bits (its own silu, tabled; ``silu_applies`` must be True)."""
    _rows(gate_up, torch.bfloat16, "gate_up")
    n, width = gate_up.shape
    if width % 2:
        raise KernelInputError(f"gate_up has an odd width {width}: not a fused gate/up projection")
    table = _silu.get("table")
    if table is None or not _simd():
        raise KernelInputError("the C silu does not run here (see silu_applies)")
    inter = width // 2
    out = torch.empty((n, inter), dtype=torch.bfloat16)
    lib = _state["lib"]
    codes = _split(n, lambda lo, hi: lib.unf_silu_mul_bf16(gate_up.data_ptr() + lo * width * 2, hi - lo, inter,
                                                           width, out.data_ptr() + lo * inter * 2, table.data_ptr(), 1))
    bad = next((c for c in codes if c), 0)
    if bad:
        raise KernelInputError(f"silu_mul (C): error {bad}")
    return out


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
    (tables float32 [max_position, d]: cos and the sine with its first half negated,
    ``elementwise_torch.signed``), k and v stored at ``slots`` of cache layer ``layer``; returns q
    (bf16 [n, heads, d])."""
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
    cache.wrote(layer)
    return q


def _norm(lib: ctypes.CDLL, x: torch.Tensor, delta: torch.Tensor | None, x_out: torch.Tensor | None,
          weight: torch.Tensor | None, eps: float, lanes: int, simd: int,
          out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The two C passes around torch's sqrt (checked arguments; see ``add_rms_norm``); one C call where torch's
    sqrt (MKL's) can be called from C (``_lanes["sqrt"]``, found by the probe)."""
    n, h = x.shape
    sqrt = _lanes.get("sqrt")
    if sqrt is not None and weight is not None:
        out = torch.empty((n, h), dtype=torch.bfloat16) if out is None else out
        dp = None if delta is None else delta.data_ptr()
        xo = None if x_out is None else x_out.data_ptr()
        codes = _split(n, lambda lo, hi: lib.unf_add_rms_norm_bf16(
            x.data_ptr() + lo * h * 4, dp and dp + lo * h * 2, xo and xo + lo * h * 4, weight.data_ptr(), hi - lo, h,
            eps, out.data_ptr() + lo * h * 2, lanes, sqrt, simd))
        bad = next((c for c in codes if c), 0)
        if bad:
            raise KernelInputError(f"add_rms_norm (C): error {bad}")
        return out
    ms = torch.empty(n, dtype=torch.float32) if weight is not None else None
    dp = None if delta is None else delta.data_ptr()
    xo = None if x_out is None else x_out.data_ptr()
    mp = None if ms is None else ms.data_ptr()
    codes = _split(n, lambda lo, hi: lib.unf_add_mean_squares(
        x.data_ptr() + lo * h * 4, dp and dp + lo * h * 2, xo and xo + lo * h * 4, hi - lo, h, eps,
        mp and mp + lo * 4, lanes, simd))
    bad = next((c for c in codes if c), 0)
    if bad:
        raise KernelInputError(f"add_rms_norm (C): error {bad}")
    if weight is None or ms is None:
        return None
    ms.sqrt_()  # torch's own float32 sqrt (MKL's, not correctly rounded): the torch lines' bits
    out = torch.empty((n, h), dtype=torch.bfloat16) if out is None else out
    src = x if delta is None else x_out
    assert src is not None
    _split(n, lambda lo, hi: lib.unf_scale_rows_bf16(src.data_ptr() + lo * h * 4, ms.data_ptr() + lo * 4,
                                                     weight.data_ptr(), hi - lo, h, out.data_ptr() + lo * h * 2,
                                                     simd))
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                 x_out: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The residual add and the next RMSNorm of the bf16 model, torch's bits (``fast/engine/model.py``'s lines
    ``x = x + delta.float()`` and ``rms_norm(x, weight, eps).to(torch.bfloat16)``): one C pass for the add and
    the mean squares, torch's sqrt on those n values, one C pass for the scaled bf16 rows.

    x: float32 [n, h]; delta: bf16 [n, h] or None (the norm of x alone); x_out: where x + float(delta) goes
    (float32 [n, h], may be x itself; required with delta); weight: float32 [h], or None for the add alone;
    out: where the normed rows go (contiguous bf16 [n, h]; None: a new tensor). Returns the normed rows (bf16
    [n, h]), or None without a weight."""
    _rows(x, torch.float32, "x")
    h = x.shape[1]
    if delta is not None:
        _rows(delta, torch.bfloat16, "delta")
        if x_out is None:
            raise KernelInputError("add_rms_norm with delta needs x_out (x itself for an in-place add)")
        _rows(x_out, torch.float32, "x_out")
        if delta.shape != x.shape or x_out.shape != x.shape:
            raise KernelInputError(f"x {tuple(x.shape)}, delta {tuple(delta.shape)} and x_out "
                                   f"{tuple(x_out.shape)} must have one shape")
    elif weight is None:
        raise KernelInputError("add_rms_norm needs a delta, a weight or both")
    if weight is not None and (weight.dtype != torch.float32 or tuple(weight.shape) != (h,)
                               or not weight.is_contiguous()):
        raise KernelInputError(f"weight must be contiguous float32 of shape ({h},), got {weight.dtype} "
                               f"{tuple(weight.shape)}")
    if out is not None:
        _rows(out, torch.bfloat16, "out")
        if out.shape != x.shape:
            raise KernelInputError(f"out {tuple(out.shape)} must have x's shape {tuple(x.shape)}")
    lanes = norm_lanes()
    if lanes is None:
        raise KernelInputError("the C norm does not know this CPU's summation order (see norm_applies)")
    return _norm(_state["lib"], x, delta, x_out, weight, eps, lanes, _simd(), out)


class StepOps:
    """The fused ops for the layers of one step on one thread, with what those layers share checked once.

    ``rope_write``, ``add_rms_norm`` and ``silu_mul`` check every argument on every call: about 30 Python-level
    steps each, paid 3-4 times per layer and step, which on a loaded cache cost as much as their C work at decode
    sizes. A step's positions, slots, tables, cache and row count are the same for all layers, so ``bind`` checks
    them once and the methods below only look at what changes per layer (each tensor's shape, dtype and layout,
    one comparison each) before calling C with pointers. Same C functions, same bits. ``bind`` returns None where
    a method could not take the fast way (more than one torch thread: the public functions split rows between
    threads; the C norm or silu not applicable; RoPE's inputs not as ``rope_write`` takes them); the model then
    calls the public functions."""

    def __init__(self, lib: ctypes.CDLL, cache: PagedKVCache, heads: int, n: int, rope_args: tuple[object, ...],
                 lanes: int, sqrt: int, silu: int, simd: int):
        self.lib, self.cache, self.heads, self.n = lib, cache, heads, n
        self.kv, self.d = cache.num_kv_heads, cache.head_dim
        self.width = (heads + 2 * self.kv) * self.d
        self.rope_args, self.lanes, self.sqrt, self.silu, self.simd = rope_args, lanes, sqrt, silu, simd
        self.k = [t.data_ptr() for t in cache.k]
        self.v = [t.data_ptr() for t in cache.v]

    @classmethod
    def bind(cls, cache: PagedKVCache, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
             positions: torch.Tensor, slots: torch.Tensor) -> StepOps | None:
        """The ops for one step of ``positions.numel()`` rows, or None (see the class)."""
        n, d = positions.numel(), cache.head_dim
        if (torch.get_num_threads() != 1 or not applies(torch.bfloat16, torch.device("cpu"), cache)
                or not norm_applies(torch.bfloat16, torch.device("cpu"))
                or not silu_applies(torch.bfloat16, torch.device("cpu"))):
            return None
        lanes, sqrt, table = norm_lanes(), _lanes.get("sqrt"), _silu.get("table")
        if lanes is None or sqrt is None or table is None:
            return None
        for t in (positions, slots):
            if t.dtype != torch.int64 or tuple(t.shape) != (n,) or not t.is_contiguous():
                return None
        for t in (cos, signed_sin):
            if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != d or not t.is_contiguous():
                return None
        if any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in (*cache.k, *cache.v)):
            return None
        rope_args = (cos.data_ptr(), signed_sin.data_ptr(), cos.shape[0], positions.data_ptr(), slots.data_ptr(),
                     cache.num_blocks * cache.block_size)
        return cls(_state["lib"], cache, heads, n, rope_args, lanes, sqrt, table.data_ptr(), _simd())

    def rope_write(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        """``rope_write(qkv, cos, signed_sin, positions, slots, cache, layer, heads)`` of the bound step."""
        if qkv.dtype != torch.bfloat16 or qkv.shape != (self.n, self.width) or not qkv.is_contiguous():
            raise KernelInputError(f"qkv must be contiguous bf16 [{self.n}, {self.width}], got {qkv.dtype} "
                                   f"{tuple(qkv.shape)}")
        q = torch.empty((self.n, self.heads, self.d), dtype=torch.bfloat16)
        c, s, npos, pos, slots, nslots = self.rope_args
        bad = self.lib.unf_rope_write_bf16(qkv.data_ptr(), self.n, self.heads, self.kv, self.d, c, s, npos, pos,
                                           slots, nslots, self.k[layer], self.v[layer], q.data_ptr(), self.simd)
        if bad:
            raise KernelInputError(f"rope_write (C): {ROPE_ERRORS.get(bad, f'error {bad}')}")
        self.cache.wrote(layer)
        return q

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                     x_out: torch.Tensor | None = None) -> torch.Tensor | None:
        """``add_rms_norm`` (same arguments) for rows of this step's row count or fewer (the pruned last layer)."""
        n, h = x.shape
        same = (x.dtype == torch.float32 and x.is_contiguous()
                and (delta is None or (delta.dtype == torch.bfloat16 and delta.shape == x.shape
                                       and delta.is_contiguous() and x_out is not None
                                       and x_out.dtype == torch.float32 and x_out.shape == x.shape
                                       and x_out.is_contiguous()))
                and (weight is None or (weight.dtype == torch.float32 and weight.shape == (h,)
                                        and weight.is_contiguous())))
        if not same or weight is None:
            return add_rms_norm(x, delta, weight, eps, x_out)  # checks and says what is wrong; the add alone
        out = torch.empty((n, h), dtype=torch.bfloat16)
        bad = self.lib.unf_add_rms_norm_bf16(x.data_ptr(), None if delta is None else delta.data_ptr(),
                                             None if x_out is None else x_out.data_ptr(), weight.data_ptr(), n, h, eps,
                                             out.data_ptr(), self.lanes, self.sqrt, self.simd)
        if bad:
            raise KernelInputError(f"add_rms_norm (C): error {bad}")
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu_mul(gate_up)``."""
        n, width = gate_up.shape
        if gate_up.dtype != torch.bfloat16 or width % 2 or not gate_up.is_contiguous():
            return silu_mul(gate_up)  # checks and says what is wrong
        out = torch.empty((n, width // 2), dtype=torch.bfloat16)
        bad = self.lib.unf_silu_mul_bf16(gate_up.data_ptr(), n, width // 2, width, out.data_ptr(), self.silu,
                                         self.simd)
        if bad:
            raise KernelInputError(f"silu_mul (C): error {bad}")
        return out
