"""Small helpers shared by the Triton kernels: where kernels may run, rounding up, and the GPU a
launcher plans for.

Launchers choose tiles, warps, stages and splits as pure functions of the shapes and a
``DeviceProps`` (SM count, shared memory per block), so the choice a GPU would make can be
computed, and compiled ahead of time, on a machine without one (``python -m conformance --compile``).
``H100`` and ``H200`` are written here; on a CUDA device ``device_props`` reads the real one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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


@dataclass(frozen=True)
class DeviceProps:
    """What a launcher needs to know about a GPU, and what its roofline needs (bytes/s, FLOP/s)."""

    name: str
    capability: int  # 90 for sm_90
    sm_count: int
    smem_per_block: int  # bytes a block may use (the opt-in maximum)
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    hbm_bytes_per_s: float = 0.0  # peak memory bandwidth (datasheet)
    bf16_flops: float = 0.0  # peak dense bf16 tensor-core FLOP/s (datasheet)


H100 = DeviceProps("H100 SXM", 90, 132, 232448, hbm_bytes_per_s=3.35e12, bf16_flops=989e12)
H200 = DeviceProps("H200 SXM", 90, 132, 232448, hbm_bytes_per_s=4.8e12, bf16_flops=989e12)
A100 = DeviceProps("A100 SXM", 80, 108, 166912, hbm_bytes_per_s=2.04e12, bf16_flops=312e12)


def device_props(device: torch.device | str | None = None) -> DeviceProps:
    """The properties of ``device`` when it is a CUDA device, else H100's (the GPU the launchers plan for)."""
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available() and not on_interpreter():
        p = torch.cuda.get_device_properties(dev if dev is not None else 0)
        known = {g.name.split()[0]: g for g in (H100, H200, A100)}
        base = next((v for k, v in known.items() if k in p.name), H100)
        return DeviceProps(p.name, p.major * 10 + p.minor, p.multi_processor_count,
                           getattr(p, "shared_memory_per_block_optin", base.smem_per_block),
                           hbm_bytes_per_s=base.hbm_bytes_per_s, bf16_flops=base.bf16_flops)
    return H100
