"""The compile gate: every kernel specialization the fast path launches, compiled for a GPU without one.

The interpreter runs code the compiler rejects (a helper without ``@triton.jit``, a jit function
called from host code), so passing conformance cases under TRITON_INTERPRET=1 proves nothing about
a GPU. This compiles each ``Launch`` (conformance/launches.py) with the real Triton compiler for
the target (``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``) and runs the
wheel's ``ptxas -v`` on the PTX for registers and spills. Per specialization it reports: compiled
or the error (with the kernel's file:line), registers per thread, spill bytes, shared memory,
whether it uses wgmma (Hopper's tensor-core instructions). The gate fails on an error, on spills in
a configuration a launcher picks by default, and on shared memory over the target's limit.

Results are cached by (source hash of the kernel and its helpers, specialization, options, target,
triton version), so an unchanged kernel is not compiled twice. Needs TRITON_INTERPRET unset or 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conformance.launches import Launch

TARGETS = {"sm_90": (90, 232448), "sm_80": (80, 166912)}  # capability, shared memory a block may use (bytes)


@dataclass
class GateResult:
    kernel: str
    origin: str
    default: bool
    num_warps: int
    num_stages: int
    constants: str  # the constexprs, for humans
    status: str  # "ok", "error", "spills" (in a default configuration), "smem" (over the limit)
    detail: str = ""
    registers: int | None = None
    spill_bytes: int | None = None  # spill stores + spill loads, bytes per thread
    smem: int | None = None  # dynamic shared memory, bytes per block
    wgmma: bool | None = None
    seconds: float = 0.0
    cached: bool = False
    count: int = 1  # launches with this specialization
    origins: list | None = None  # what made each of them

    @property
    def failed(self) -> bool:
        return self.status != "ok"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _materialize(desc: tuple) -> Any:
    """A value with the properties Triton specializes on (a tensor's dtype and 16-byte alignment)."""
    import torch

    kind = desc[0]
    if kind == "tensor":
        dtype = getattr(torch, desc[1])
        buf = torch.empty(64, dtype=dtype)
        return buf if desc[2] else buf[1:]
    if kind == "none":
        return None
    return desc[1]


def jit_function(name: str) -> Any:
    """The @triton.jit object of ``module:function``."""
    import importlib

    module, _, attr = name.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    if not hasattr(fn, "params"):
        raise TypeError(f"{name} is not a compiled @triton.jit function (is TRITON_INTERPRET=1 set?)")
    return fn


def specialize(fn: Any, launch: Launch, backend: Any) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as Triton's launcher would build them for these arguments."""
    from triton._C.libtriton import native_specialize_impl

    if len(fn.params) != len(launch.args):
        raise TypeError(f"{launch.kernel} takes {len(fn.params)} arguments, the launch gives {len(launch.args)}")
    signature, constexprs, attrs = {}, {}, {}
    for i, (p, desc) in enumerate(zip(fn.params, launch.args, strict=True)):
        if p.is_constexpr or desc[0] == "const":
            signature[p.name], constexprs[p.name] = "constexpr", desc[1] if len(desc) > 1 else None
            continue
        ty, attr = native_specialize_impl(backend, _materialize(desc), p.is_const, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        if ty == "constexpr":
            signature[p.name], constexprs[p.name] = "constexpr", attr
        else:
            signature[p.name] = ty
            if isinstance(attr, str) and attr:
                attrs[(i,)] = backend.parse_attr(attr)
    return signature, constexprs, attrs


def _kernel_line(exc: BaseException) -> str | None:
    """file:line in the kernel source being compiled when ``exc`` was raised, from the innermost frame
    that visits an AST node of a jit function: triton's code generator (it knows the function's file and
    first line) or its dependency finder (under the jit function whose source it walks)."""
    seen: set[int] = set()
    found = None
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:  # the exception, then what it was raised from
        seen.add(id(e))
        tb, jit_fn = e.__traceback__, None
        while tb is not None:
            local = tb.tb_frame.f_locals
            obj, node = local.get("self"), local.get("node")
            if hasattr(obj, "raw_src") and hasattr(obj, "starting_line_number"):
                jit_fn = obj  # a JITFunction: the dependency finder below walks its source (from its def line)
            line = getattr(node, "lineno", None)
            if line and hasattr(obj, "begin_line") and hasattr(obj, "file_name"):
                found = f"{obj.file_name}:{obj.begin_line + line}"
            elif line and jit_fn is not None:
                first = getattr(jit_fn, "def_file_line_number", None) or jit_fn.starting_line_number + 1
                found = f"{jit_fn.fn.__code__.co_filename}:{first + line - 1}"
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return found


def _error_text(exc: BaseException, fn: Any) -> str:
    """One line: the error's kind, where in the kernel source it is, and its cause (the message's last line)."""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    cause = lines[-1] if lines else type(exc).__name__
    where = _kernel_line(exc)
    if where is None:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/triton/" not in f.filename
                  and "/conformance/" not in f.filename]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else _first_line(fn)
    return f"{type(exc).__name__} at {where}: {cause}"[:600]


def _first_line(fn: Any) -> str:
    code = getattr(getattr(fn, "fn", fn), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else "?"


def _ptxas_report(ptx: str, capability: int) -> tuple[int, int, bool]:
    """(registers, spill bytes) from the wheel's ``ptxas -v`` (the one triton itself uses for the target),
    and whether the PTX uses wgmma."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas, arch = get_ptxas(capability).path, sm_arch_from_capability(capability)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(d) / "k.o")],
                              capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed: {log.strip()[-400:]}")
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"could not read registers/spills from ptxas -v: {log.strip()[-400:]}")
    return int(regs.group(1)), int(spills.group(1)) + int(spills.group(2)), "wgmma" in ptx


def _cache_path() -> Path:
    import triton

    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "unfire" / f"compile_gate-triton{triton.__version__}.json"


def _key(fn: Any, signature: dict, constexprs: dict, attrs: dict, launch: Launch, target: str) -> str:
    import triton

    text = json.dumps([fn.cache_key, sorted(signature.items()), sorted((k, repr(v)) for k, v in constexprs.items()),
                       sorted((repr(k), repr(v)) for k, v in attrs.items()), launch.num_warps, launch.num_stages,
                       target, triton.__version__])
    return hashlib.sha256(text.encode()).hexdigest()


def compile_one(launch: Launch, target: str, cache: dict | None = None) -> GateResult:
    """Compile one launch for ``target`` (a key of TARGETS) and judge it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    capability, smem_limit = TARGETS[target]
    result = GateResult(launch.kernel, launch.origin, launch.default, launch.num_warps, launch.num_stages,
                        ", ".join(f"{d[1]}" for d in launch.args if d[0] == "const"), "ok",
                        count=max(1, len(launch.origins)), origins=list(launch.origins))
    start = time.perf_counter()
    fn = None
    try:
        fn = jit_function(launch.kernel)
        gpu = GPUTarget("cuda", capability, 32)
        backend = make_backend(gpu)
        signature, constexprs, attrs = specialize(fn, launch, backend)
        result.constants = ", ".join(f"{k}={v}" for k, v in constexprs.items())
        key = _key(fn, signature, constexprs, attrs, launch, target)
        if cache is not None and key in cache:
            result.registers, result.spill_bytes, result.smem, result.wgmma = cache[key]
            result.cached = True
        else:
            src = ASTSource(fn, signature, constexprs, attrs)
            kernel = triton.compile(src, target=gpu, options={"num_warps": launch.num_warps,
                                                              "num_stages": launch.num_stages})
            result.smem = int(kernel.metadata.shared)
            result.registers, result.spill_bytes, result.wgmma = _ptxas_report(kernel.asm["ptx"], capability)
            if cache is not None:
                cache[key] = [result.registers, result.spill_bytes, result.smem, result.wgmma]
    except Exception as exc:  # a compile error is the gate's finding, reported with where it is
        result.status, result.detail = "error", _error_text(exc, fn)
    finally:
        result.seconds = time.perf_counter() - start
    if result.status == "ok":
        if result.smem is not None and result.smem > smem_limit:
            result.status = "smem"
            result.detail = f"{result.smem} bytes of shared memory, over {target}'s {smem_limit} per block"
        elif launch.default and result.spill_bytes:
            result.status = "spills"
            result.detail = (f"{result.spill_bytes} bytes of register spills per thread ({result.registers} "
                             f"registers) in a default configuration")
    return result


def dedupe(launches: list[Launch]) -> list[Launch]:
    """One launch per distinct (kernel, arguments as specialized, options); ``default`` if any was."""
    groups: dict[tuple, Launch] = {}
    for x in launches:
        key = (x.kernel, tuple(_spec_class(d) for d in x.args), x.num_warps, x.num_stages)
        old = groups.get(key)
        if old is None:
            groups[key] = x
        else:
            first = x if (x.default and not old.default) else old
            other = old if first is x else x
            origins = tuple(dict.fromkeys((*first.origins, *other.origins)))
            groups[key] = Launch(first.kernel, first.args, first.num_warps, first.num_stages, first.origin,
                                 first.default or other.default, origins)
    return list(groups.values())


def _spec_class(desc: tuple) -> tuple:
    """What of an argument a specialization depends on: an int only by 1, % 16 and its width."""
    if desc[0] == "int":
        v = desc[1]
        width = "i32" if -2**31 <= v < 2**31 else ("i64" if -2**63 <= v < 2**63 else "u64")
        return ("int", v if v == 1 else (width, v % 16 == 0))
    if desc[0] == "float":
        return ("float",)
    return tuple(desc)


def _job(item: tuple[Launch, str, dict | None]) -> tuple[GateResult, dict]:
    """compile_one in a worker process: the result and the cache entries it added."""
    launch, target, cache = item
    mine = dict(cache) if cache is not None else None
    result = compile_one(launch, target, mine)
    added = {k: v for k, v in (mine or {}).items() if cache is None or k not in cache}
    return result, added


def run_gate(launches: list[Launch], target: str, use_cache: bool = True,
             on_result: Callable[[GateResult], None] | None = None, jobs: int = 1) -> list[GateResult]:
    """Compile every distinct launch (in ``jobs`` processes); the cache file is read before and written after."""
    if target not in TARGETS:
        raise ValueError(f"unknown compile target {target!r}: one of {sorted(TARGETS)}")
    path = _cache_path()
    cache: dict = {}
    if use_cache and path.is_file():
        try:
            cache = json.loads(path.read_text())
        except ValueError:
            cache = {}
    todo = dedupe(launches)
    results = []
    if jobs > 1 and len(todo) > 1:
        import concurrent.futures
        import multiprocessing

        pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
        with pool:
            items = [(x, target, cache if use_cache else None) for x in todo]
            for r, added in pool.map(_job, items):
                cache.update(added)
                results.append(r)
                if on_result is not None:
                    on_result(r)
    else:
        for launch in todo:
            r = compile_one(launch, target, cache if use_cache else None)
            results.append(r)
            if on_result is not None:
                on_result(r)
    if use_cache:
        from reference.safe_write import write_text

        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(cache) + "\n")
    return results


def occupancy(registers: int, smem: int, num_warps: int, regs_per_sm: int = 65536, smem_per_sm: int = 233472,
              max_warps: int = 64) -> float:
    """Resident warps over the SM's maximum (H100: 64K registers, 228 KiB shared memory, 64 warps)."""
    regs = max(registers, 1)
    regs_per_warp = -(-regs * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = regs_per_sm // regs_per_warp // num_warps
    by_smem = smem_per_sm // (smem + 1024) if smem else 32  # 1 KiB reserved per block
    blocks = min(by_regs, by_smem, 32, max_warps // num_warps)
    return blocks * num_warps / max_warps


def print_report(results: list[GateResult], target: str, seconds: float) -> None:
    """One row per specialization, then each failure in full."""
    print(f"compile gate for {target}: {len(results)} specializations")
    print(f"{'result':6} {'regs':>4} {'spill':>5} {'smem':>6} {'wgmma':5} {'warps':>5} {'time':>6}  kernel  (origin)")
    for r in results:
        regs = "-" if r.registers is None else str(r.registers)
        spill = "-" if r.spill_bytes is None else str(r.spill_bytes)
        smem = "-" if r.smem is None else str(r.smem)
        wg = "-" if r.wgmma is None else ("yes" if r.wgmma else "no")
        mark = "*" if r.default else " "
        print(f"{r.status:6} {regs:>4} {spill:>5} {smem:>6} {wg:5} {r.num_warps:>5} {r.seconds:5.1f}s "
              f"{mark}{r.kernel.split(':')[1]}  ({r.origin}{f' +{r.count - 1}' if r.count > 1 else ''})")
    failures = [r for r in results if r.failed]
    for r in failures:
        print(f"\n{r.status}: {r.kernel} [{r.constants}] num_warps={r.num_warps} num_stages={r.num_stages}"
              f"\n  from {r.origin}\n  {r.detail}")
    print(f"\n(* = a launcher's default configuration, must not spill)\n{len(results) - len(failures)} compiled "
          f"cleanly, {len(failures)} failed, in {seconds:.1f}s")
