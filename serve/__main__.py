"""``python -m serve``: the OpenAI-compatible server over an engine.

    python -m serve --model smollm2 [--engine reference|fast] [--host 127.0.0.1] [--port 8000]
                    [--api-keys KEYS.toml] [--num-blocks 512] [--max-pending 256] [--shutdown-grace 10]
                    [--prefill-workers P --decode-workers D | --workers HOST:PORT,...] [--kv-wire fp32]

Without ``--api-keys`` every request is accepted (tenant "default"), so the server binds only to a
loopback address unless ``--allow-unauthenticated`` is given. SIGTERM (or Ctrl-C) stops accepting
connections, lets requests in flight finish for ``--shutdown-grace`` seconds, aborts the rest (their
streams end with an error event) and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from types import FrameType

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="packaged model name or checkpoint path (default smollm2)")
    p.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    p.add_argument("--engine", choices=["reference", "fast"], default="reference")
    p.add_argument("--dtype", default="bfloat16", help="weights dtype of the fast engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument("--api-keys", help="TOML file: [keys] key = { tenant = ..., plan = ... }, optional [plans]")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="without --api-keys, allow binding to a non-loopback address")
    p.add_argument("--policy", default="sjf+wfq", help="scheduling policy: fcfs, sjf, wfq, sjf+wfq (default)")
    p.add_argument("--num-blocks", type=int, default=512, help="KV cache blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-pending", type=int, default=256,
                   help="requests in flight before new ones get 503 + Retry-After")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds requests in flight may finish after SIGTERM before they are aborted")
    p.add_argument("--blas-threads", type=int, default=1, help="BLAS threads of the reference engine")
    p.add_argument("--log-level", default="warning")
    from serve import disagg

    disagg.add_arguments(p)
    args = p.parse_args(argv)
    disagg.check_arguments(p, args)
    if args.api_keys is None and args.host not in LOOPBACK and not args.allow_unauthenticated:
        p.error(f"--host {args.host} without --api-keys would serve anyone who can reach it; "
                "give --api-keys KEYS.toml, or --allow-unauthenticated if that is what you want")
    for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_pending"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.shutdown_grace < 0:
        p.error("--shutdown-grace must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print("error: the server needs the serve extra: pip install -e '.[serve]'", file=sys.stderr)
        return 2

    from serve.app import create_app
    from serve.engines import EngineUnavailable, load_engine
    from serve.keys import KeysError, KeyTable
    from serve.worker import EngineWorker

    try:
        keys = KeyTable.load(args.api_keys) if args.api_keys else None
    except KeysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.engine == "reference" and args.blas_threads > 0:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.blas_threads, user_api="blas")
    from serve import disagg

    try:
        if disagg.wanted(args):
            engine = disagg.build(args)
            worker = disagg.DisaggWorker(engine)
        else:
            engine = load_engine(args.model, args.engine, tenants=keys.tenants if keys else None,
                                 policy=args.policy, dtype=args.dtype, num_blocks=args.num_blocks,
                                 block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 max_model_len=args.max_model_len)
            worker = EngineWorker(engine)
    except (EngineUnavailable, ValueError, OSError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.model
    app = create_app(worker, engine.tokenizer, model_name=name, keys=keys, max_pending=args.max_pending)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=int(args.shutdown_grace) + 5)
    server = draining_server(config, worker, args.shutdown_grace)
    worker.start()
    kind = f"{args.engine} engine" if not disagg.wanted(args) else \
        f"disaggregated: {len(engine.coordinator.live('prefill'))} prefill + " \
        f"{len(engine.coordinator.live('decode'))} decode workers, {args.kv_wire} KV wire"
    print(f"serving {name} ({kind}, context {worker.max_model_len} tokens) on "
          f"http://{args.host}:{port}/v1" + (f" with {len(keys)} API keys" if keys else ""), flush=True)
    # uvicorn handles SIGTERM/SIGINT itself while it runs, then re-raises the signal to whatever handler
    # was there before; a handler that does nothing makes a drained shutdown exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        if hasattr(engine, "close"):
            engine.close()  # the disaggregated workers: BYE, then reaped
    print("stopped", flush=True)
    return 0


def draining_server(config: object, worker: object, grace: float) -> object:
    """uvicorn's Server, whose exit signal (SIGTERM, SIGINT) also tells the engine worker to drain."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            worker.drain(grace)  # type: ignore[attr-defined]
            super().handle_exit(sig, frame)

    return DrainingServer(config)  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
