"""``python -m fast.lesson.bench``: the lesson kernel's speed against its bound.

The row scales read every weight once (2 bytes) and write 3 bytes per row: a memory-bound kernel, whose bound
is the time to stream its bytes at the memory's bandwidth. On the CPU that bandwidth is measured here, by one
NumPy copy of a buffer as large as the matrix (the best of ``--repeats``, one thread like the C kernel; a copy
reads and writes, so the bandwidth is 2 x size / copy time); on a GPU it is the datasheet's
(``fast.triton_util.device_props``). Each path prints its time (median of ``--repeats``), its GB/s and its
fraction of the bound: a kernel at 0.8 of its bound has little left to win, one at 0.1 has a reason to be
looked at. On a machine shared with other jobs both sides move: read the fraction, run it twice.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from fast import cpu_isa


def _seconds(fn: Callable[[], object], repeats: int, pick: Callable[[list[float]], float] = statistics.median
             ) -> float:
    fn()  # the first call builds, compiles, warms the caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return pick(times)


def cpu_copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second one thread of this CPU streams through a copy of ``nbytes`` (read + write counted)."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return 2 * nbytes / _seconds(lambda: np.copyto(dst, src), repeats, min)  # the best: a bound


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fast.lesson.bench", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096, help="rows of the bf16 matrix (default 4096)")
    p.add_argument("--cols", type=int, default=4096, help="columns (default 4096)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per path, median (default 20)")
    args = p.parse_args(argv)

    from fast.lesson import row_scale, row_scale_c

    x = torch.randn(args.rows, args.cols).to(torch.bfloat16)
    nbytes = x.numel() * 2 + args.rows * 3
    bound_bw = cpu_copy_bandwidth(x.numel() * 2, args.repeats)
    runs: dict[str, Callable[[], object]] = {"torch lines": lambda: row_scale.row_scales_torch(x)}
    if row_scale_c.library() is not None:
        names = row_scale_c.PATH_ISA.get(cpu_isa.arch(), {0: "scalar"})
        for path in row_scale_c.paths():
            runs[f"C {names[path]}"] = lambda path=path: row_scale_c.row_scales_c(x, path=path)
    print(f"{args.rows} x {args.cols} bf16, {nbytes / 1e6:.1f} MB; bound: {nbytes / bound_bw * 1e3:.3f} ms at "
          f"{bound_bw / 1e9:.1f} GB/s (a one-thread copy on this CPU)")
    for name, fn in runs.items():
        t = _seconds(fn, args.repeats)
        print(f"  {name:12s} {t * 1e3:8.3f} ms  {nbytes / t / 1e9:6.1f} GB/s  "
              f"{nbytes / bound_bw / t:5.2f} of the bound")
    if torch.cuda.is_available():
        from triton.testing import do_bench

        from fast.triton_util import device_props

        xg = x.cuda()
        props = device_props(xg.device)
        t = do_bench(lambda: row_scale.row_scales_triton(xg)) / 1e3
        print(f"  Triton on {props.name}: {t * 1e3:.3f} ms, {nbytes / t / 1e9:.0f} GB/s, "
              f"{nbytes / props.hbm_bytes_per_s / t:.2f} of the bound ({props.hbm_bytes_per_s / 1e12:.2f} TB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
