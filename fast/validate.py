"""Input checks for kernel wrappers: one call per argument, a clear KernelInputError on a mismatch.

Triton kernels read raw pointers: a tensor of the wrong dtype is silently reinterpreted, a
non-contiguous one is read with the wrong strides, and a short one is read past its end. Every
wrapper in fast/ therefore checks its arguments with ``check_tensor`` before launching anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fast.errors import KernelInputError
from fast.triton_util import check_kernel_device


def check_tensor(
    t: object,
    name: str,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    contiguous: bool = True,
    kernel_device: bool = True,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check one tensor argument and return it.

    ``shape`` may hold ``None`` for "any size here". ``kernel_device`` checks that a Triton kernel can
    read the tensor where it lives (CUDA natively, CPU under the interpreter); ``device`` that it sits
    on the same device as the other arguments.
    """
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise KernelInputError(f"{name}: expected dtype {want}, got {t.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise KernelInputError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, t.shape, strict=True)):
            if want is not None and want != got:
                raise KernelInputError(
                    f"{name}: expected size {want} in dimension {axis}, got shape {tuple(t.shape)}"
                )
    if contiguous and not t.is_contiguous():
        raise KernelInputError(
            f"{name}: expected a contiguous tensor (shape {tuple(t.shape)}, strides {t.stride()}); "
            "call .contiguous() first"
        )
    if device is not None and t.device != torch.device(device):
        raise KernelInputError(f"{name} is on {t.device}, the other arguments on {device}")
    if kernel_device:
        check_kernel_device(t, name)
    return t


def check_numel(t: torch.Tensor, name: str, expected: int) -> None:
    """Raise unless ``t`` holds exactly ``expected`` elements (a length read from a header, say)."""
    if t.numel() != expected:
        raise KernelInputError(f"{name}: expected {expected} elements, got {t.numel()}")

