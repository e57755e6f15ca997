"""Poisoned buffers: catch kernels that read or write past the ends of their arrays.

``embed`` copies an input into the middle of a larger buffer whose other cells hold a poison value
(a NaN with a payload for float inputs of any width, an unlikely pattern for integers), so a kernel
that reads outside the array picks up poison and its result differs from the reference.
``PoisonedOutput`` hands a kernel an output view into a poison-filled buffer (NaN 0x7fc1 for bf16,
0xa5 for uint8); afterwards ``guards()`` returns the cells around the view, which must still hold
the poison (bit for bit). Cases return those cells as an extra output named ``GUARD`` and the
reference side returns ``expected_guards`` of the same kind.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import numpy as np

GUARD = "guard cells around the output (must stay NaN 0x7fc1)"
GUARD_UINT8 = "guard cells around the output (must stay 0xa5)"  # the same, for a uint8 output
NAN_BITS = 0x7FC1  # a bf16 NaN with a payload: what every unused output cell holds
GUARD_CELLS = 67  # cells of poison before and after each buffer (odd: not a multiple of any tile)
_POISON = {1: 0xA5, 2: 0x7FC1, 4: -0x5A5A5A5B, 8: (1 << 40) + 12345}  # by element size: never a valid value here
# float inputs: a NaN with a payload of the same width (as a signed integer of that width), so a stray
# read turns a sum into NaN and a copied value into a pattern no correct kernel writes
_FLOAT_POISON = {2: 0x7E5A, 4: 0x7FA5A5A5, 8: 0x7FF5A5A5A5A5A5A5}
UINT8_POISON = 0xA5  # what every unused uint8 output cell holds


def embed(t: Any, guard: int = GUARD_CELLS) -> Any:
    """``t``'s values as a contiguous view inside a larger buffer filled with poison."""
    import torch

    if not isinstance(t, torch.Tensor):
        return t
    n = t.numel()
    floating = t.dtype.is_floating_point
    size = t.element_size()
    raw = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[size]) if floating else t
    poison = (0x7FC1 if t.dtype == torch.bfloat16 else _FLOAT_POISON[size]) if floating else _POISON[size]
    big = torch.full((guard + n + guard,), poison, dtype=raw.dtype, device=t.device)
    big[guard: guard + n] = raw.reshape(-1)
    view = big[guard: guard + n].view(t.shape)
    return view.view(t.dtype) if floating else view


def embed_form(form: Any) -> Any:
    """A HuffmanForm / PaletteForm whose every array sits inside a poisoned buffer."""
    import torch

    return replace(form, **{f.name: embed(getattr(form, f.name)) for f in fields(form)
                            if isinstance(getattr(form, f.name), torch.Tensor)})


class PoisonedOutput:
    """A poison-filled buffer with a contiguous view of ``shape`` in the middle, for a kernel's ``out=``.

    ``kind`` "bf16": NaN 0x7fc1 cells, the view is torch.bfloat16; "uint8": 0xa5 cells, uint8 view."""

    def __init__(self, shape: tuple[int, ...], device: Any, guard: int = GUARD_CELLS, kind: str = "bf16"):
        import torch

        self.n = int(np.prod(shape))
        self.guard = guard
        self.kind = kind
        if kind == "bf16":
            self.buffer = torch.full((guard + self.n + guard,), NAN_BITS, dtype=torch.int16, device=device)
            self.view = self.buffer[guard: guard + self.n].view(shape).view(torch.bfloat16)
        elif kind == "uint8":
            self.buffer = torch.full((guard + self.n + guard,), UINT8_POISON, dtype=torch.uint8, device=device)
            self.view = self.buffer[guard: guard + self.n].view(shape)
        else:
            raise ValueError(f"PoisonedOutput kind must be 'bf16' or 'uint8', got {kind!r}")

    def guards(self) -> Any:
        """The poison cells on both sides (bf16 or uint8): they must be unchanged."""
        import torch

        cells = torch.cat([self.buffer[: self.guard], self.buffer[self.guard + self.n:]])
        return cells.view(torch.bfloat16) if self.kind == "bf16" else cells


def expected_guards(guard: int = GUARD_CELLS, kind: str = "bf16") -> np.ndarray:
    """What ``PoisonedOutput.guards()`` must return: untouched poison (uint16 bf16 bits, or uint8)."""
    if kind == "uint8":
        return np.full(2 * guard, UINT8_POISON, np.uint8)
    return np.full(2 * guard, NAN_BITS, np.uint16)
