"""The conformance suite: fast/ against reference/, case by case. Run ``python -m conformance``.

Importing this package loads neither torch nor triton, so that the CLI can switch on Triton's
interpreter (TRITON_INTERPRET=1) before any kernel is defined.
"""

from conformance.registry import CASES, Bound, Case, Gen, Level, load_cases, register

__all__ = ["CASES", "Bound", "Case", "Gen", "Level", "load_cases", "register"]
