"""Kernel launches as data: what the compile gate compiles.

A ``Launch`` names a ``@triton.jit`` kernel and describes each of its arguments the way Triton's
specialization sees them (a tensor: its dtype and whether its address is 16-byte aligned; an int or
float: its value; a constexpr: its value), plus ``num_warps`` and ``num_stages``. That is all the
compiler needs: no tensor data, no GPU.

``record_launches`` collects the launches the fast path makes while it runs under the interpreter
(the conformance suite, say), by wrapping triton's ``InterpretedFunction.run``; the kernels still
run. ``save``/``load`` write and read them as JSON.

This module imports neither torch nor triton at import time (the CLI sets TRITON_INTERPRET first).
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

OPTION_NAMES = ("num_warps", "num_stages", "num_ctas", "maxnreg")


@dataclass(frozen=True)
class Launch:
    """One kernel specialization. ``args``: one descriptor per kernel parameter, in order:
    ``["tensor", dtype, aligned]`` (dtype as torch names it, e.g. "bfloat16"), ``["int", v]``,
    ``["float", v]``, ``["bool", v]``, ``["none"]``, ``["const", v]`` (a constexpr)."""

    kernel: str  # "module:function", e.g. "fast.codec.matmul_triton:_matmul_kernel"
    args: tuple
    num_warps: int = 4
    num_stages: int = 3
    origin: str = ""  # what launched it: a conformance case, or a named real shape
    default: bool = False  # the configuration a launcher picks by default on a GPU (must not spill)
    origins: tuple = field(default=(), compare=False)  # every origin that made the same launch

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["args"] = [list(a) for a in self.args]
        d["origins"] = list(self.origins)
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Launch:
        return Launch(d["kernel"], tuple(tuple(a) for a in d["args"]), int(d.get("num_warps", 4)),
                      int(d.get("num_stages", 3)), d.get("origin", ""), bool(d.get("default", False)),
                      tuple(d.get("origins", ())))


def describe(value: Any, is_constexpr: bool) -> tuple:
    """The descriptor of one argument (see ``Launch``)."""
    if is_constexpr:
        return ("const", value)
    if value is None:
        return ("none",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", value)
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return ("tensor", str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0)
    raise TypeError(f"cannot describe a kernel argument of type {type(value).__name__}")


def kernel_name(fn: Any) -> str:
    """``module:function`` of a Python function (the one under a @triton.jit)."""
    return f"{fn.__module__}:{fn.__name__}"


# constexprs that exist only for the interpreter, and the value the same launch has on a GPU
# fast/codec/matmul_triton.py: widen bf16 tiles to fp32 before tl.dot (interpreter only)
GPU_VALUES = {"DOT_F32": False}


def make_launch(fn: Any, args: tuple, kwargs: dict[str, Any], origin: str = "", default: bool = False,
                on_gpu: bool = False) -> Launch:
    """The launch of Python kernel function ``fn`` (its parameters annotated as in the source) with
    ``kernel[grid](*args, **kwargs)``; ``on_gpu``: with the GPU's value of interpreter-only constexprs."""
    params = list(inspect.signature(fn).parameters.values())
    options = {k: kwargs[k] for k in OPTION_NAMES if k in kwargs}
    kw = {k: v for k, v in kwargs.items() if k not in OPTION_NAMES}
    names = [p.name for p in params]
    if len(args) > len(names):
        raise TypeError(f"{kernel_name(fn)} takes {len(names)} arguments, got {len(args)}")
    unknown = sorted(set(kw) - set(names))
    if unknown:
        raise TypeError(f"{kernel_name(fn)} has no parameter named {', '.join(unknown)}")
    bound = dict(zip(names[:len(args)], args, strict=True))
    bound.update(kw)
    descs = []
    for p in params:
        if p.name not in bound:
            if p.default is inspect.Parameter.empty:
                raise TypeError(f"{kernel_name(fn)}: no value for parameter {p.name}")
            bound[p.name] = p.default
        value = GPU_VALUES[p.name] if on_gpu and p.name in GPU_VALUES else bound[p.name]
        descs.append(describe(value, "constexpr" in str(p.annotation)))
    return Launch(kernel_name(fn), tuple(descs), int(options.get("num_warps", 4)), int(options.get("num_stages", 3)),
                  origin, default, (origin,) if origin else ())


class Recorder:
    """Collects launches; ``origin`` names what is running now (a case name)."""

    def __init__(self) -> None:
        self.launches: dict[tuple, Launch] = {}
        self.origin = ""

    def add(self, launch: Launch) -> None:
        key = (launch.kernel, launch.args, launch.num_warps, launch.num_stages)
        old = self.launches.get(key)
        if old is None:
            self.launches[key] = launch
        elif launch.origin and launch.origin not in old.origins:
            self.launches[key] = Launch(old.kernel, old.args, old.num_warps, old.num_stages, old.origin, old.default,
                                        (*old.origins, launch.origin))

    def all(self) -> list[Launch]:
        return list(self.launches.values())


@contextlib.contextmanager
def record_launches() -> Iterator[Recorder]:
    """While active, every launch of an interpreted Triton kernel is added to the recorder (and runs).

    Interpreter-only constexprs are recorded with their GPU value (``GPU_VALUES``): the launch the same
    call makes on a GPU."""
    from triton.runtime.interpreter import InterpretedFunction

    recorder = Recorder()
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        recorder.add(make_launch(self.fn, args, kwargs, recorder.origin, on_gpu=True))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield recorder
    finally:
        InterpretedFunction.run = original


def save(path: Path, launches: list[Launch]) -> None:
    """Write launches as JSON (complete or not at all)."""
    from reference.safe_write import write_text

    write_text(path, json.dumps({"launches": [x.to_json() for x in launches]}, indent=0) + "\n")


def load(path: Path) -> list[Launch]:
    """Read launches written by ``save``; a clear error if the file is not such a list."""
    try:
        doc = json.loads(Path(path).read_text())
        return [Launch.from_json(d) for d in doc["launches"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a launches file written by --record-launches ({type(e).__name__}: {e})") \
            from e
