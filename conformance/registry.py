"""The registry of conformance cases: what a case is, and how it is registered.

A case runs one fast (torch/Triton) function and its reference on the same seeded inputs and
compares the outputs at one of three levels (DESIGN.md, "Conformance levels"):

* ``BIT_EXACT``: the fast output equals the reference bit for bit (integer and bit work: codecs).
* ``SAME_KERNEL``: a fused kernel equals, bit for bit, the same kernel run on pre-decoded inputs.
  It checks only what differs between the two runs (the fused decode); what both share (tile loads,
  accumulation, epilogue) is invisible to it, so every such case needs a BOUNDED partner that
  compares against an independent implementation (see conformance/cases/matmul_cases.py).
* ``BOUNDED``: a floating-point result stays within a stated bound of a float64 reference; the
  bound is written next to the case (``Bound.text``) and checked element by element. A bound can
  be a rounding interval (allowed 0 where only one result is correct), not just a tolerance.

This module imports neither torch nor triton: the CLI must be able to set TRITON_INTERPRET first.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


class Level(enum.Enum):
    BIT_EXACT = "bit-exact"
    SAME_KERNEL = "same-kernel exact"
    BOUNDED = "bounded"


@dataclass(frozen=True)
class Bound:
    """A per-element error bound for a BOUNDED case.

    ``text`` states the bound for humans (it is printed in the table); ``allowed(inputs, ref)``
    returns, for every output element, the largest |fast - ref| the bound permits.
    """

    text: str
    allowed: Callable[[dict[str, Any], np.ndarray], np.ndarray]


@dataclass
class Gen:
    """What an input generator gets: the device to build inputs on, the scale, a seeded RNG."""

    device: Any  # a torch.device (kept untyped so this module needs no torch)
    large: bool  # large shapes (GPU runs) or small ones (CPU under the interpreter)
    rng: np.random.Generator
    seed: int = 0  # the run's base seed (for inputs shared by several cases, seeded by their own name)

    def size(self, small: Any, large: Any) -> Any:
        """Pick the small or the large variant of a size."""
        return large if self.large else small


@dataclass(frozen=True)
class Case:
    """One conformance check. ``reference`` and ``fast`` both take the dict ``inputs(gen)`` returns.

    Outputs may be one array/tensor, a tuple of them, or a dict of named ones; they are compared
    pairwise. ``requires`` returns a reason to skip (a missing package, say) or None.
    """

    name: str
    level: Level
    inputs: Callable[[Gen], dict[str, Any]]
    reference: Callable[[dict[str, Any]], Any]
    fast: Callable[[dict[str, Any]], Any]
    bound: Bound | None = None
    about: str = ""
    requires: Callable[[], str | None] | None = None
    large_only: bool = False  # too slow for the interpreter: runs only with large shapes (on a GPU)

    def __post_init__(self) -> None:
        if (self.level is Level.BOUNDED) != (self.bound is not None):
            raise ValueError(f"case {self.name!r}: a bound is required for, and only for, BOUNDED cases")

    def seed_for(self, seed: int) -> np.random.Generator:
        """The case's own RNG: the same inputs for the same (seed, name), whatever else runs."""
        return np.random.default_rng([seed, zlib.crc32(self.name.encode())])


CASES: dict[str, Case] = {}


def register(case: Case) -> Case:
    """Add a case to the registry (names are unique)."""
    if case.name in CASES:
        raise ValueError(f"two conformance cases are named {case.name!r}")
    CASES[case.name] = case
    return case


def load_cases() -> dict[str, Case]:
    """Import every case module (conformance/cases/*.py) and return the registry."""
    import importlib
    import pkgutil

    import conformance.cases as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"conformance.cases.{mod.name}")
    return CASES
