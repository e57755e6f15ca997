"""``PipelineRunner``: the runner interface of ``reference/engine/model_runner.py`` over a chain of stage processes.

The engine (the one control plane: scheduler, block manager, prefix cache) runs in this process and
calls ``copy_blocks`` and ``forward`` as it would on ``TorchRunner``. Stage 0 (the first layers and the
embedding) runs here too; stages 1 .. K-1 are processes started by the runner
(``python -m fast.pipeline.stage``), joined in one torch.distributed group (gloo, 127.0.0.1, a free
port). The block tables travel with every micro-batch, so each stage writes its own layers' KV into
the same blocks.

How a step is cut: ``forward`` splits the step's tokens into ``micro_batches`` pieces of equal token
count (a long prompt chunk is cut into consecutive parts; each part attends to the KV the parts before
it wrote, since every stage takes the pieces in order). Stage 0 computes piece 0 and sends it on, then
piece 1 while stage 1 computes piece 0, and so on; the step returns when the last stage has sent the
logits of every piece. The scheduler's step is unchanged (same chunks, same token budget, same
decisions): the pipeline only overlaps the stages inside it, so a step costs about
sum(stage times of one piece) + (M - 1) x the slowest stage's, and the bubble is the idle rest.

Faults: a stage process that dies closes its links, which fails the receives waiting on it; a stage
that hangs runs past ``step_timeout_s``. Either way ``forward`` raises ``PipelineError`` naming the
stage, every stage process is stopped, and every later call raises the same error at once. The
server's engine (``restart.py``) then starts new stages and recomputes the requests in flight; after
its restarts (or with none) the server ends every request in flight with the error.

Conformance: *bounded*, as the torch runner: the same kernels over the same rows; greedy tokens equal
the single-process engine's (``conformance/cases/pipeline_cases.py``).
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fast.pipeline import stage as stage_mod
from fast.pipeline import wire
from fast.pipeline.chain import Node, PipelineError, Plan, micro_batch_shape, parse_chain, plan
from fast.pipeline.stage import FOREVER, StageModel, limits_of, load_checkpoint, now
from reference.model.llama import Chunk, logit_rows
from reference.model.weights import open_weights

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class StepTrace:
    """One step as the stages lived it (host monotonic seconds)."""

    begin: float
    end: float
    tokens: int
    sampled: int
    stage_busy: list[list[tuple[float, float]]]  # [stage][piece]: (start, end) of its compute


@dataclass
class PipelineStats:
    steps: list[StepTrace] = field(default_factory=list)
    bytes_between_stages: int = 0  # header, meta, residual stream and trace of every hop k -> k+1
    bytes_back: int = 0  # logits (and trace) from the last stage to stage 0
    tokens: int = 0


def cut(chunks: Sequence[Chunk], pieces: int) -> list[list[tuple[int, Chunk]]]:
    """The step's chunks as ``pieces`` lists of (chunk index, part) of equal token count (a part of a
    chunk wants logits only if it ends the chunk and the chunk wants them)."""
    total = sum(len(ch.tokens) for ch in chunks)
    m = max(1, min(pieces, total))
    edges = [round(total * i / m) for i in range(m + 1)]
    out: list[list[tuple[int, Chunk]]] = [[] for _ in range(m)]
    at = 0  # tokens before the current chunk
    for j, ch in enumerate(chunks):
        n = len(ch.tokens)
        for p in range(m):
            a, b = max(edges[p], at) - at, min(edges[p + 1], at + n) - at
            if a < b:
                out[p].append((j, Chunk(list(ch.tokens[a:b]), ch.start + a, ch.block_table,
                                        wants_logits=ch.wants_logits and b == n, all_logits=ch.all_logits)))
        at += n
    return out


class PipelineRunner:
    """Stage 0 here, stages 1.. as processes; ``forward`` runs a step through all of them."""

    _active: PipelineRunner | None = None  # torch.distributed has one default group per process
    all_logits = True  # honours Chunk.all_logits (prompt logprobs): the last stage sends every row asked for

    def __init__(self, model_spec: str, config: Any, weights: Any, the_plan: Plan, *, num_blocks: int,
                 block_size: int = 16, kv_dtype: str | None = None, dtype: str = "bfloat16", micro_batches: int = 2,
                 step_timeout_s: float = 120.0, start_timeout_s: float = 300.0, ship_weights: bool = True,
                 impl: str = "torch", compressed: Sequence[str] = ()):
        if PipelineRunner._active is not None:
            raise PipelineError("a pipeline is already running in this process; close() it first")
        if micro_batches < 1:
            raise PipelineError("micro_batches must be >= 1")
        self.config, self.plan, self.micro_batches = config, the_plan, micro_batches
        self.step_timeout_s = step_timeout_s
        self.world = len(the_plan.nodes)
        self.broken: str | None = None
        self.stats = PipelineStats()
        self._copies: list[tuple[int, int]] = []
        self._step = 0
        self._results: queue.Queue = queue.Queue()
        self._closed = False
        bounds, nodes = the_plan.bounds, the_plan.nodes
        self._threads_before = torch.get_num_threads()  # restored by close()
        torch.set_num_threads(nodes[0].threads)
        self.stage = StageModel(config, weights, 0, bounds[1], dtype=dtype, num_blocks=num_blocks,
                                block_size=block_size, kv_dtype=kv_dtype, slowdown=nodes[0].slowdown, impl=impl,
                                compressed=compressed)
        self.limits = limits_of(self.stage)
        self._logs = tempfile.TemporaryDirectory(prefix="unfire-pipeline-")
        self._store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=start_timeout_s))
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1")
        for rank in range(1, self.world):
            cmd = [sys.executable, "-m", "fast.pipeline.stage", "--rank", str(rank), "--world", str(self.world),
                   "--store-port", str(self._store.port),
                   "--bounds", ",".join(map(str, bounds)), "--dtype", dtype, "--num-blocks", str(num_blocks),
                   "--block-size", str(block_size), "--threads", str(nodes[rank].threads),
                   "--slowdown", str(nodes[rank].slowdown), "--parent", str(os.getpid()), "--impl", impl]
            if kv_dtype:
                cmd += ["--kv-dtype", kv_dtype]
            if compressed:
                cmd += ["--compressed", ",".join(compressed)]
            if not ship_weights:
                cmd += ["--model", str(model_spec)]
            log = open(Path(self._logs.name) / f"stage{rank}.log", "wb")  # noqa: SIM115 (the child owns it)
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
            log.close()
        PipelineRunner._active = self
        atexit.register(self.close)
        try:
            deadline = time.monotonic() + start_timeout_s
            self._wait_for("joined", deadline)
            dist.init_process_group("gloo", store=self._store, rank=0, world_size=self.world, timeout=FOREVER)
            if ship_weights:
                for rank in range(1, self.world):
                    stage_mod.ship_weights(self._store, config, weights, bounds, rank)
            self._wait_for("ready", deadline)
        except BaseException as e:
            time.sleep(0.2)  # let a stage that died be reaped, to name it
            dead = self._dead()
            self._kill()
            if dist.is_initialized():
                dist.destroy_process_group()
            PipelineRunner._active = None
            torch.set_num_threads(self._threads_before)
            if isinstance(e, RuntimeError) and not isinstance(e, PipelineError):
                raise PipelineError(f"starting the stages failed: {dead or e}") from None
            raise
        self._receiver = threading.Thread(target=self._receive, name="pipeline-recv", daemon=True)
        self._receiver.start()

    # -- the runner interface ------------------------------------------------------------------
    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        self._copies = list(copies)  # applied by every stage before the step's first piece

    def forward(self, chunks: Sequence[Chunk]) -> list[np.ndarray | None]:
        if self.broken:
            raise PipelineError(self.broken)
        self._step += 1
        pieces = cut(chunks, self.micro_batches)
        begin = now()
        works: list[dist.Work] = []
        busy0: list[tuple[float, float]] = []
        try:
            for m, piece in enumerate(pieces):
                copies, self._copies = (self._copies, []) if m == 0 else ([], [])
                parts = [ch for _, ch in piece]
                h, meta = wire.encode_forward(self._step, m, parts, copies)
                self.stage.copy_blocks(copies)
                x, started, ended = self.stage.compute(parts, None)
                busy0.append((started, ended))
                trace = torch.tensor([started, ended], dtype=torch.float64)
                works += wire.send_all([h, meta, x, trace], 1)
                self._count_bytes(meta.numel(), x.shape[0])
            got = self._collect(len(pieces))
            for w in works:
                w.wait()
        except PipelineError:
            raise
        except RuntimeError as e:  # a send to a dead stage
            raise self._fail(f"sending to stage 1 failed: {e}") from None
        out: list[np.ndarray | None] = [None] * len(chunks)
        every: dict[int, list[np.ndarray]] = {}  # chunks with all_logits: their parts' rows, piece by piece
        for m, piece in enumerate(pieces):
            logits, trace = got[m]
            for i, a, b in logit_rows([ch for _, ch in piece])[1]:
                j = piece[i][0]
                if chunks[j].all_logits:
                    every.setdefault(j, []).append(logits[a:b])
                else:
                    out[j] = logits[a]
        for j, parts in every.items():
            out[j] = np.concatenate(parts)
        stage_busy = [busy0] + [[(float(got[m][1][2 * k]), float(got[m][1][2 * k + 1])) for m in range(len(pieces))]
                                for k in range(1, self.world)]
        sampled = sum(1 for ch in chunks if ch.wants_logits)
        tokens = sum(len(ch.tokens) for ch in chunks)
        self.stats.steps.append(StepTrace(begin, now(), tokens, sampled, stage_busy))
        self.stats.tokens += tokens
        self.stats.bytes_back += len(logit_rows(chunks)[0]) * self.config.vocab_size * 4 + \
            len(pieces) * (wire.HEADER_LEN + 2 * self.world) * 8
        return out

    # -- inside --------------------------------------------------------------------------------
    def _count_bytes(self, meta_len: int, tokens: int) -> None:
        hops = self.world - 1
        per_hop = (wire.HEADER_LEN + meta_len) * 8 + tokens * self.config.hidden_size * 4
        self.stats.bytes_between_stages += hops * per_hop + sum(2 * (k + 1) * 8 for k in range(hops))

    def _collect(self, n: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        got: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        deadline = time.monotonic() + self.step_timeout_s
        while len(got) < n:
            try:
                item = self._results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = self._dead()
                if dead:
                    raise self._fail(dead) from None
                if time.monotonic() >= deadline:
                    raise self._fail(f"no answer from the stages within {self.step_timeout_s:g} s "
                                     f"(step {self._step}): a stage hangs") from None
                continue
            if isinstance(item, BaseException):
                time.sleep(0.2)  # let a dying stage be reaped, to name it
                raise self._fail(self._dead() or f"the last stage's link failed: {item}") from None
            fields, logits, trace = item
            step, mb = fields[1], fields[2]
            if step != self._step or mb in got or mb >= n:
                raise self._fail(f"the last stage answered step {step} piece {mb} during step {self._step}")
            got[mb] = (logits, trace)
        return got

    def _receive(self) -> None:
        last = self.world - 1
        try:
            while True:
                h = wire.recv((wire.HEADER_LEN,), torch.int64, last)
                fields = wire.check_header(h, self.limits, (wire.LOGITS, wire.STOP))
                if fields[0] == wire.STOP:
                    self._results.put(wire.STOP)
                    return
                rows = fields[6]
                logits = wire.recv((rows, self.config.vocab_size), torch.float32, last) if rows else \
                    torch.empty((0, self.config.vocab_size))
                trace = wire.recv((2 * self.world,), torch.float64, last)
                self._results.put((fields, logits.numpy(), trace.numpy()))
        except Exception as e:  # a link closed, or the last stage sent something that fails the checks
            self._results.put(e)

    def _dead(self) -> str:
        """Which stage processes have exited, with the end of their log, or ''."""
        gone = []
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                log = (Path(self._logs.name) / f"stage{rank}.log").read_text(errors="replace").strip()
                tail = log.splitlines()[-1] if log else ""
                gone.append(f"stage {rank} (pid {p.pid}) exited with code {p.returncode}"
                            + (f" ({tail[:300]})" if tail else ""))
        return "; ".join(gone)

    def _fail(self, reason: str) -> PipelineError:
        self.broken = f"pipeline failed during step {self._step}: {reason}"
        self._kill()
        return PipelineError(self.broken)

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def _wait_for(self, key: str, deadline: float) -> None:
        """Until every stage has set ``key{rank}`` in the store; a stage that failed or exited ends the wait."""
        waiting = set(range(1, self.world))
        while waiting:
            for rank in sorted(waiting):
                if self._store.check([f"failed{rank}"]):
                    raise PipelineError(f"stage {rank} could not start: {self._store.get(f'failed{rank}').decode()}")
                if self._store.check([f"{key}{rank}"]):
                    waiting.discard(rank)
            dead = self._dead()
            if dead:
                raise PipelineError(f"a stage could not start: {dead}")
            if time.monotonic() > deadline:
                raise PipelineError(f"stages {sorted(waiting)} did not start in time (waiting for {key!r})")
            time.sleep(0.05)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every stage (STOP through the chain; killed if they do not exit) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if not self.broken and self.procs and all(p.poll() is None for p in self.procs):
            try:
                dist.send(wire.header(wire.STOP), dst=1)
                self._receiver.join(timeout)
                dist.destroy_process_group()
                for p in self.procs:
                    p.wait(timeout=timeout)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        self._kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        PipelineRunner._active = None
        torch.set_num_threads(self._threads_before)
        self._logs.cleanup()


def calibrate(config: Any, weights: Any, shape: Any, dtype: str, repeats: int = 7) -> tuple[float, float]:
    """Seconds of one layer and of the output head on one thread at a decode ``shape`` (the fastest of ``repeats``:
    other load on the machine only ever adds time), timed on the model's last layer and head, scratch KV cache."""
    from fast.kv import KVStep
    from fast.pipeline.stage import StageModel

    b, ctx, bs = len(shape.new_tokens), max(shape.context_lens), 16
    per = -(-ctx // bs)
    probe = StageModel(config, weights, config.num_layers - 1, config.num_layers, dtype=dtype, num_blocks=b * per,
                       block_size=bs)
    step = KVStep.build(query_lens=[1] * b, starts=[ctx - 1] * b,
                        block_tables=[list(range(i * per, (i + 1) * per)) for i in range(b)], block_size=bs,
                        num_blocks=b * per)
    x = torch.randn(b, config.hidden_size)
    positions, rows = torch.full((b,), ctx - 1, dtype=torch.int64), torch.arange(b)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    layer, head = [], []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            probe.model.run_layers(x, positions, step, probe.cache)
            t1 = time.perf_counter()
            probe.model.logits(x, rows)
            layer.append(t1 - t0)
            head.append(time.perf_counter() - t1)
    finally:
        torch.set_num_threads(before)
    return min(layer), min(head)


class PipelineModel:
    """What ``Engine`` is given: the checkpoint, the chain and its split; ``make_runner`` starts the stages.

    ``calibrate``: time a layer and the head here first and split by those times (else the nominal roofline).
    ``impl="numpy"``: every stage is the reference's NumPy stage (``reference/model/stage.py``, float32)."""

    def __init__(self, model: str, stages: str | Sequence[Node], *, dtype: str = "bfloat16", micro_batches: int = 2,
                 split: str = "optimal", max_num_seqs: int = 32, step_timeout_s: float = 120.0,
                 calibrate: bool = True, impl: str = "torch", compressed: Sequence[str] = ()):
        self.spec, self.dtype, self.micro_batches = str(model), dtype, micro_batches
        self.compressed = tuple(compressed)  # each stage serves its own layers' matrices so
        self.step_timeout_s, self.impl = step_timeout_s, impl
        if impl not in ("torch", "numpy") or impl == "numpy" and dtype != "float32":
            raise PipelineError(f"impl {impl!r} with dtype {dtype!r}: use impl 'torch', or 'numpy' with float32")
        nodes = parse_chain(stages) if isinstance(stages, str) else list(stages)  # a bad chain fails before loading
        # opened once: the weights here, the tokenizer from the same source (load_engine)
        tiny = self.spec == "tiny" or self.spec.startswith("tiny:")
        self.source = None if tiny else open_weights(self.spec)
        self.config, self.weights = load_checkpoint(self.source or self.spec)
        if len(nodes) < 2:
            raise PipelineError(f"a pipeline needs at least 2 stages, got {len(nodes)}")
        if len(nodes) > self.config.num_layers:
            raise PipelineError(f"a model of {self.config.num_layers} layers cannot fill {len(nodes)} stages")
        self.calibration = calibrate_(self.config, self.weights, micro_batch_shape(max_num_seqs, micro_batches),
                                      dtype) if calibrate and impl == "torch" else None
        self.plan = plan(self.config, nodes, max_num_seqs=max_num_seqs, micro_batches=micro_batches, dtype=dtype,
                         split=split, calibration=self.calibration)

    def make_runner(self, num_blocks: int, block_size: int = 16, kv_dtype: str | None = None) -> PipelineRunner:
        return PipelineRunner(self.spec, self.config, self.weights, self.plan, num_blocks=num_blocks,
                              block_size=block_size, kv_dtype=kv_dtype, dtype=self.dtype,
                              micro_batches=self.micro_batches, step_timeout_s=self.step_timeout_s, impl=self.impl,
                              compressed=self.compressed)


calibrate_ = calibrate  # the name PipelineModel's keyword hides


def load_engine(model: str = "smollm2", stages: str | Sequence[Node] = "2", *, dtype: str = "bfloat16",
                micro_batches: int = 2, split: str = "optimal", step_timeout_s: float = 120.0, tokenizer: bool = True,
                calibrate: bool = True, impl: str = "torch", compressed: Sequence[str] = (), restarts: int = 0,
                **engine_kwargs: Any) -> Any:
    """The reference engine (the one control plane) over a pipeline of stage processes; ``engine.runner.close()``
    stops them (also done at exit). ``compressed``: the projection matrices every stage serves in the palette
    form (``fast.engine.Engine.load``'s option; lossless, so the tokens are plain's). ``restarts`` > 0: a
    ``RestartingEngine`` (``restart.py``), which restarts failed stages and recomputes the requests in
    flight, up to ``restarts`` times in a row."""
    from reference.engine.engine import Engine

    pm = PipelineModel(model, stages, dtype=dtype, micro_batches=micro_batches, split=split,
                       max_num_seqs=engine_kwargs.get("max_num_seqs", 32), step_timeout_s=step_timeout_s,
                       calibrate=calibrate, impl=impl, compressed=compressed)
    tok = None
    if tokenizer and pm.source is not None:
        from reference.model.tokenizer import load_tokenizer

        tok = load_tokenizer(pm.source)
    engine_kwargs.setdefault("kv_dtype", dtype)
    if restarts > 0:
        from fast.pipeline.restart import RestartingEngine

        return RestartingEngine(lambda: Engine(pm, tok, **engine_kwargs), max_restarts=restarts)
    return Engine(pm, tok, **engine_kwargs)
