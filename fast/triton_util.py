"""Small helpers shared by the Triton kernels: where kernels may run, and rounding up."""

from __future__ import annotations

import os

import torch

from fast.errors import KernelInputError


def on_interpreter() -> bool:
    """True when Triton kernels run in the interpreter (TRITON_INTERPRET=1), i.e. on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_imported_for_interpreter() -> bool:
    """True if triton was imported with TRITON_INTERPRET=1 (its own library functions are then interpreted).

    Setting the variable after ``import triton`` is too late: kernels would call triton's compiled
    library functions (``tl.zeros``, ``tl.sum``, ...) from the interpreter and fail.
    """
    import triton.language as tl

    return type(tl.zeros).__name__ == "InterpretedFunction"


def check_kernel_device(t: torch.Tensor, name: str) -> None:
    """Raise unless a Triton kernel can read ``t`` where it lives.

    Natively, kernels need CUDA tensors. Under TRITON_INTERPRET=1 they need CPU tensors (the
    interpreter runs the kernel in NumPy on the host).
    """
    if on_interpreter():
        if not triton_imported_for_interpreter():
            raise KernelInputError(
                "TRITON_INTERPRET=1 was set after triton was imported: set it in the environment before "
                "starting Python (or import fast before triton)"
            )
        if t.device.type != "cpu":
            raise KernelInputError(f"{name}: TRITON_INTERPRET=1 runs kernels on the CPU, but {name} is on {t.device}")
    elif t.device.type != "cuda":
        raise KernelInputError(
            f"{name} is on {t.device}: Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 set in the "
            "environment before triton is imported (then they run on CPU tensors in the interpreter)"
        )


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())
