"""unfire's fast path: torch + Triton, with the same public API as reference/ where they overlap.

On a machine without CUDA the Triton kernels run in Triton's interpreter. The interpreter must be
switched on before a kernel is defined (``@triton.jit`` reads TRITON_INTERPRET when it decorates),
so importing ``fast`` sets ``TRITON_INTERPRET=1`` when the variable is unset and no CUDA device is
present. Set ``TRITON_INTERPRET`` yourself (0 or 1) to override; ``fast.triton_util.check_kernel_device``
explains the problem clearly when a CPU tensor reaches a kernel compiled for the GPU.
"""

from __future__ import annotations

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
