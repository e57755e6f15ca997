"""Per-row fp8 scales of a bf16 matrix in C: the C lesson kernel of fast/KERNELS.md (``native/row_scale.c``).

    amax, exponent = row_scales_c(x)               # x: bf16 [rows, cols] on the CPU, rows may be strided
    row_scales_c(x, out=(amax, exponent), path=AVX2)   # one path forced (the conformance case runs each)

Built on first use by ``fast.build_c`` (the system compiler, cached under ``$UNFIRE_CACHE``); ``library()`` is None
where it cannot be (no compiler, ``UNFIRE_NATIVE=0``) and ``fast.lesson.row_scale.row_scales`` then runs the torch
lines, which give the same bits. ``UNFIRE_CPU_ISA`` (``fast.cpu_isa``) caps the path: the library's
``lesson_row_scale_isa`` is called with the cap when it is loaded and whenever the variable changes.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from fast import build_c, cpu_isa
from fast.lesson.row_scale import _outputs
from fast.validate import check_tensor

SOURCE = Path(__file__).with_name("native") / "row_scale.c"
SCALAR, AVX2, NEON, AVX512 = 0, 1, 1, 2  # the C file's PATH_*
PATH_ISA = {"x86_64": {SCALAR: "scalar", AVX2: "avx2", AVX512: "avx512"}, "aarch64": {SCALAR: "scalar", NEON: "neon"}}
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "lesson_row_scale_isa": (_INT, [_INT]),
    "lesson_row_scale": (_INT, [_P, _I64, _I64, _I64, _P, _P, _INT]),
}
_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use and capped by ``UNFIRE_CPU_ISA``; None if it cannot be built."""
    return build_c.load(_state, _lock, SOURCE, _SIGNATURES, "the C row scales", "the torch lines",
                        isa="lesson_row_scale_isa")


def paths() -> list[int]:
    """The paths this CPU can run under the current cap, weakest first (the conformance case runs each)."""
    names = PATH_ISA.get(cpu_isa.arch(), {SCALAR: "scalar"})
    return [p for p, name in names.items() if build_c.isa_allows(name)]


def row_scales_c(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None, path: int = -1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax bf16 [rows], exponent int8 [rows]) of a bf16 [rows, cols] CPU tensor whose rows are contiguous."""
    check_tensor(x, "x", dtype=torch.bfloat16, ndim=2, contiguous=False, kernel_device=False)
    if x.device.type != "cpu" or (x.shape[1] > 1 and x.stride(1) != 1):
        x = x.cpu().contiguous()
    amax, exponent = _outputs(x, out)
    lib = library()
    if lib is None:
        raise RuntimeError("fast.lesson.row_scale_c: the C kernel is not built (see library())")
    if x.shape[0]:
        lib.lesson_row_scale(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), amax.data_ptr(),
                             exponent.data_ptr(), path)
    return amax, exponent
