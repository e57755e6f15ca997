"""``torchrun ... -m fast.disagg``: the batch command of ``reference.disagg`` over torch.distributed.

Every rank runs this; rank 0 coordinates (reads IN, writes OUT), ranks 1..P are prefill workers and
the rest decode workers. The shared secret comes from ``$UNFIRE_DISAGG_SECRET`` (hex), as for the
socket transport; every rank must have the same one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from fast.disagg.dist import DistEndpoint
from reference.disagg.__main__ import read_prompts
from reference.disagg.batch import run_requests
from reference.disagg.coordinator import Coordinator
from reference.disagg.pool import SECRET_ENV, WorkerOptions, hello, make_worker, serve
from reference.disagg.transport import Link


class DistPool:
    """What ``run_requests`` needs: a coordinator and a ``pump``."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def pump(self) -> None:
        self.coordinator.poll(0.02)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun ... -m fast.disagg", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prefill", type=int, default=1, help="how many of ranks 1.. are prefill workers")
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kv-wire", default="fp32", choices=["fp32", "bf16", "fp8"])
    parser.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (GPU)")
    args = parser.parse_args(argv)
    secret = bytes.fromhex(os.environ.get(SECRET_ENV, ""))
    if not secret:
        print(f"error: set the shared secret (hex) in ${SECRET_ENV} for every rank", file=sys.stderr)
        return 2
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 3 or not 1 <= args.prefill <= world - 2:
        print("error: need at least 3 ranks: a coordinator, >= 1 prefill and >= 1 decode worker", file=sys.stderr)
        return 2
    opts = WorkerOptions(wire=args.kv_wire)
    if rank == 0:
        code = coordinate(args, secret, world)
    else:
        role = "prefill" if rank <= args.prefill else "decode"
        link = Link(DistEndpoint(0), secret, node=rank)
        worker = make_worker(role, args.model, link, opts)
        hello(worker, link, args.model, opts)
        serve(worker, link)
        link.endpoint.close()
        link.endpoint.wait_closed()
        code = 0
    dist.destroy_process_group()
    return code


def coordinate(args: argparse.Namespace, secret: bytes, world: int) -> int:
    coordinator = Coordinator(secret)
    endpoints = [DistEndpoint(r, coordinator.inbox) for r in range(1, world)]
    for e in endpoints:
        coordinator.attach(e)
    pool = DistPool(coordinator)
    while len(coordinator.workers) < world - 1:
        pool.pump()
    requests = read_prompts(args.prompts)
    good = [r for r in requests if "_error" not in r]
    done = iter(run_requests(pool, good))
    results = [{"id": r.get("id"), "output_token_ids": [], "finish_reason": "error", "error": r["_error"]}
               if "_error" in r else next(done) for r in requests]
    coordinator.shutdown(wait=30.0)
    for e in endpoints:
        e.close()
        e.wait_closed()
    args.out.write_text("".join(json.dumps(r) + "\n" for r in results))
    return 0 if all(r["error"] is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
