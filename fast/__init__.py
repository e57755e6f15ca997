"""unfire's fast path: torch + Triton, with the same public API as reference/ where they overlap.

On a machine without CUDA the Triton kernels run in Triton's interpreter. The interpreter must be
switched on before a kernel is defined (``@triton.jit`` reads TRITON_INTERPRET when it decorates),
so importing ``fast`` sets ``TRITON_INTERPRET=1`` when the variable is unset and no CUDA device is
present. Set ``TRITON_INTERPRET`` yourself (0 or 1) to override; ``fast.triton_util.check_kernel_device``
explains the problem clearly when a CPU tensor reaches a kernel compiled for the GPU. On Linux with no GPU
driver present (no /dev/nvidiactl, /dev/nvidia0, /proc/driver/nvidia, /dev/kfd nor /dev/dxg) CUDA cannot be
available, and the check is made without importing torch (~1 s: ``python -m fast.codec decompress`` needs none).
"""

from __future__ import annotations

import os
import sys

_GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def _no_gpu_driver() -> bool:
    """True where no GPU can be seen for certain without importing torch (Linux, no driver's device)."""
    return sys.platform.startswith("linux") and not any(os.path.exists(p) for p in _GPU_DRIVER_PATHS)


if "TRITON_INTERPRET" not in os.environ:
    if _no_gpu_driver():
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
