"""Running a native case under each CPU instruction set (``UNFIRE_CPU_ISA``, ``fast/cpu_isa.py``).

A case of a C kernel is registered once per instruction set of this machine's architecture (x86-64: scalar,
avx2, avx512, amx; aarch64: scalar, neon), its fast side run with the cap set, so the gate checks every path the
CPU can execute, and a set it cannot is reported as skipped with that reason (never because another is missing).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def isas() -> tuple[str, ...]:
    """The instruction sets of this architecture, weakest first."""
    from fast import cpu_isa

    return cpu_isa.chain()


@contextmanager
def capped(name: str) -> Iterator[None]:
    """``UNFIRE_CPU_ISA=name`` while the block runs (the previous value restored)."""
    from fast import cpu_isa

    old = os.environ.get(cpu_isa.ENV)
    os.environ[cpu_isa.ENV] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ[cpu_isa.ENV]
        else:
            os.environ[cpu_isa.ENV] = old


def under(name: str, fast: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    """``fast`` run with the cap ``name``."""
    def run(inputs: dict[str, Any]) -> Any:
        with capped(name):
            return fast(inputs)

    return run


def requires(name: str, also: Callable[[], str | None] | None = None) -> Callable[[], str | None]:
    """Skip where this CPU cannot execute ``name`` (saying so), else ask ``also``."""
    def check() -> str | None:
        from fast import cpu_isa

        if name not in cpu_isa.supported():
            return f"this CPU ({cpu_isa.describe_cpu()}) cannot execute {name}"
        return also() if also is not None else None

    return check
