"""Poisoned buffers: catch kernels that read or write past the ends of their arrays.

``embed`` copies an input into the middle of a larger buffer whose other cells hold a poison value,
so a kernel that reads outside the array picks up poison and its result differs from the
reference. ``PoisonedOutput`` hands a kernel an output view into a NaN-filled buffer; afterwards
``guards()`` returns the cells around the view, which must still be NaN (bit for bit). Cases return
those cells as an extra output named ``GUARD`` and the reference side returns ``expected_guards``.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import numpy as np

GUARD = "guard cells around the output (must stay NaN 0x7fc1)"
NAN_BITS = 0x7FC1  # a bf16 NaN with a payload: what every unused output cell holds
GUARD_CELLS = 67  # cells of poison before and after each buffer (odd: not a multiple of any tile)
_POISON = {1: 0xA5, 2: 0x7FC1, 4: -0x5A5A5A5B, 8: (1 << 40) + 12345}  # by element size: never a valid value here


def embed(t: Any, guard: int = GUARD_CELLS) -> Any:
    """``t``'s values as a contiguous view inside a larger buffer filled with poison."""
    import torch

    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point and t.dtype != torch.bfloat16:
        return t
    n = t.numel()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    big = torch.full((guard + n + guard,), _POISON[raw.element_size()], dtype=raw.dtype, device=t.device)
    big[guard: guard + n] = raw.reshape(-1)
    view = big[guard: guard + n].view(t.shape)
    return view.view(torch.bfloat16) if t.dtype == torch.bfloat16 else view


def embed_form(form: Any) -> Any:
    """A HuffmanForm / PaletteForm whose every array sits inside a poisoned buffer."""
    import torch

    return replace(form, **{f.name: embed(getattr(form, f.name)) for f in fields(form)
                            if isinstance(getattr(form, f.name), torch.Tensor)})


class PoisonedOutput:
    """A NaN-filled int16 buffer with a contiguous view of ``shape`` in the middle, for a kernel's ``out=``."""

    def __init__(self, shape: tuple[int, ...], device: Any, guard: int = GUARD_CELLS):
        import torch

        self.n = int(np.prod(shape))
        self.guard = guard
        self.buffer = torch.full((guard + self.n + guard,), NAN_BITS, dtype=torch.int16, device=device)
        self.view = self.buffer[guard: guard + self.n].view(shape).view(torch.bfloat16)

    def guards(self) -> Any:
        """The poison cells on both sides, as bf16 (they must still be NaN 0x7fc1)."""
        import torch

        return torch.cat([self.buffer[: self.guard], self.buffer[self.guard + self.n:]]).view(torch.bfloat16)


def expected_guards(guard: int = GUARD_CELLS) -> np.ndarray:
    """What ``PoisonedOutput.guards()`` must return: untouched poison (uint16 bf16 bits)."""
    return np.full(2 * guard, NAN_BITS, np.uint16)
