"""Run conformance cases and collect one result per case."""

from __future__ import annotations

import fnmatch
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from conformance.compare import compare_bounded, compare_exact, flatten_outputs
from conformance.poison import GUARD
from conformance.registry import Case, Gen, Level


@dataclass
class CaseResult:
    name: str
    level: str
    status: str  # "pass", "FAIL", "error" or "skip"
    elements: int = 0
    seconds: float = 0.0
    detail: str = ""  # why it failed / errored / was skipped
    bound: str = ""  # BOUNDED: the bound, as stated by the case
    bound_used: float | None = None  # BOUNDED: worst |fast - ref| / allowed over all elements

    @property
    def failed(self) -> bool:
        return self.status in ("FAIL", "error")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def select(cases: dict[str, Case], patterns: list[str] | None, large: bool = True) -> list[Case]:
    """Cases whose name matches any pattern: a glob if it has * ? [, else a substring (case-insensitive).

    Without ``large``, cases marked large_only are left out.
    """
    pool = [c for c in cases.values() if large or not c.large_only]
    if not patterns:
        return pool
    chosen = []
    for case in pool:
        name = case.name.lower()
        for p in patterns:
            p = p.lower()
            if (fnmatch.fnmatchcase(name, p) if any(c in p for c in "*?[") else p in name):
                chosen.append(case)
                break
    return chosen


def run_case(case: Case, device: Any, large: bool, seed: int = 0) -> CaseResult:
    """Generate the inputs, run reference and fast, compare at the case's level."""
    result = CaseResult(case.name, case.level.value, "pass", bound=case.bound.text if case.bound else "")
    start = time.perf_counter()
    try:
        reason = case.requires() if case.requires else None
        if reason:
            result.status, result.detail = "skip", reason
            return result
        inputs = case.inputs(Gen(device=device, large=large, rng=case.seed_for(seed), seed=seed))
        ref = flatten_outputs(case.reference(inputs))
        fast = flatten_outputs(case.fast(inputs))
        if set(ref) != set(fast):
            result.status = "FAIL"
            result.detail = f"outputs differ in kind: fast gives {sorted(fast)}, reference {sorted(ref)}"
            return result
        for label, r in ref.items():
            if case.level is Level.BOUNDED and label != GUARD:  # guard cells are always compared bit for bit
                outcome = compare_bounded(fast[label], r, case.bound.allowed(inputs, r))
                if outcome.bound_used is not None:
                    result.bound_used = max(result.bound_used or 0.0, outcome.bound_used)
            else:
                outcome = compare_exact(fast[label], r)
            result.elements += outcome.elements
            if not outcome.ok:
                result.status = "FAIL"
                result.detail = f"output {label}: {outcome.detail}" if label else outcome.detail
                return result
    except Exception as exc:  # a crash in a kernel is a failure of the case, reported with its cause
        result.status = "error"
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
        result.detail = f"{type(exc).__name__}: {exc}{where}"
    finally:
        result.seconds = time.perf_counter() - start
    return result


def run_cases(cases: list[Case], device: Any, large: bool, seed: int = 0, on_result: Any = None,
              on_start: Any = None) -> list[CaseResult]:
    """Run cases in order; ``on_start(case)`` is called before each and ``on_result(result)`` after it."""
    results = []
    for case in cases:
        if on_start is not None:
            on_start(case)
        r = run_case(case, device, large, seed)
        results.append(r)
        if on_result is not None:
            on_result(r)
    return results
