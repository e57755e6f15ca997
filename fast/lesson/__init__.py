"""The lesson kernels of fast/KERNELS.md: small, real, and held to the same rules as every other kernel.

``row_scales``: the per-row fp8 scale of a bf16 matrix (its largest |x| and the power-of-two scale exponent
of the fp8 KV rule), in Triton and torch (``fast.lesson.row_scale``) and in C (``fast.lesson.row_scale_c``), all
bit-exact against ``reference.lesson.row_scale``.

    from fast.lesson import row_scales
    amax, exponent = row_scales(x)     # x: bf16 [rows, cols]; bf16 [rows], int8 [rows]
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def row_scales(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, exponent) of each row of a bf16 [rows, cols] tensor, by the kernel that runs where ``x`` lives: a
    CUDA tensor, or any tensor under ``TRITON_INTERPRET=1``: the Triton kernel; a CPU tensor: the C kernel where it
    is built, else the torch lines (``UNFIRE_NATIVE=0``, no compiler). All three give the same bits."""
    from fast.lesson import row_scale, row_scale_c

    if x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return row_scale.row_scales_triton(x, out)
    if row_scale_c.library() is not None:
        return row_scale_c.row_scales_c(x, out)
    return row_scale.row_scales_torch(x, out)
