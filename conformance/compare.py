"""Compare a fast output with a reference output and describe the first difference.

Everything is brought to NumPy first. For the exact levels the arrays are compared as bit
patterns (a bf16 tensor and the reference's uint16 array are the same 16 bits), so NaN payloads,
-0.0 and infinities count. For BOUNDED cases the fast output is widened to float64 and each
element's |fast - ref| is checked against the case's bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass
class Outcome:
    """The verdict on one output pair."""

    ok: bool
    elements: int
    detail: str = ""  # empty when ok; otherwise the first difference, in words
    bound_used: float | None = None  # BOUNDED: max over elements of |fast - ref| / allowed


def to_numpy(x: Any) -> tuple[np.ndarray, str]:
    """(array, kind) where kind names how to print it: 'bf16', 'float32', 'uint16', ..."""
    try:
        import torch
    except ImportError:  # pragma: no cover - the fast path always has torch
        torch = None
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            return x.contiguous().view(torch.int16).numpy().view(np.uint16), "bf16"
        if x.dtype == torch.uint16:
            return x.contiguous().view(torch.int16).numpy().view(np.uint16), "uint16"
        a = x.contiguous().numpy()
        return a, str(a.dtype)
    a = np.asarray(x)
    return a, str(a.dtype)


def flatten_outputs(out: Any) -> dict[str, Any]:
    """One output, a tuple of them or a dict of them -> {label: output}."""
    if isinstance(out, dict):
        return {str(k): v for k, v in out.items()}
    if isinstance(out, tuple | list):
        return {f"[{i}]": v for i, v in enumerate(out)}
    return {"": out}


def _bits(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.bool_:
        return a.view(np.uint8)
    return a.view(_UINT[a.dtype.itemsize]) if a.dtype.itemsize in _UINT else a


def _show(bits: int, kind: str, itemsize: int) -> str:
    """A bit pattern in hex, with its value when the pattern is a float."""
    text = f"0x{bits:0{2 * itemsize}x}"
    if kind == "bf16":
        return f"{text} ({float(np.array([bits << 16], np.uint32).view(np.float32)[0])!r})"
    if kind in ("float32", "float16", "float64"):
        value = np.array([bits], _UINT[itemsize]).view(np.dtype(kind))[0]
        return f"{text} ({float(value)!r})"
    signed = np.array([bits], _UINT[itemsize]).view(np.dtype(f"i{itemsize}"))[0]
    return f"{text} ({int(signed)})" if kind.startswith("int") else f"{text} ({bits})"


def compare_exact(fast: Any, ref: Any) -> Outcome:
    """Bit-for-bit equality; on failure the first differing index and both bit patterns."""
    f, fkind = to_numpy(fast)
    r, rkind = to_numpy(ref)
    if f.shape != r.shape:
        return Outcome(False, int(r.size), f"shape differs: fast {f.shape} vs reference {r.shape}")
    if f.dtype.itemsize != r.dtype.itemsize:
        return Outcome(False, int(r.size), f"dtype differs: fast {fkind} vs reference {rkind}")
    fb, rb = _bits(np.ascontiguousarray(f)), _bits(np.ascontiguousarray(r))
    differ = np.flatnonzero(fb.ravel() != rb.ravel())
    if differ.size == 0:
        return Outcome(True, int(r.size))
    first = int(differ[0])
    index = np.unravel_index(first, r.shape) if r.ndim else ()
    kind = "bf16" if "bf16" in (fkind, rkind) else (fkind if fkind == rkind else rkind)
    size = r.dtype.itemsize
    detail = (f"first difference at index {list(map(int, index))} (flat {first}): "
              f"fast {_show(int(fb.ravel()[first]), kind, size)} vs reference "
              f"{_show(int(rb.ravel()[first]), kind, size)}; {differ.size} of {r.size} elements differ")
    return Outcome(False, int(r.size), detail)


def as_float64(x: Any) -> np.ndarray:
    """A fast output (bf16, float16/32 or float64) as float64 values."""
    a, kind = to_numpy(x)
    if kind == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def compare_bounded(fast: Any, ref: Any, allowed: np.ndarray) -> Outcome:
    """|fast - ref| <= allowed, element by element; NaN must meet NaN and infinities must match."""
    f, r = as_float64(fast), np.asarray(ref, dtype=np.float64)
    if f.shape != r.shape:
        return Outcome(False, int(r.size), f"shape differs: fast {f.shape} vs reference {r.shape}")
    allowed = np.broadcast_to(np.asarray(allowed, dtype=np.float64), r.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(f - r)
        nan_ok = np.isnan(f) & np.isnan(r)
        same_inf = np.isinf(r) & (f == r)
        good = nan_ok | same_inf | (err <= allowed)
        ratio = np.where(good & ~nan_ok & ~same_inf, err / np.maximum(allowed, np.finfo(np.float64).tiny), 0.0)
    used = float(ratio.max()) if ratio.size else 0.0
    bad = np.flatnonzero(~good.ravel())
    if bad.size == 0:
        return Outcome(True, int(r.size), bound_used=used)
    first = int(bad[0])
    index = list(map(int, np.unravel_index(first, r.shape))) if r.ndim else []
    detail = (f"first element outside the bound at index {index} (flat {first}): fast {float(f.ravel()[first])!r} vs "
              f"float64 {float(r.ravel()[first])!r}, |diff| {err.ravel()[first]:.3e} > allowed "
              f"{allowed.ravel()[first]:.3e}; {bad.size} of {r.size} elements outside")
    return Outcome(False, int(r.size), detail, bound_used=used)
