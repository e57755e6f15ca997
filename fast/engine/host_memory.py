"""Keep freed host memory in the process, so that a CPU step's activations reuse pages instead of faulting new ones.

torch's CPU allocator calls ``malloc`` and ``free`` for every tensor. glibc serves a block above its mmap threshold
(128 KiB at start, raised as large blocks are freed, at most 32 MiB) with a fresh ``mmap``, and gives the top of
its heap back to the kernel once twice that threshold is free there. A step of the fast engine allocates products
of up to a few MiB per layer (a 2048-row prefill step's gate/up output is 12 MiB, the logits of 64 rows 12 MiB):
those went back to the kernel and were faulted in again, page by page and zeroed, on every use. On the bench_engine
workload (SmolLM2, 64 ShareGPT requests, one core of this project's EPYC) that was ~188,000 minor page faults and
~0.45 s of kernel time per run of ~24 s; with the thresholds raised once, ~10,000 and ~0.03 s. The cost: the heap
keeps its high-water mark (the largest step's temporaries, tens of MiB) instead of returning it.

``keep_freed_memory()`` raises both thresholds (glibc's ``mallopt``); elsewhere (no glibc, or
``UNFIRE_MALLOC_TUNE=0``) it does nothing and says so by returning False. Allocation policy only: no value changes.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this size come from the heap, and are reused
TRIM_THRESHOLD = 512 << 20  # free memory the heap keeps at its top before giving any back
_done: dict[str, bool] = {}


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True where they are raised."""
    if "ok" in _done:
        return _done["ok"]
    ok = False
    if os.environ.get("UNFIRE_MALLOC_TUNE", "1") != "0" and sys.platform.startswith("linux"):
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    _done["ok"] = ok
    return ok
