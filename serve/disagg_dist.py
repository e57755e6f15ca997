"""The disaggregated endpoint under torchrun: its workers are ranks of one torch.distributed group.

    UNFIRE_DISAGG_SECRET=$SECRET torchrun --nnodes 1 --nproc-per-node 3 --master-addr 127.0.0.1 \\
        --master-port PORT -m serve --model smollm2 --dist-workers 1 --port 8000

Every rank runs ``python -m serve``. Rank 0 is the server: the OpenAI-compatible app over the
``DisaggEngine`` of ``serve/disagg.py`` (the same coordinator, routing, migration, leases and per-worker
metrics); ranks 1..P (``--dist-workers P``) are prefill workers and the other ranks decode workers.
Only the carrier differs from ``--prefill-workers``/``--workers``: each worker's link is a
``fast.disagg.DistEndpoint`` (gloo point-to-point) instead of a TCP socket; the frames, their signing
with the shared secret (``$UNFIRE_DISAGG_SECRET`` on every rank)
and every check are the same.

A lost rank cannot rejoin: torch.distributed's group has a fixed size, so nothing is restarted. Under
gloo a dead rank's pairs close at once ("Connection closed by peer"), its link here ends, and the
coordinator does what it does for a lost worker process (a decode worker's requests migrate to a live
one, a prefill worker's are recomputed by their decode worker). Once no decode rank is left every
request still waiting, and every new one, ends with an error event instead of waiting for a worker
that cannot come. torchrun itself (no ``--max-restarts``) then stops the whole group: it sends SIGTERM
to every other rank; the server drains as on any SIGTERM (``--shutdown-grace``) and ends the streams
still open with an error event; the worker ranks ignore SIGTERM so that they serve the drain, and exit
when the server closes their links (torchrun kills what is left 30 s later).

Frames are host bytes, so the group is gloo on GPU hosts too (NCCL moves device memory only).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time
from typing import Any

from reference.disagg.coordinator import Coordinator, RequestState
from reference.disagg.pool import SECRET_ENV, WorkerOptions, hello, make_worker, serve
from reference.disagg.routing import Worker
from reference.disagg.transport import Link
from serve.disagg import DisaggEngine

FOREVER = datetime.timedelta(days=365)  # a worker rank waits for its next frame as long as the server is idle


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregated workers under torchrun (see serve/disagg_dist.py)")
    g.add_argument("--dist-workers", type=int, metavar="P",
                   help="under torchrun: rank 0 serves, ranks 1..P are prefill workers, the rest decode workers "
                        f"(torch.distributed, gloo; shared secret in ${SECRET_ENV} on every rank)")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, others: bool) -> None:
    """``others``: whether another worker option (--prefill-workers, --workers, ...) was given too."""
    if args.dist_workers is None:
        return
    if others:
        p.error("--dist-workers takes its workers from torchrun's ranks; it does not combine with "
                "--prefill-workers, --decode-workers or --workers")
    if args.pipeline or args.compressed:
        p.error("--pipeline and --compressed serve a colocated engine; they do not combine with --dist-workers")
    world = os.environ.get("WORLD_SIZE", "")
    if not world.isdigit() or "RANK" not in os.environ:
        p.error("--dist-workers runs under torchrun (RANK and WORLD_SIZE unset): "
                "torchrun --nproc-per-node N -m serve ...")
    if args.dist_workers < 1 or int(world) < args.dist_workers + 2:
        p.error(f"--dist-workers {args.dist_workers} with {world} ranks: need rank 0 (the server), >= 1 prefill "
                "and >= 1 decode rank, so 1 <= P <= WORLD_SIZE - 2")
    secret = os.environ.get(SECRET_ENV, "")
    try:
        ok = len(bytes.fromhex(secret)) >= 16
    except ValueError:
        ok = False
    if not ok:
        p.error(f"--dist-workers needs the shared secret (at least 32 hex digits, the same on every rank) "
                f"in ${SECRET_ENV}")


def join_group() -> int:
    """Join torchrun's group (gloo, no timeout on idle links); returns this rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=FOREVER)
    return dist.get_rank()


def options(args: argparse.Namespace) -> WorkerOptions:
    return WorkerOptions(num_blocks=args.num_blocks, block_size=args.block_size, wire=args.kv_wire,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)


def run_worker(args: argparse.Namespace, rank: int) -> int:
    """A worker rank: the worker loop of ``reference.disagg`` over a link to rank 0, until it closes."""
    import torch.distributed as dist
    from threadpoolctl import threadpool_limits

    from fast.disagg.dist import DistEndpoint

    for sig in (signal.SIGTERM, signal.SIGINT):  # torchrun forwards them; the server's closing ends us
        signal.signal(sig, signal.SIG_IGN)
    threadpool_limits(max(1, args.blas_threads), user_api="blas")
    role = "prefill" if rank <= args.dist_workers else "decode"
    link = Link(DistEndpoint(0), bytes.fromhex(os.environ[SECRET_ENV]), node=rank)
    opts = options(args)
    worker = make_worker(role, args.model, link, opts)
    hello(worker, link, args.model, opts)
    serve(worker, link)
    link.endpoint.close()
    link.endpoint.wait_closed(timeout=5.0)
    dist.destroy_process_group()
    return 0


class DistCoordinator(Coordinator):
    """The coordinator whose lost workers never come back: with no decode rank left, requests end."""

    def _no_decoder(self) -> str | None:
        if self.live("decode") or self.shutting_down:
            return None
        return "no decode rank is left (torch.distributed ranks cannot rejoin a running group)"

    def _route(self, req: RequestState) -> None:
        why = self._no_decoder()
        if why is not None and req.result is None:
            return self._end(req, req.tokens, "error", why)
        super()._route(req)

    def _lost(self, w: Worker) -> None:
        super()._lost(w)
        why = self._no_decoder()
        if why is not None:
            for req in list(self.waiting):
                self._end(req, req.tokens, "error", why)


class DistPool:
    """What ``DisaggEngine`` asks of its pool, over the ranks of the group (rank 0 is this process)."""

    def __init__(self, world: int, secret: bytes, *, lease_s: float, ready_timeout: float = 300.0) -> None:
        from fast.disagg.dist import DistEndpoint

        self.restarts = 0  # a rank cannot be restarted
        self.coordinator = DistCoordinator(secret, deadline=lambda p, o: 120.0 + 0.5 * o, lease_s=lease_s)
        self.endpoints = [DistEndpoint(r, self.coordinator.inbox) for r in range(1, world)]
        for e in self.endpoints:
            self.coordinator.attach(e)
        end = time.monotonic() + ready_timeout
        while len(self.coordinator.workers) < world - 1:
            if time.monotonic() > end or any(e.closed for e in self.endpoints):
                missing = sorted(set(range(1, world)) - set(self.coordinator.workers))
                self.close(wait=0.0)
                raise TimeoutError(f"ranks {missing} did not say HELLO within {ready_timeout:.0f} s (or died)")
            self.pump()

    def pump(self) -> None:
        self.coordinator.poll(0.02)

    def housekeeping(self) -> None:
        """Nothing to reconnect: a lost rank stays lost."""

    def close(self, wait: float = 5.0) -> None:
        """SHUTDOWN to every rank (their BYEs within ``wait`` s), close the links, leave the group."""
        import torch.distributed as dist

        if wait:
            self.coordinator.shutdown(wait=wait, pump=self.pump)
        for e in self.endpoints:
            e.close(flush_s=1.0)
        for e in self.endpoints:
            e.wait_closed(timeout=5.0)
        if all(not e._reader.is_alive() for e in self.endpoints):  # a recv still blocked would hang destroy
            dist.destroy_process_group()


def build(args: argparse.Namespace, tokenizer: Any = None) -> DisaggEngine:
    """Rank 0's engine: ``DisaggEngine`` over the group's worker ranks. Raises ValueError on bad input."""
    import torch.distributed as dist

    from reference.model.tokenizer import load_tokenizer

    if args.engine != "reference":
        raise ValueError("the disaggregated workers run the reference runner; use --engine reference")
    pool = DistPool(dist.get_world_size(), bytes.fromhex(os.environ[SECRET_ENV]), lease_s=args.worker_lease)
    return DisaggEngine(args.model, tokenizer or load_tokenizer(args.model), opts=options(args), pool=pool,
                        max_model_len=args.max_model_len)
