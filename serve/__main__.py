"""``python -m serve``: the OpenAI-compatible server over an engine.

    python -m serve --model smollm2 [--engine auto|reference|fast] [--host 127.0.0.1] [--port 8000]
                    [--api-keys KEYS.toml] [--num-blocks 512] [--max-pending 256] [--shutdown-grace 10]
    python -m serve ... [--prefill-workers P --decode-workers D | --workers HOST:PORT,...] [--kv-wire fp32]
    torchrun --nproc-per-node N ... -m serve ... --dist-workers P   (workers are ranks 1..N-1: serve/disagg_dist.py)
    python -m serve fleet SCENARIO.toml [...]   (a simulator scenario on real servers: serve/fleet)

Without ``--api-keys`` every request is accepted (tenant "default"), so the server binds only to a
loopback address unless ``--allow-unauthenticated`` is given. ``--model`` may be an Unweight container
(``python -m reference.codec compress``); ``--compressed qkv,o,gate_up,down`` (or ``all``) serves those
matrices in the palette form (fast engine; with ``--pipeline``, in every stage; with disaggregated workers,
in every worker). ``--engine auto`` (default): fast if torch imports.
SIGTERM (or Ctrl-C) stops accepting connections, lets requests in flight finish for
``--shutdown-grace`` seconds, aborts the rest (their streams end with an error event) and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from types import FrameType


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The server's own options: where it listens, what it calls the model, how it shuts down."""
    g = p.add_argument_group("server")
    g.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; others need --api-keys)")
    g.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    g.add_argument("--max-pending", type=int, default=256,
                   help="requests in flight before new ones get 503 + Retry-After")
    g.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds requests in flight may finish after SIGTERM before they are aborted")
    g.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a client may take to send its request body before it gets 408 "
                        "(default 60)")
    g.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error", "critical"],
                   help="uvicorn's and the server's log level (default warning)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Each option group is defined and checked by the part it configures: the server (here), the engine
    (serve/engines.py), the pipeline (serve/pipeline.py), API keys (serve/keys.py), disaggregated workers
    (serve/disagg.py, serve/disagg_dist.py, serve/disagg_ray.py)."""
    from serve import disagg, disagg_dist, disagg_ray, engines, keys, pipeline

    p = argparse.ArgumentParser(prog="python -m serve", description=__doc__.split("\n")[0])
    engines.add_arguments(p)
    add_arguments(p)
    keys.add_arguments(p)
    pipeline.add_arguments(p)
    disagg.add_arguments(p)
    disagg_dist.add_arguments(p)
    disagg_ray.add_arguments(p)
    args = p.parse_args(argv)
    split = disagg.wanted(args)
    disagg.check_arguments(p, args)
    disagg_ray.check_arguments(p, args)
    if split and args.pipeline:
        p.error("--pipeline does not combine with disaggregated workers: a prefill or decode worker runs the whole "
                "model in its one process (a worker split over pipeline stages is not built); choose one of them")
    disagg_dist.check_arguments(p, args, others=split)
    keys.check_arguments(p, args)
    engines.check_arguments(p, args, colocated=not (split or args.pipeline))
    pipeline.check_arguments(p, args)
    if args.max_pending < 1:
        p.error("--max-pending must be >= 1")
    if args.shutdown_grace < 0:
        p.error("--shutdown-grace must be >= 0")
    if not args.body_timeout > 0:
        p.error("--body-timeout must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fleet"]:  # python -m serve fleet SCENARIO.toml: see serve/fleet
        from serve.fleet import main as fleet_main

        return fleet_main(argv[1:])
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    from serve import disagg, disagg_dist

    ranks = args.dist_workers is not None  # under torchrun: rank 0 serves, the other ranks are its workers
    if ranks and disagg_dist.join_group() != 0:
        return disagg_dist.run_worker(args, int(os.environ["RANK"]))
    try:
        import uvicorn
    except ImportError:
        print("error: the server needs the serve extra: pip install -e '.[serve]'", file=sys.stderr)
        return 2

    from serve import pipeline
    from serve.app import create_app
    from serve.engine_thread import EngineThread
    from serve.engines import EngineUnavailable, engine_options, load_engine, pick_engine
    from serve.keys import KeysError, key_table

    try:
        keys = key_table(args)
    except KeysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    split = disagg.wanted(args) or ranks
    if ranks and args.engine == "auto":  # the torchrun ranks' workers: the reference runner only (so far)
        args.engine, why = "reference", "reference engine: the torchrun worker ranks run the reference runner"
    else:
        args.engine, why = pick_engine(args.engine)  # the disaggregated workers' runner too
    if why:
        print(why, file=sys.stderr, flush=True)
    isa_line = None
    if args.engine != "reference":  # the native kernels' instruction set: checked now, named once listening
        from fast import cpu_isa

        try:
            isa_line = f"CPU: {cpu_isa.summary()}"
        except cpu_isa.CpuIsaError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    sock = listening_socket(args.host, args.port)  # a busy port is reported now, not after the model loaded
    if sock is None:
        return 2
    if isa_line:
        print(isa_line, file=sys.stderr, flush=True)
    if args.engine == "reference" and args.blas_threads > 0:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.blas_threads, user_api="blas")
    tenants = keys.tenants if keys else None
    try:
        if split:
            engine = disagg_dist.build(args) if ranks else disagg.build(args, tenants=tenants)
            worker = disagg.DisaggEngineThread(engine, gather_s=args.burst_gather_ms / 1000,
                                               gather_gap_s=args.burst_gather_gap_ms / 1000)
        else:
            engine = load_engine(args.model, args.engine, tenants=tenants, **engine_options(args),
                                 **pipeline.options(args))
            worker = EngineThread(engine, step_floor_s=args.emulate_step_ms / 1000,
                                  gather_s=args.burst_gather_ms / 1000,
                                  gather_gap_s=args.burst_gather_gap_ms / 1000)
    except (EngineUnavailable, ValueError, OSError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        sock.close()
        return 2
    name = args.served_model_name or args.model
    app = create_app(worker, engine.tokenizer, model_name=name, keys=keys, max_pending=args.max_pending,
                     body_timeout_s=args.body_timeout)
    port = sock.getsockname()[1]
    if split:
        kind = (f"disaggregated: {len(engine.coordinator.live('prefill'))} prefill + "
                f"{len(engine.coordinator.live('decode'))} decode workers on the {args.engine} runner, "
                f"{args.kv_wire} KV wire" + (f", on Ray ({args.ray})" if args.ray else ""))
    else:
        kind = f"pipeline {_stages(engine)}" if args.pipeline else f"{args.engine} engine"
    banner = (f"serving {name} ({kind}, context {worker.max_model_len} tokens) on "
              f"http://{args.host}:{port}/v1" + (f" with {len(keys)} API keys" if keys else ""))
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=int(args.shutdown_grace) + 5)
    server = draining_server(config, worker, args.shutdown_grace, banner)
    worker.start()
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
        getattr(getattr(engine, "runner", None), "close", lambda: None)()  # a pipeline's stage processes
    print("stopped", flush=True)
    return 0


def _stages(engine: object) -> str:
    """The stages and their layers, e.g. 'cpu:1 [0, 19) -> cpu:1x2 [19, 30)'."""
    plan = engine.runner.plan  # type: ignore[attr-defined]
    b = plan.bounds
    return " -> ".join(f"{n} [{b[k]}, {b[k + 1]})" for k, n in enumerate(plan.nodes))


def listening_socket(host: str, port: int) -> socket.socket | None:
    """A socket bound to host:port (None, with the reason on stderr, if it cannot be): taken before the
    model loads, so a busy port costs no loading time. uvicorn starts listening on it later."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        print(f"error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return None
    return sock


def draining_server(config: object, worker: object, grace: float, banner: str = "") -> object:
    """uvicorn's Server, whose exit signal (SIGTERM, SIGINT) also tells the engine worker to drain, and
    which prints ``banner`` once its socket listens (so a client that reads it can connect at once)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if banner and not self.should_exit:
                print(banner, flush=True)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            worker.drain(grace)  # type: ignore[attr-defined]
            super().handle_exit(sig, frame)

    return DrainingServer(config)  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
