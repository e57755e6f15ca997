"""Command line: ``python -m reference.disagg run`` (a batch) and ``... worker`` (one worker).

    python -m reference.disagg run --model smollm2 --prefill 1 --decode 1 --prompts IN.jsonl --out
    OUT.jsonl \\
        [--kv-wire fp32|bf16|fp8] [--inject FAULT[,FAULT...]] [--seed N]

IN: one JSON object per line, ``{"id": str, "prompt_token_ids": [int], "max_tokens": int}``
(greedy). OUT: one line per input line, in order, whatever happens:
``{"id", "output_token_ids", "finish_reason", "error"}`` (if the pool itself fails, every request
not yet answered gets that failure as its error). The coordinator and pool are those of the endpoint
(``python -m serve --prefill-workers P --decode-workers D``): the same routing, faults, request
migration, worker leases and restarts (``PROTOCOL.md`` section 6).
``--prefill 0 --decode 0`` runs the same prompts colocated, in one engine in this process. The
carrier is an option: worker processes over sockets (default), ``--in-process`` (queues),
``--workers HOST:PORT,...`` (workers already running elsewhere, on either runner); torch.distributed
ranks serve the HTTP door (``torchrun ... -m serve --dist-workers P``). At the end
one line says what was written: how many requests finished and failed, and the first error.
Exit status: 0 when every request ended without error, 1 otherwise, 2 for bad arguments or input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from reference import jsonsafe
from reference.disagg.faults import FAULTS

# the same name as reference.disagg.pool's (imported lazily there)
SECRET_ENV = "UNFIRE_DISAGG_SECRET"

EPILOG = ("faults for --inject (the workers then use short timeouts: handshake 0.5 s x 3, stream 3 "
          "s):\n"
          + "\n".join(f"  {name:13s} {what}" for name, what in FAULTS.items()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m reference.disagg",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a batch of prompts (disaggregated or colocated)",
                         epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument(
        "--model", default="smollm2", help="smollm2, tiny[:SEED], or a checkpoint path"
    )
    run.add_argument("--prefill", type=int, default=1, help="prefill worker processes (0 with "
                                                            "--decode 0: colocated)")
    run.add_argument("--decode", type=int, default=1, help="decode worker processes")
    run.add_argument("--prompts", required=True, type=Path, help="input JSONL")
    run.add_argument("--out", required=True, type=Path, help="output JSONL")
    run.add_argument("--kv-wire", default="fp32", choices=["fp32", "bf16", "fp8"],
                     help="how KV is sent from prefill to decode workers (default fp32)")
    run.add_argument("--inject", default="", help="comma-separated faults (below)")
    run.add_argument("--seed", type=int, default=0, help="seed of the fault injector")
    run.add_argument("--deadline", type=float, default=None,
                     help="seconds a request may take before it fails with an error (default: 120 "
                          "s plus 50 ms per "
                          "token of the whole batch, since a request may queue behind all the "
                          "others)")
    run.add_argument("--worker-lease", type=float, default=15.0,
                     help="seconds a worker may send nothing (not even a heartbeat) before it is "
                          "treated as lost: "
                          "killed, restarted, its requests migrated (default 15)")
    run.add_argument("--in-process", action="store_true", help="workers in this process (queues) "
                                                               "instead of OS "
                                                               "processes (sockets)")
    run.add_argument("--workers", default="", metavar="HOST:PORT,...",
                     help="also workers already running elsewhere (`python -m reference.disagg "
                          "worker --listen "
                          "HOST:PORT` or `python -m fast.disagg.worker ...`; shared secret in "
                          f"${SECRET_ENV}); "
                          "with --prefill 0 --decode 0, only those")
    add_worker_arguments(sub.add_parser("worker", help="(started by the coordinator) one worker "
                                                       "process"))
    return parser.parse_args(argv)


def add_worker_arguments(work: argparse.ArgumentParser) -> None:
    """The options of one worker process (``python -m fast.disagg.worker`` takes them too)."""
    work.add_argument("--role", choices=["prefill", "decode"], required=True,
                      help="what this worker does")
    work.add_argument("--node", type=int, help="this worker's node id (1-65535; with --port)")
    work.add_argument("--port", type=int, help="the coordinator's port on 127.0.0.1 to connect to")
    work.add_argument("--listen", metavar="HOST:PORT", help="instead: wait for coordinators to "
                                                            "connect here "
                      "(`python -m serve --workers HOST:PORT`); port 0 picks one, printed at start")
    work.add_argument("--model", required=True, help="smollm2, tiny[:SEED], or a checkpoint path")
    work.add_argument("--kv-wire", default="fp32", choices=["fp32", "bf16", "fp8"],
                      help="how KV is sent to decode workers (default fp32)")
    work.add_argument("--secret-stdin", action="store_true",
                      help="read the shared secret (hex) from stdin, as the coordinator sends it; "
                           "without it, "
                           f"from ${SECRET_ENV}")
    work.add_argument("--options", default="", help="WorkerOptions fields as name=value,...")
    work.add_argument("--engine", choices=["reference", "fast"], default="reference",
                      help="the model runner the worker steps on: reference (NumPy, this command) "
                           "or fast (torch: "
                           "started as `python -m fast.disagg.worker` with the same options)")


def read_prompts(path: Path) -> list[dict]:
    """Input lines; a malformed line becomes a request that fails with its reason (its line is
    kept)."""
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = jsonsafe.loads(line, what=f"line {number}")
            if not isinstance(r, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            r = {"id": f"line-{number}", "_error": f"line {number} is not valid JSON: {e}"}
        requests.append(r)
    return requests


def run_colocated(model_spec: str, requests: list[dict]) -> list[dict]:
    from reference.disagg.models import load_model
    from reference.engine.engine import Engine, EngineError
    from reference.engine.params import SamplingParams

    engine, ids = Engine(load_model(model_spec)), {}
    results: list[dict | None] = [None] * len(requests)
    for i, r in enumerate(requests):
        try:
            if "_error" in r:
                raise EngineError(r["_error"])
            ids[i] = engine.add_request(r.get("prompt_token_ids"),
                                        SamplingParams(max_tokens=r.get("max_tokens")),
                                        request_id=r.get("id"))
        except (EngineError, TypeError) as e:
            results[i] = {"id": r.get("id"), "output_token_ids": [], "finish_reason": "error",
                          "error": str(e)}
    while engine.has_unfinished():
        engine.step()
    for i, rid in ids.items():
        out = engine.output(rid)
        results[i] = {"id": rid, "output_token_ids": out.output_token_ids,
                      "finish_reason": out.finish_reason, "error": None}
    return results  # type: ignore[return-value]


def run_disaggregated(args: argparse.Namespace, requests: list[dict],
                      faults: list[str]) -> list[dict]:
    from rich.progress import Progress

    from reference.disagg.batch import ProcessFaults, run_requests
    from reference.disagg.faults import FaultInjector
    from reference.disagg.pool import (
        FAST_FAULTS,
        InProcessPool,
        ProcessPool,
        WorkerOptions,
        parse_workers,
    )

    injector = FaultInjector(faults, args.seed) if faults else None
    kind = InProcessPool if args.in_process else ProcessPool
    carrier = {}
    if args.workers:  # remote workers: over sockets, signed with the secret they were started with
        carrier = {
            "remote": parse_workers(args.workers),
            "secret": bytes.fromhex(os.environ[SECRET_ENV]),
        }
    good = [r for r in requests if "_error" not in r]
    opts = WorkerOptions(wire=args.kv_wire, **(FAST_FAULTS if faults else {}))
    total = sum(
        len(r.get("prompt_token_ids") or []) + (r.get("max_tokens") or 0)
        for r in good
        if isinstance(r.get("max_tokens"), int) and isinstance(r.get("prompt_token_ids"), list)
    )
    seconds = args.deadline if args.deadline is not None else 120.0 + 0.05 * total
    with kind(args.model, args.prefill, args.decode, opts=opts, injector=injector,
              deadline=lambda p, o: seconds, lease_s=args.worker_lease, **carrier) as pool:
        ProcessFaults(pool, faults, args.seed, len(good))
        with Progress(transient=True) as progress:
            task = progress.add_task("requests", total=len(good))
            done = run_requests(pool, good, on_progress=lambda n: progress.advance(task, n))
    by_index = iter(done)
    return [{"id": r.get("id"), "output_token_ids": [], "finish_reason": "error",
             "error": r["_error"]}
            if "_error" in r else next(by_index) for r in requests]


def worker_main(args: argparse.Namespace, load: Any = None) -> int:
    """One worker process. ``load(options) -> (model, digest)`` loads another engine's model (the
    fast worker's); without it the worker steps on the NumPy runner."""
    from reference.disagg.models import digest_of, load_model
    from reference.disagg.pool import WorkerOptions, hello, make_worker, read_secret, serve
    from reference.disagg.transport import Link, connect

    if args.engine != "reference" and load is None:
        print("worker: --engine fast is the torch runner: start the worker as `python -m "
              "fast.disagg.worker` "
              "(same options); this command runs the NumPy runner", file=sys.stderr)
        return 2
    try:
        secret = (
            read_secret(sys.stdin)
            if args.secret_stdin
            else bytes.fromhex(os.environ.get(SECRET_ENV, ""))
        )
    except ValueError as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    if not secret:
        print("worker: no shared secret: give --secret-stdin and write it to stdin, or set "
              f"${SECRET_ENV}", file=sys.stderr)
        return 2
    fields = {f: type(getattr(WorkerOptions(), f)) for f in WorkerOptions.__dataclass_fields__}
    values: dict = {"wire": args.kv_wire}
    for item in filter(None, args.options.split(",")):
        name, _, value = item.partition("=")
        if name not in fields:
            print(f"worker: unknown option {name!r}", file=sys.stderr)
            return 2
        values[name] = fields[name](value)
    opts = WorkerOptions(**values)
    if opts.kv_carrier == "nixl":
        from reference.disagg.nixl_carrier import CarrierError, require_nixl

        try:
            require_nixl()
        except CarrierError as e:
            print(f"worker: {e}", file=sys.stderr)
            return 2
    if not args.listen and (args.node is None or args.port is None):
        print("worker: give --node and --port, or --listen HOST:PORT", file=sys.stderr)
        return 2
    host, _, port = (args.listen or "").rpartition(":")
    if args.listen and (not host or not port.isdigit()):
        print(f"worker: --listen {args.listen!r} is not HOST:PORT", file=sys.stderr)
        return 2
    # load the model first: the coordinator expects HELLO soon after connecting
    loaded = load(opts) if load is not None else (load_model(args.model), digest_of(args.model))
    if args.listen:
        return listen_main(args, secret, opts, loaded)
    try:
        link = Link(connect(args.port), secret, args.node)
    except OSError as e:
        print(f"worker: cannot connect to the coordinator on 127.0.0.1:{args.port}: {e}",
              file=sys.stderr)
        return 1
    worker = make_worker(args.role, args.model, link, opts, loaded)
    hello(worker, link, args.model, opts)
    serve(worker, link)
    link.endpoint.close()
    return 0


def listen_main(args: argparse.Namespace, secret: bytes, opts: Any, loaded: tuple[Any, str]) -> int:
    """A worker on its own host: serve one coordinator at a time, each connection a fresh life (node
    id)."""
    import secrets
    import socket

    from reference.disagg.pool import hello, make_worker, serve
    from reference.disagg.transport import Link, LinkClosed, SocketEndpoint, listen

    host, _, port = args.listen.rpartition(":")  # checked by worker_main
    try:
        server = listen(host.strip("[]"), int(port))
    except OSError as e:
        print(f"worker: cannot listen on {args.listen}: {e}", file=sys.stderr)
        return 1
    print(f"listening on {host}:{server.getsockname()[1]}", flush=True)
    while True:
        sock, _ = server.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = Link(SocketEndpoint(sock), secret, 1 + secrets.randbelow(65535))
        worker = make_worker(args.role, args.model, link, opts, loaded)
        try:
            hello(worker, link, args.model, opts)
            serve(worker, link)
        except LinkClosed:  # the coordinator hung up: wait for the next one
            pass
        link.endpoint.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "worker":
        return worker_main(args)
    from reference.disagg.faults import parse_faults

    try:
        faults = parse_faults(args.inject)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if (args.prefill == 0) != (args.decode == 0) or args.prefill < 0 or args.decode < 0:
        print("error: --prefill and --decode must both be 0 (colocated, or only --workers) or both "
              ">= 1", file=sys.stderr)
        return 2
    if args.workers:
        from reference.disagg.pool import parse_workers

        try:
            parse_workers(args.workers)
            secret = bytes.fromhex(os.environ.get(SECRET_ENV, ""))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if len(secret) < 16:
            print("error: --workers needs the workers' shared secret (at least 32 hex digits) in "
                  f"${SECRET_ENV}", file=sys.stderr)
            return 2
        if args.in_process:
            print("error: --in-process runs every worker here; it does not combine with --workers",
                  file=sys.stderr)
            return 2
    if args.worker_lease <= 0:
        print("error: --worker-lease must be > 0", file=sys.stderr)
        return 2
    if not args.prompts.is_file():
        print(f"error: no such prompts file: {args.prompts}", file=sys.stderr)
        return 2
    try:
        requests = read_prompts(args.prompts)
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: cannot read {args.prompts}: {e}", file=sys.stderr)
        return 2
    try:
        if args.prefill == 0 and not args.workers:
            results = run_colocated(args.model, requests)
        else:
            results = run_disaggregated(args, requests, faults)
    except Exception as e:  # noqa: BLE001 (the pool failed as a whole: still answer every line)
        why = f"the batch failed: {type(e).__name__}: {e}"
        print(f"error: {why}", file=sys.stderr)
        results = [{"id": r.get("id"), "output_token_ids": [], "finish_reason": "error",
                    "error": why}
                   for r in requests]
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in results))
    tmp.replace(args.out)  # never a half-written output file
    print(summary(results, args.out), flush=True)
    return 0 if all(r["error"] is None for r in results) else 1


def summary(results: list[dict], out: Path) -> str:
    """The line printed at the end: what was written, how many requests failed, and the first
    error."""
    failed = [r for r in results if r["error"] is not None]
    line = (f"wrote {len(results)} results to {out}: {len(results) - len(failed)} finished, "
            f"{len(failed)} failed, "
            f"{sum(len(r['output_token_ids']) for r in results)} tokens generated")
    if failed:
        line += f"; first error ({failed[0]['id']!r}): {str(failed[0]['error'])[:200]}"
    return line


if __name__ == "__main__":
    sys.exit(main())
