"""Build a C file of fast/ (``codec/native/``, ``kv/native/``, ``engine/native/``) with the system compiler on
first use, and load it.

``$CC`` (default ``cc``) with ``FLAGS``, into ``$UNFIRE_CACHE`` (default ``~/.cache/unfire``) under a name
that hashes the source (and the headers beside it), the compiler, the flags and the platform, written to a
temporary file and renamed (concurrent first uses are safe). No compiler, a failed build or
``UNFIRE_NATIVE=0``: ``load`` returns None (with a warning for a failed build) and the caller uses its
torch or NumPy fallback, which gives the same bytes.

``UNFIRE_CPU_ISA`` (``fast.cpu_isa``) caps the instruction sets the libraries may use: ``isa_level()`` is the cap as
the C code takes it, and ``load(..., isa="name")`` passes it to the library's exported ``int name(int)`` when the
library is loaded and again whenever the variable has changed since (a set this CPU lacks: ``CpuIsaError``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

from fast import cpu_isa

Signatures = dict[str, tuple[Any, list[Any]]]  # function name: (return type, argument types)
# -fomit-frame-pointer: the default at -O3 where compilers do not keep frame pointers by default (GCC and clang on
# Linux); said, so that one that does (Apple's clang) leaves rbp free for decode.c's rounds, whose assembly
# keeps 15 values in registers
FLAGS = ("-O3", "-std=c99", "-pthread", "-shared", "-fPIC", "-fomit-frame-pointer")


def build(source: Path, signatures: Signatures) -> ctypes.CDLL:
    """Compile ``source`` (or reuse the cached build) and declare the functions' signatures."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler (set CC)")
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    setting = f"{compiler}|{' '.join(FLAGS)}|{platform.machine()}|{platform.system()}"
    key = hashlib.sha256(text + setting.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("UNFIRE_CACHE", Path.home() / ".cache" / "unfire"))
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: a private directory in /tmp
        cache = Path(tempfile.gettempdir()) / f"unfire-{os.getuid()}"
        cache.mkdir(mode=0o700, exist_ok=True)
    target = cache / f"{source.stem}-{key}.so"
    if not target.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, "-o", tmp, str(source)],
                           check=True, capture_output=True, timeout=120)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


_levels: dict[str, int] = {}  # UNFIRE_CPU_ISA's value: isa_level() (what the CPU can execute does not change)


def isa_level() -> int:
    """``cpu_isa.selected()`` as the C kernels take it: its place in this architecture's chain (x86-64: 0 scalar,
    1 avx2, 2 avx512, 3 amx; aarch64: 0 scalar, 1 neon; each set includes the ones before it). Raises
    ``cpu_isa.CpuIsaError`` for an unknown set or one this CPU cannot execute."""
    want = os.environ.get(cpu_isa.ENV, "")
    level = _levels.get(want)
    if level is None:  # errors are not kept: every use raises
        level = _levels[want] = cpu_isa.chain().index(cpu_isa.selected())
    return level


_allowed: dict[tuple[str, str], bool] = {}  # (UNFIRE_CPU_ISA's value, a set): isa_allows


def isa_allows(name: str) -> bool:
    """``cpu_isa.allows(name)``, kept per value of ``UNFIRE_CPU_ISA`` (the kernels' Python sides ask on every call);
    raises ``CpuIsaError`` as ``isa_level``."""
    key = (os.environ.get(cpu_isa.ENV, ""), name)
    allowed = _allowed.get(key)
    if allowed is None:
        names = cpu_isa.chain()
        allowed = _allowed[key] = name in names and names.index(name) <= isa_level()
    return allowed


_UNBUILT = object()


def load(state: dict[str, Any], lock: threading.Lock, source: Path, signatures: Signatures,
         what: str, fallback: str, isa: str | None = None) -> ctypes.CDLL | None:
    """The library of ``source``, built once per process (kept in ``state``); None if it cannot be. ``isa``: the
    library's ``int isa(int level)``, called with ``isa_level()`` after the build and whenever ``UNFIRE_CPU_ISA``
    has changed since (raises ``CpuIsaError`` for a set this CPU lacks)."""
    if os.environ.get("UNFIRE_NATIVE", "1") == "0":
        return None
    lib = state.get("lib", _UNBUILT)  # built (or failed) already: no lock (every decode asks)
    if lib is _UNBUILT:
        with lock:
            if "lib" not in state:
                try:
                    state["lib"] = build(source, signatures)
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    warnings.warn(f"fast.codec: {what} could not be built ({e}); using {fallback}",
                                  RuntimeWarning, stacklevel=4)
                    state["lib"] = None
        lib = state["lib"]
    if lib is not None and isa is not None:
        want = os.environ.get(cpu_isa.ENV, "")
        if state.get("isa") != want:
            level = isa_level()  # outside the lock: cpu_isa's AMX check loads a library itself
            getattr(lib, isa)(level)
            state["isa"] = want
    return lib
