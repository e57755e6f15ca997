"""unfire's fast path: torch + Triton, with the same public API as reference/ where they overlap.

On a machine without CUDA the Triton kernels run in Triton's interpreter. The interpreter must be
switched on before any kernel is defined, so importing ``fast`` sets ``TRITON_INTERPRET=1`` when the
variable is unset, no CUDA device is present and triton has not been imported yet. Set
``TRITON_INTERPRET`` yourself (0 or 1) to override; ``fast.triton_util.check_kernel_device`` explains
the problem clearly when a CPU tensor reaches a kernel compiled for the GPU.
"""

from __future__ import annotations

import os
import sys

if "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
