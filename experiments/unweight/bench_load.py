"""Load time of a container straight into the palette form against the plain checkpoint's load.

    python -m experiments.unweight.bench_load [--model smollm2] [--container PATH] [--repeat 3] [--json PATH]

Issue 32 item 4: loading a container with every projection served compressed
(``TorchLlama.load(container, compressed=True)``, what ``python -m serve --model x.uw --compressed``
does) takes no longer than twice the plain checkpoint's load (``TorchLlama.load(model)``), in CPU
seconds of this process, measured in the same run: the loads alternate (plain, compressed, plain, ...)
after one untimed warm-up of each, one torch thread; medians and the ratio of medians are reported.
``--container`` reuses a container (else ``--model`` is compressed once with the fast encoder, to
bf16, into a temporary folder; the compression is not timed as a load).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from reference.safe_write import write_text

GOAL = 2.0  # compressed load CPU seconds / plain load CPU seconds, at most


def timed_load(source: str | Path, compressed: bool) -> dict[str, float]:
    from fast.engine.model import TorchLlama

    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    model = TorchLlama.load(source, dtype="bfloat16", compressed=compressed)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    del model
    return {"wall_s": wall, "cpu_s": cpu}


def run(model: str, container: Path | None, repeat: int) -> dict[str, Any]:
    import torch

    from fast.codec.__main__ import encode_to_reference
    from reference.codec import compress_checkpoint

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if container is None:
            container = Path(tmp) / "model.uw"
            compress_checkpoint(model, container, to_bf16=True, encoder=encode_to_reference)
        loads: dict[str, list[dict[str, float]]] = {"plain": [], "compressed": []}
        timed_load(model, False), timed_load(container, True)  # warm-up: imports, page cache
        for _ in range(repeat):
            loads["plain"].append(timed_load(model, False))
            loads["compressed"].append(timed_load(container, True))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("cpu_s", "wall_s")} for k, v in loads.items()}
    ratio = med["compressed"]["cpu_s"] / med["plain"]["cpu_s"]
    return {"model": model, "repeat": repeat, "threads": 1, "runs": loads, "median": med,
            "ratio_cpu": ratio, "ratio_wall": med["compressed"]["wall_s"] / med["plain"]["wall_s"],
            "goal": f"compressed / plain CPU seconds <= {GOAL}", "met": ratio <= GOAL}


def main(argv: list[str] | None = None) -> None:
    from reference.provenance import commit, machine, now

    p = argparse.ArgumentParser(prog="python -m experiments.unweight.bench_load",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="packaged model name or checkpoint path (smollm2)")
    p.add_argument("--container", type=Path, default=None,
                   help="an existing container of --model (default: one is written to a temp dir)")
    p.add_argument("--repeat", type=int, default=3, help="alternating repeats of each load (3)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    out = run(args.model, args.container, args.repeat)
    out["machine"], out["commit"] = machine(), commit()
    out["date"] = now()
    out["note"] = "a shared 2-core machine (other jobs running): CPU seconds are the fair measure"
    m = out["median"]
    print(f"plain load {m['plain']['cpu_s']:.2f} CPU-s ({m['plain']['wall_s']:.2f} s wall); container into the "
          f"palette form {m['compressed']['cpu_s']:.2f} CPU-s ({m['compressed']['wall_s']:.2f} s): "
          f"{out['ratio_cpu']:.2f}x CPU (goal <= {GOAL}x: {'met' if out['met'] else 'NOT met'})")
    if args.json:
        write_text(args.json, json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
