"""Which CPU instruction sets the native kernels may use: what this CPU has, capped by ``UNFIRE_CPU_ISA``.

    UNFIRE_CPU_ISA=amx|avx512|avx2|neon|scalar      (unset: the best this CPU has)

The sets form one chain per architecture, each including the ones before it:

    x86-64:   scalar < avx2 < avx512 < amx
    aarch64:  scalar < neon

* ``avx2``: AVX2 + FMA (Haswell and later, Zen 1 and later).
* ``avx512``: AVX-512 F/BW/VL/DQ + BF16 + VBMI (Cooper Lake, Sapphire Rapids and later; AMD Zen 4/5). A CPU
  with AVX-512 but without BF16 or VBMI (Skylake-X, Ice Lake) is an ``avx2`` machine here.
* ``amx``: AMX-BF16 tiles, which Linux must also let this process use (Sapphire Rapids and later).
* ``neon``: Advanced SIMD, present on every aarch64 CPU.

Every native kernel (the tile products, the decode attention, the fused ops, the Huffman and rANS decoders)
asks ``allows(isa)`` before it takes a path, so ``UNFIRE_CPU_ISA=avx2`` on a Sapphire Rapids runs what an
AVX2-only laptop runs. An ISA this CPU cannot execute, or an unknown name, is refused with ``CpuIsaError``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
import sys
from pathlib import Path

ENV = "UNFIRE_CPU_ISA"
X86_CHAIN = ("scalar", "avx2", "avx512", "amx")
ARM_CHAIN = ("scalar", "neon")
ALL = ("amx", "avx512", "avx2", "neon", "scalar")

# /proc/cpuinfo flag names each set needs (x86) -- AMX is checked again for the OS permission below
_NEEDS = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512vbmi"),
    "amx": ("amx_bf16", "amx_tile"),
}


# oneDNN's own cap (its ONEDNN_MAX_CPU_ISA) for the machine an ISA stands for: the benchmarks set it beside
# UNFIRE_CPU_ISA, so that torch's products in the baseline are those of that machine too
ONEDNN_CAP = {"avx512": "AVX512_CORE_BF16", "avx2": "AVX2", "scalar": "SSE41"}


def emulation_env(name: str) -> dict[str, str]:
    """The environment that makes a process on this CPU serve as a CPU whose best set is ``name`` would:
    ``UNFIRE_CPU_ISA`` for our kernels and ``ONEDNN_MAX_CPU_ISA`` for torch's oneDNN (AMX: no cap)."""
    env = {ENV: check(name)}
    if name in ONEDNN_CAP:
        env["ONEDNN_MAX_CPU_ISA"] = ONEDNN_CAP[name]
    return env


class CpuIsaError(ValueError):
    """``UNFIRE_CPU_ISA`` names an instruction set that is unknown or that this CPU cannot execute."""


def arch() -> str:
    """``x86_64``, ``aarch64`` or another machine name (``platform.machine()``, normalised)."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def chain() -> tuple[str, ...]:
    """The instruction sets of this architecture, weakest first."""
    return {"x86_64": X86_CHAIN, "aarch64": ARM_CHAIN}.get(arch(), ("scalar",))


def _cpu_flags() -> set[str] | None:
    """The x86 feature flags the kernel reports (Linux), or None where there is no /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    m = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(m.group(1).split()) if m else set()


def _amx_permitted() -> bool:
    """Linux lets this process use the AMX tile data: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA), the request
    tile_matmul.c's tm_amx_ready makes too (asked here through libc, so that no torch import is needed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl on x86-64
    except (OSError, AttributeError):
        return False


@functools.cache
def supported() -> tuple[str, ...]:
    """Every instruction set this CPU can execute, weakest first (``scalar`` always)."""
    names = chain()
    if names is ARM_CHAIN:
        return ARM_CHAIN  # Advanced SIMD is part of every aarch64 CPU
    if names is not X86_CHAIN:
        return ("scalar",)
    flags = _cpu_flags()
    if flags is None:  # no /proc/cpuinfo (macOS, BSD): torch's own dispatch check says AVX2 or AVX-512
        try:
            import torch

            cap = torch.backends.cpu.get_cpu_capability()
        except (ImportError, AttributeError):
            cap = ""
        return ("scalar", "avx2") if cap in ("AVX2", "AVX512") else ("scalar",)
    have = ["scalar"]
    for name in X86_CHAIN[1:]:
        if not all(f in flags for f in _NEEDS[name]):
            break
        if name == "amx" and not _amx_permitted():
            break
        have.append(name)
    return tuple(have)


def best() -> str:
    """The strongest instruction set this CPU can execute."""
    return supported()[-1]


def selected() -> str:
    """``UNFIRE_CPU_ISA`` if set (checked), else ``best()``: the cap every native kernel obeys."""
    want = os.environ.get(ENV, "").strip().lower()
    if not want:
        return best()
    return check(want)


def check(name: str) -> str:
    """``name`` if this CPU can execute it; ``CpuIsaError`` naming the problem otherwise."""
    if name not in ALL:
        raise CpuIsaError(f"{ENV}={name!r}: unknown instruction set (one of {', '.join(ALL)})")
    if name not in supported():
        raise CpuIsaError(f"{ENV}={name!r}: this CPU ({describe_cpu()}, {arch()}) cannot execute it; "
                          f"it can: {', '.join(supported())}")
    return name


def allows(name: str) -> bool:
    """True when kernels may use ``name``: this CPU has it and the selected cap is at or above it."""
    names = chain()
    cap = selected()
    return name in names and name in supported() and names.index(name) <= names.index(cap)


def describe_cpu() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``), for results and logs."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^(model name|Model|CPU part)\s*:\s*(.+)$", text, re.M)
        if m:
            return m.group(2).strip()
    except OSError:
        pass
    return platform.processor() or arch()


def summary() -> str:
    """One line for logs and results: the CPU, what it can execute and the cap in force."""
    return f"{describe_cpu()} ({arch()}); can execute {', '.join(supported())}; using {selected()}"
