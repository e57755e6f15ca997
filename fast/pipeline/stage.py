"""One pipeline stage: a range of a checkpoint's layers, their KV cache, and (as a process) its loop.

``StageModel`` holds layers ``first .. last - 1`` as a ``TorchLlama`` of that many layers (the
embedding only on the first stage, final norm and output head only on the last) and a paged KV
cache of those layers, indexed by the same block ids the control plane hands out. Stage 0 lives in
the engine's process (``fast/pipeline/pipeline_runner.py``); every other stage is a process of its own:

    python -m fast.pipeline.stage --rank 1 --world 2 --store-port P --model smollm2 --bounds 0,20,30 ...

A stage process receives a micro-batch from the stage before it, checks it (``fast/pipeline/wire.py``),
runs its layers and sends the residual stream on (the last stage: the wanted logits back to stage
0), then waits for the next. It exits when told STOP, when a peer's link closes (a stage died), when
a message fails a check, or when the engine's process is gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fast.engine.model import TorchLlama
from fast.kv import KVStep
from fast.pipeline import wire
from reference.model.llama import Chunk, LlamaModel, logit_rows
from reference.model.loader import LlamaWeights
from reference.model.stage import NumpyStage

FOREVER = datetime.timedelta(days=365)  # a stage waits for the next step as long as the server is idle


def now() -> float:
    """The host's monotonic clock: the same in every process, so stages' traces line up."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def load_checkpoint(spec: Any) -> tuple[Any, LlamaWeights]:
    """(config, weights) of ``spec``: ``tiny`` / ``tiny:SEED`` (a small random Llama), a packaged name, a path
    or an open ``WeightSource``."""
    if isinstance(spec, str) and (spec == "tiny" or spec.startswith("tiny:")):
        from reference.disagg.models import load_model

        m = load_model(spec)
        return m.config, m.weights
    from reference.model.loader import load_llama

    return load_llama(spec)


LAYER_FIELDS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down", "bq", "bk", "bv", "bo")
MAX_WEIGHT_ELEMENTS = 1 << 34  # a manifest naming more than this is refused


def stage_tensors(config: Any, weights: LlamaWeights, first: int, last: int) -> list[tuple[str, np.ndarray]]:
    """What stage ``first .. last - 1`` holds, by name, in the order stage 0 sends it."""
    out = [(f"layers.{i}.{f}", getattr(weights.layers[i], f)) for i in range(first, last) for f in LAYER_FIELDS
           if getattr(weights.layers[i], f) is not None]
    out.append(("final_norm", weights.final_norm))
    if weights.rope_freq_factors is not None:
        out.append(("rope_freq_factors", weights.rope_freq_factors))
    if last == config.num_layers:
        out.append(("lm_head", weights.lm_head))
    return out


def ship_weights(store: Any, config: Any, weights: LlamaWeights, bounds: Sequence[int], rank: int) -> None:
    """Stage 0 sends stage ``rank`` its config (JSON, in the store) and its tensors (float32, over the group)."""
    named = stage_tensors(config, weights, bounds[rank], bounds[rank + 1])
    manifest = {"config": dataclasses.asdict(config), "tensors": [(n, list(a.shape)) for n, a in named]}
    store.set(f"manifest{rank}", json.dumps(manifest))
    for _, a in named:
        dist.send(torch.from_numpy(np.array(a, dtype=np.float32)), dst=rank)  # a writable copy


def receive_weights(store: Any, first: int, last: int) -> tuple[Any, LlamaWeights]:
    """The other side of ``ship_weights``: every name and shape checked before a buffer is allocated."""
    from reference.model.config import LlamaConfig
    from reference.model.loader import LayerWeights

    manifest = json.loads(store.get(f"manifest{dist.get_rank()}"))
    cfg = dict(manifest["config"])
    cfg["eos_token_ids"] = tuple(cfg.get("eos_token_ids") or ())
    config = LlamaConfig(**cfg)
    if not 0 <= first < last <= config.num_layers:
        raise ValueError(f"stage layers {first}..{last - 1} are not a range of the model's {config.num_layers}")
    wanted = {f"layers.{i}.{f}" for i in range(first, last) for f in LAYER_FIELDS} | \
        {"final_norm", "rope_freq_factors", "lm_head"}
    got: dict[str, np.ndarray] = {}
    for name, shape in manifest["tensors"]:
        n = int(np.prod(shape)) if shape else 1
        if name not in wanted or name in got or not 0 < n <= MAX_WEIGHT_ELEMENTS:
            raise ValueError(f"stage 0 announced an unexpected tensor {name!r} of shape {shape}")
        t = torch.empty([int(d) for d in shape], dtype=torch.float32)
        dist.recv(t, src=0)
        got[name] = t.numpy()
    layers = [LayerWeights(**{f: got.get(f"layers.{i}.{f}") for f in LAYER_FIELDS}) for i in range(first, last)]
    stand_in = np.zeros((1, config.hidden_size), np.float32)
    head = got.get("lm_head", stand_in)
    pad = [None] * first  # StageModel indexes the checkpoint's layers; the ones before ``first`` are not here
    weights = LlamaWeights(embedding=head if config.tie_embeddings else stand_in, layers=pad + layers,
                           final_norm=got["final_norm"], lm_head=head, rope_freq_factors=got.get("rope_freq_factors"))
    return config, weights


class StageModel:
    """Layers ``first .. last - 1`` of a checkpoint and their KV cache; ``compute`` runs one micro-batch."""

    def __init__(self, config: Any, weights: LlamaWeights, first: int, last: int, *, dtype: str = "bfloat16",
                 num_blocks: int, block_size: int = 16, kv_dtype: str | None = None, slowdown: float = 1.0,
                 device: str = "cpu", impl: str = "torch", compressed: Sequence[str] = ()):
        L = config.num_layers
        if not 0 <= first < last <= L:
            raise ValueError(f"stage layers {first}..{last - 1} are not a range of the model's {L} layers")
        self.first, self.last, self.slowdown = first, last, slowdown
        self.is_first, self.is_last = first == 0, last == L
        self.full_config = config
        self.num_blocks, self.block_size = num_blocks, block_size
        # a stage holds only what it uses: a 1-row stand-in replaces the embedding / head it never reads
        stand_in = np.zeros((1, config.hidden_size), np.float32)
        tied = weights.lm_head is weights.embedding
        embedding = weights.embedding if self.is_first or (self.is_last and tied) else stand_in
        head = weights.lm_head if self.is_last else stand_in
        if self.is_last and tied:
            head = embedding
        self.numpy: NumpyStage | None = None
        self.busy_s = 0.0  # compute (and declared slowdown) seconds, summed over micro-batches
        if impl == "numpy":  # the reference's NumPy stage (float32), for teaching
            if compressed:
                raise ValueError("NumPy stages serve plain float32 weights: compressed matrices need impl='torch'")
            if dtype != "float32":
                raise ValueError("NumPy stages compute in float32: use dtype='float32' with impl='numpy'")
            own = list(weights.layers[first:last])  # NumpyStage slices the checkpoint's layers itself: pad the rest
            full = LlamaWeights(embedding=embedding, layers=[own[0]] * first + own + [own[0]] * (L - last),
                                final_norm=weights.final_norm, lm_head=head,
                                rope_freq_factors=weights.rope_freq_factors)
            self.numpy = NumpyStage(LlamaModel(config, full), first, last, num_blocks=num_blocks,
                                    block_size=block_size, kv_dtype=kv_dtype or "float32")
            return
        if impl != "torch":
            raise ValueError(f"stage implementation must be 'torch' or 'numpy', not {impl!r}")
        part = LlamaWeights(embedding=embedding, layers=list(weights.layers[first:last]),
                            final_norm=weights.final_norm, lm_head=head, rope_freq_factors=weights.rope_freq_factors)
        # compressed: this stage's projection matrices in the palette form (lossless: the same products)
        self.model = TorchLlama(dataclasses.replace(config, num_layers=last - first), part, dtype=dtype,
                                device=device, compressed=tuple(compressed))
        self.cache = self.model.new_cache(num_blocks, block_size, kv_dtype)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        if self.numpy is not None:
            self.numpy.copy_blocks(copies)
            return
        for src, dst in copies:
            self.cache.copy_block(src, dst)

    def compute(self, chunks: Sequence[Chunk], x: torch.Tensor | None) -> tuple[torch.Tensor, float, float]:
        """Run this stage's layers over one micro-batch: returns (residual stream, or the last stage's logits
        of the chunks that want them; start; end). The first stage embeds the chunks' tokens (``x`` None)."""
        started = now()
        if self.numpy is not None:
            out = self.numpy.compute(chunks, None if x is None else x.numpy())
            return self._done(torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)), started)
        sizes = np.fromiter((len(ch.tokens) for ch in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter((ch.start for ch in chunks), dtype=np.int64, count=len(chunks))
        first_row = np.cumsum(sizes) - sizes
        positions = torch.from_numpy(np.arange(int(sizes.sum())) + np.repeat(starts - first_row, sizes))
        step = KVStep.build(query_lens=sizes.tolist(), starts=starts.tolist(),
                            block_tables=[ch.block_table for ch in chunks], block_size=self.block_size,
                            num_blocks=self.num_blocks, device=self.model.device)
        if self.is_first:
            tokens = np.fromiter((t for ch in chunks for t in ch.tokens), dtype=np.int64, count=int(sizes.sum()))
            x = self.model.embed(torch.from_numpy(tokens))
        x = self.model.run_layers(x, positions, step, self.cache)
        if self.is_last:
            x = self.model.logits(x, torch.from_numpy(logit_rows(chunks)[0]))
        return self._done(x, started)

    def _done(self, x: torch.Tensor, started: float) -> tuple[torch.Tensor, float, float]:
        took = now() - started
        if self.slowdown > 1.0:  # an emulated slower node: as long again as (slowdown - 1) x the real compute
            time.sleep((self.slowdown - 1.0) * took)
        ended = now()
        self.busy_s += ended - started
        return x, started, ended


def limits_of(stage: StageModel) -> wire.Limits:
    c = stage.full_config
    return wire.Limits(num_blocks=stage.num_blocks, block_size=stage.block_size, max_position=c.max_position,
                       hidden=c.hidden_size, vocab=c.vocab_size)


def serve_stage(stage: StageModel, rank: int, world: int) -> None:
    """The loop of a stage process (rank >= 1): receive, check, compute, send on; until STOP."""
    prev, nxt = rank - 1, (rank + 1) % world
    limits, hidden = limits_of(stage), stage.full_config.hidden_size
    pending: list[dist.Work] = []
    while True:
        h = wire.recv((wire.HEADER_LEN,), torch.int64, prev)
        fields = wire.check_header(h, limits, (wire.FORWARD, wire.STOP))
        for w in pending:
            w.wait()
        if fields[0] == wire.STOP:
            dist.send(wire.header(wire.STOP), dst=nxt)
            return
        kind, step, mb, n_chunks, n_tokens, n_copies, n_rows, meta_len = fields
        meta = wire.recv((meta_len,), torch.int64, prev)
        chunks, copies = wire.decode_forward(fields, meta, limits)
        x = wire.recv((n_tokens, hidden), torch.float32, prev)
        trace = wire.recv((2 * rank,), torch.float64, prev)
        stage.copy_blocks(copies)
        out, started, ended = stage.compute(chunks, x)
        trace = torch.cat([trace, torch.tensor([started, ended], dtype=torch.float64)])
        if stage.is_last:
            pending = wire.send_all([wire.header(wire.LOGITS, step, mb, n_chunks, n_tokens, 0, n_rows), out, trace],
                                    0)
        else:
            pending = wire.send_all([h, meta, out, trace], nxt)


def _watch_parent(parent: int) -> None:
    """Exit when the engine's process is gone (our parent changes), whatever the links say."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fast.pipeline.stage", description="one pipeline stage (rank >= 1)")
    p.add_argument("--rank", type=int, required=True, help="this stage's rank (1 .. world - 1)")
    p.add_argument("--world", type=int, required=True, help="number of stages")
    p.add_argument("--store-port", type=int, required=True, help="stage 0's TCPStore port on 127.0.0.1")
    p.add_argument("--model", help="load the checkpoint here (default: stage 0 sends this stage its weights)")
    p.add_argument("--bounds", required=True, help="layer boundaries of every stage, e.g. 0,20,30")
    p.add_argument("--dtype", default="bfloat16", help="weights dtype (default bfloat16)")
    p.add_argument("--kv-dtype", help="KV cache dtype (default: --dtype)")
    p.add_argument("--num-blocks", type=int, required=True, help="KV cache blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--slowdown", type=float, default=1.0, help="run this many times slower (a slow node)")
    p.add_argument("--parent", type=int, default=os.getppid(), help="exit when this process is gone")
    p.add_argument("--impl", default="torch", choices=["torch", "numpy"], help="the stage's forward pass")
    p.add_argument("--compressed", default="", help="projection matrices served compressed: qkv,o,gate_up,down")
    args = p.parse_args(argv)
    threading.Thread(target=_watch_parent, args=(args.parent,), daemon=True).start()
    torch.set_num_threads(args.threads)
    bounds = [int(b) for b in args.bounds.split(",")]
    store = dist.TCPStore("127.0.0.1", args.store_port, args.world, is_master=False,
                          timeout=datetime.timedelta(seconds=300))
    store.set(f"joined{args.rank}", str(os.getpid()))
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world, timeout=FOREVER)
    first, last = bounds[args.rank], bounds[args.rank + 1]
    try:
        if args.model:
            config, weights = load_checkpoint(args.model)
        else:  # stage 0 sends this stage its weights
            config, weights = receive_weights(store, first, last)
        stage = StageModel(config, weights, first, last, dtype=args.dtype, num_blocks=args.num_blocks,
                           block_size=args.block_size, kv_dtype=args.kv_dtype, slowdown=args.slowdown,
                           impl=args.impl, compressed=[n for n in args.compressed.split(",") if n])
        del weights
    except Exception as e:  # tell stage 0 why, instead of leaving it to wait
        store.set(f"failed{args.rank}", f"{type(e).__name__}: {e}")
        raise
    store.set(f"ready{args.rank}", str(os.getpid()))
    try:
        serve_stage(stage, args.rank, args.world)
    except (RuntimeError, wire.WireError) as e:  # a link closed (a stage died) or a peer sent garbage
        print(f"pipeline stage {args.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # closing our links tells the neighbours at once
    sys.stdout.flush()
    os._exit(0)  # nothing left to tear down (interpreter teardown with torch loaded takes seconds)


if __name__ == "__main__":
    sys.exit(main())
