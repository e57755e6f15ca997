"""The prefill worker: runs prompts (chunked, continuous batching) and streams their KV layer by
layer.

It is the engine loop (``reference/engine/engine.py``) with two changes: every request asks for one
token only (the first output token, sampled here with the REQUEST's parameters: greedy, or from the
request's (seed, position) stream as the engine samples), and the model's ``on_layer`` hook sends
each sequence's new K/V of layer i as soon as layer i is in the cache, while layer i + 1 computes.

Per request (a *stream*), ``PROTOCOL.md`` section 5:
  REQUEST arrives -> send MANIFEST at once (the handshake overlaps the wait in the queue);
  ACK(manifest) says how many leading tokens the decode side already has: those are not sent;
  KV frames go out as layers finish (buffered until the ACK if it is late);
  after the last chunk: DONE with the first token and a digest of the whole prompt's KV;
  ACK(done) closes the stream. No ACK within ``handshake_timeout``: resend, ``retries`` times, then
  ABORT(recompute) so the decode worker computes the prompt itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reference.disagg import messages
from reference.disagg.frames import Frame, Kind
from reference.disagg.nixl_carrier import DESCRIPTOR_FLAG, NixlSource
from reference.disagg.transport import Link
from reference.disagg.wire import KV_HEADER, KVLayout, encode_kv, kv_digest
from reference.disagg.worker_base import WorkerBase, logprob_fields, prompt_logprob_fields
from reference.engine.params import SamplingParams
from reference.kv.block_manager import BlockManager
from reference.kv.prefix_hash import prefix_keys
from reference.model.llama import LlamaModel
from reference.sched import RequestError, Scheduler, SchedulerConfig, SchedulerError
from reference.sched import Sequence as SchedSequence
from reference.sched.batch import Batch


@dataclass
class PrefillStream:
    stream: int
    request_id: str
    seq: SchedSequence
    state: str = "handshake"  # -> "streaming" (manifest acked) -> "done_sent" -> closed (removed)
    skip: int = 0  # leading tokens the decode side already holds
    sent_upto: list[int] = field(default_factory=list)  # per layer: positions emitted or buffered
    # before the ACK
    pending: list[tuple[int, int, np.ndarray, np.ndarray]] = field(default_factory=list)
    done: dict | None = None  # DONE body once the first token is sampled
    kv_frames: int = 0
    last_send: float = 0.0
    tries: int = 0
    # how its first token is picked (greedy unless told); the prompt's last ``generated`` tokens are
    # the request's output (a migrated request), a grammar's matcher once it picks
    params: SamplingParams = SamplingParams(seed=0)
    generated: int = 0
    constraint: Any = None
    prompt_lps: dict = field(default_factory=dict)  # position -> Logprob (prompt_logprobs asked)
    # NIXL carrier: (offset, length) of its payloads staged in the arena, freed when it ends
    regions: list[tuple[int, int]] = field(default_factory=list)


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, model: LlamaModel, link: Link, *, model_digest: str, num_blocks: int = 512,
                 block_size: int = 16, wire: str = "fp32", max_num_batched_tokens: int = 256,
                 max_num_seqs: int = 32, handshake_timeout: float = 1.0, retries: int = 8,
                 clock: Callable[[], float] = time.monotonic,
                 nixl: NixlSource | None = None) -> None:
        self.nixl = nixl  # None: KV values go inline in the KV frames (the TCP carrier)
        self.model, self.link, self.digest, self.clock = model, link, model_digest, clock
        self.layout = KVLayout(model.config.num_layers, model.config.num_kv_heads,
                               model.config.head_dim, block_size, wire)
        self.runner = model.make_runner(num_blocks, block_size)  # the engines' data plane
        self.cache = self.runner.cache  # read layer by layer for the wire
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            SchedulerConfig(max_num_batched_tokens, max_num_seqs, model.config.max_position),
            self.fair_queuing(),
        )
        self.streams: dict[int, PrefillStream] = {}
        self.handshake_timeout, self.retries = handshake_timeout, retries
        self.counters = link.counters
        self.layer_times: list[tuple[int, float]] = []  # (layer, clock) of each on_layer call (E6)

    # -- frames in ------------------------------------------------------------------------
    def on_frame(self, frame: Frame) -> None:
        st = self.streams.get(frame.stream)
        if frame.kind is Kind.REQUEST:
            self._start(frame)
        elif st is None:
            self.link.count("frames_for_unknown_stream")
        elif frame.kind is Kind.ACK:
            body = messages.load(Kind.ACK, frame.payload)
            if body["of"] == "manifest" and st.state == "handshake":
                if body["cached_tokens"] >= st.seq.num_prompt_tokens:
                    return self._give_up(st, "decode side claims more cached tokens than the "
                                             "prompt has")
                st.skip, st.state = body["cached_tokens"], "streaming"
                for layer, start, k, v in st.pending:
                    self._send_kv(st, layer, start, k, v)
                st.pending = []
                if st.done is not None:
                    self._send_done(st)
            elif body["of"] == "done" and st.state == "done_sent":
                self._close(st)
        elif frame.kind is Kind.ABORT:
            self.link.count("streams_aborted_by_peer")
            self._drop(st)

    def _start(self, frame: Frame) -> None:
        body = messages.load(Kind.REQUEST, frame.payload)
        if frame.stream in self.streams:
            return
        try:
            params = self.sampling_of(body)
            self.check_grammar(params)
            seq = SchedSequence(prompt_token_ids=body["prompt"], max_tokens=1, request=None,
                                **self.tenant_of(body))
            self.scheduler.add(seq, self.clock())
        except (RequestError, SchedulerError) as e:
            self.link.send(Kind.ABORT, frame.stream, messages.dump(Kind.ABORT, {
                "reason": f"prefill worker refused the request: {e}", "action": "recompute"}))
            return
        st = PrefillStream(frame.stream, body["id"], seq, sent_upto=[0] * self.layout.num_layers,
                           params=params,
                           generated=min(body.get("generated", 0), seq.num_prompt_tokens))
        seq.request = st
        self.streams[st.stream] = st
        self._send_manifest(st)

    # -- frames out -----------------------------------------------------------------------
    def _send_manifest(self, st: PrefillStream) -> None:
        keys = [k.hex() for k in prefix_keys(st.seq.prompt_token_ids, self.layout.block_size,
                                             st.seq.cache_salt)]
        body = {"id": st.request_id, "prompt_len": st.seq.num_prompt_tokens, "prefix_keys": keys,
                "model_digest": self.digest, "layout": self.layout.as_message()}
        if self.nixl is not None:
            body["kv_source"] = self.nixl.descriptor()
        self.link.send(Kind.MANIFEST, st.stream, messages.dump(Kind.MANIFEST, body))
        st.last_send, st.tries = self.clock(), st.tries + 1

    def _send_kv(self, st: PrefillStream, layer: int, start: int, k: np.ndarray,
                 v: np.ndarray) -> None:
        if start + len(k) <= st.skip:
            return
        if start < st.skip:
            k, v, start = k[st.skip - start:], v[st.skip - start:], st.skip
        payload = encode_kv(self.layout, layer, start, k, v)
        staged = self.nixl.stage(payload) if self.nixl is not None else None
        if staged is None:  # the TCP carrier, or the NIXL arena is full: the values go inline
            self.link.send(Kind.KV, st.stream, payload)
        else:  # a descriptor: the decode worker reads the bytes from the arena (nixl_carrier.py)
            off, descriptor = staged
            st.regions.append((off, len(payload)))
            header = KV_HEADER.pack(*KV_HEADER.unpack_from(payload)[:2], DESCRIPTOR_FLAG,
                                    start, len(k))
            self.link.send(Kind.KV, st.stream, header + descriptor)
            self.link.count("kv_bytes_staged_nixl", len(payload))
        st.kv_frames += 1

    def _send_done(self, st: PrefillStream) -> None:
        assert st.done is not None
        self.link.send(
            Kind.DONE, st.stream, messages.dump(Kind.DONE, {**st.done, "kv_frames": st.kv_frames})
        )
        if st.state != "done_sent":
            st.tries = 0
        st.state, st.last_send, st.tries = "done_sent", self.clock(), st.tries + 1

    def _give_up(self, st: PrefillStream, reason: str) -> None:
        self.link.send(
            Kind.ABORT,
            st.stream,
            messages.dump(Kind.ABORT, {"reason": reason, "action": "recompute"}),
        )
        self.link.count("handoffs_given_up")
        self._drop(st)

    def _drop(self, st: PrefillStream) -> None:
        self.scheduler.abort(st.seq.seq_id, self.clock())  # None when it already finished
        self._close(st)

    def _close(self, st: PrefillStream) -> None:
        """The stream is over here: forget it and free what it staged for NIXL reads."""
        self.streams.pop(st.stream, None)
        if self.nixl is not None:
            self.nixl.release(st.regions)

    # -- the loop -------------------------------------------------------------------------
    def tick(self) -> bool:
        """Retry or give up late handshakes, then run one step if there is work. True if it
        computed."""
        now = self.clock()
        for st in list(self.streams.values()):
            if (
                st.state in ("handshake", "done_sent")
                and now - st.last_send > self.handshake_timeout
            ):
                if st.tries > self.retries:
                    if st.state == "handshake":
                        self._give_up(st, f"no ACK of the manifest within {self.handshake_timeout} "
                                          "s, "
                                          f"{self.retries} retries")
                    else:
                        self.link.count("done_unacked")
                        self._close(st)
                elif st.state == "handshake":
                    self._send_manifest(st)
                else:
                    self._send_done(st)
        return self.step()

    def step(self) -> bool:
        ran = self.run_step(on_layer=lambda batch: lambda i: self._emit(i, batch))
        if ran is None:
            return False
        batch, logits = ran
        tokens: list[int | None] = []
        for e, lg in zip(batch.entries, logits, strict=True):
            token, lp = self.pick(e.seq.request, e.seq, lg) if e.needs_sample else (None, None)
            tokens.append(token)
            if token is not None:
                e.seq.request.done = {"first_token": token, "kv_digest": kv_digest(
                    self.cache, e.block_table, e.seq.num_prompt_tokens), **logprob_fields(lp),
                    **prompt_logprob_fields(e.seq.request, e.seq.num_prompt_tokens)}
        self.scheduler.postprocess(batch, tokens, self.clock())
        for e in batch.entries:
            st: PrefillStream = e.seq.request
            if st.done is not None and st.state == "streaming":
                self._send_done(st)
        return True

    def _emit(self, layer: int, batch: Batch) -> None:
        """Called by the model once layer ``layer``'s K/V of this step are in the cache."""
        self.layer_times.append((layer, self.clock()))
        for e in batch.entries:
            st: PrefillStream = e.seq.request
            end, lo = e.start + e.num_new_tokens, st.sent_upto[layer]
            if end <= lo:
                continue
            k, v = self.cache.read(layer, e.block_table, end)
            st.sent_upto[layer] = end
            if st.state == "streaming":
                self._send_kv(st, layer, lo, k[lo:end], v[lo:end])
            else:
                st.pending.append((layer, lo, k[lo:end].copy(), v[lo:end].copy()))

    def inflight_tokens(self) -> int:
        return sum(s.num_uncomputed_tokens for s in (*self.scheduler.waiting,
                                                     *self.scheduler.running))
