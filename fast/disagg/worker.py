"""``python -m fast.disagg.worker``: one disaggregated worker process stepping on the fast engine's runner.

The options of ``python -m reference.disagg worker`` (the same protocol, frames and control plane), plus
how the torch model is served:

    python -m fast.disagg.worker --role prefill --model smollm2 --listen 0.0.0.0:7001 [--dtype bfloat16]
        [--compressed qkv,o,gate_up,down] [--threads 1]

``python -m serve --prefill-workers P --decode-workers D`` starts its workers this way unless given
``--engine reference``. The decode worker's KV cache has the model's dtype unless ``--options`` sets
``kv_dtype``; ``--model`` may be an Unweight container (``python -m reference.codec compress``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from fast.disagg.worker_runner import load_worker_model
from reference.disagg.__main__ import add_worker_arguments, worker_main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fast.disagg.worker", description=__doc__.splitlines()[0])
    add_worker_arguments(p)
    p.set_defaults(engine="fast")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights dtype")
    p.add_argument("--compressed", nargs="?", const="all", default="",
                   help="projection matrices served in the palette form: qkv,o,gate_up,down; bare: all")
    p.add_argument("--device", help="torch device (default: cuda when there is one)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 1),
                   help="torch CPU threads (default $OMP_NUM_THREADS, else 1)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine != "fast":
        print("worker: this command runs the fast runner; use `python -m reference.disagg worker` for the "
              "NumPy one", file=sys.stderr)
        return 2
    if args.threads < 1:
        print("worker: --threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    names = ("qkv", "o", "gate_up", "down") if args.compressed == "all" else tuple(
        n.strip() for n in args.compressed.split(",") if n.strip())
    if not any(item.startswith("kv_dtype=") for item in args.options.split(",")):
        args.options = ",".join(filter(None, [args.options, f"kv_dtype={args.dtype}"]))

    def load(opts: object) -> tuple[object, str]:
        return load_worker_model(args.model, dtype=args.dtype, compressed=names, device=args.device)

    try:
        return worker_main(args, load)
    except (ValueError, OSError) as e:  # a model that cannot be loaded as asked, named
        print(f"worker: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
