"""The decode worker: receives a prompt's KV into its own paged cache, then decodes in its batch.

Per request (a *stream*), ``PROTOCOL.md`` section 5:
  REQUEST (from the coordinator) -> state ``expected``: the worker knows the prompt, so whatever
      goes wrong with the handoff it can still serve the request by computing the prompt itself;
  MANIFEST -> every field checked (model digest, layout, prompt length, the prefix keys recomputed
      here from the prompt); blocks allocated by this worker's block manager, reusing its own
      cached prefix; ACK(cached_tokens) so the sender skips them -> ``receiving``;
  KV frames -> each checked against the layout, written into this worker's blocks;
  DONE -> if every layer of every position landed (and, with fp32 on the wire, the digest of the
      whole prompt's KV here equals the sender's), the sequence joins the running batch with its
      first token: ``Scheduler.add_running``. Otherwise it joins with what did land, and the
      scheduler computes the rest here ("recompute locally"). Either way the output is the same.
  ABORT(recompute) from the sender or the coordinator, or ``stream_timeout`` without a frame while
  receiving: recompute locally. ABORT(cancel): drop the request and free its blocks.

Installing a prompt's KV (decoding each KV frame into the cache, then the digest over every layer)
is work in the decode loop, between two decode steps: done all at once, it lengthens the gap between
two tokens of every running sequence (measured for SmolLM2 at 384 prompt tokens, fp32: ~35 ms next
to a ~60 ms decode step). So KV and DONE frames are acknowledged at once but installed from a queue,
a bounded share of the last step's time before each step (``install_share``; each KV frame and each
layer of the digest is one unit): the running sequences' gaps grow by at most that share, and the
new sequence joins a few steps later. With nothing running there is nobody to delay, and the queue
is drained at once. ``install_share=None`` installs each frame as it arrives. The worker counts what
installing cost and where: ``kv_install_us`` (CPU microseconds in all), and of it what ran while
sequences waited for their next token: ``kv_install_blocking_us``, ``kv_install_blocking_steps``
(steps it delayed) and ``kv_install_blocking_us_max`` (the most before one step), next to
``decode_step_us`` and ``decode_steps`` (the steps themselves); ``kv_install_deferred`` counts the
units queued because sequences were running.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reference.disagg import messages
from reference.disagg.frames import Frame, Kind
from reference.disagg.nixl_carrier import DESCRIPTOR_FLAG, NixlSink, Read
from reference.disagg.transport import Link
from reference.disagg.wire import KV_HEADER, KVLayout, WireError, decode_kv, kv_digest_by_layer
from reference.disagg.worker_base import (
    WorkerBase,
    logprob_fields,
    logprob_from,
    prompt_logprob_fields,
)
from reference.engine.params import SamplingParams
from reference.engine.request import Logprob
from reference.kv.block_manager import BlockManager
from reference.kv.prefix_hash import prefix_keys
from reference.model.llama import LlamaModel
from reference.sched import RequestError, Scheduler, SchedulerConfig, SchedulerError
from reference.sched import Sequence as SchedSequence


@dataclass
class DecodeStream:
    stream: int
    request_id: str
    seq: SchedSequence
    state: str = "expected"  # -> "receiving" -> "running" -> removed
    layout: KVLayout | None = None
    # bool [layers, prompt_len]: which K/V have landed (or were cached)
    covered: np.ndarray | None = None
    cached: int = 0
    last_activity: float = 0.0
    recomputed: bool = False
    # how its tokens are picked (greedy unless told); the prompt's last ``generated`` tokens are the
    # request's output (a migrated request); a grammar's matcher once it picks; the first token's
    # logprob as the DONE carried it
    params: SamplingParams = SamplingParams(seed=0)
    generated: int = 0
    constraint: Any = None
    prompt_lps: dict = field(default_factory=dict)  # position -> Logprob (prompt_logprobs asked)
    first_logprob: Logprob | None = None
    # NIXL carrier: the prefill agent named in the MANIFEST, its reads not yet resolved, and
    # whether an ACK(done) is owed once they are (the prefill worker frees its arena on that ACK)
    source: dict | None = None
    reads: list[PendingRead] = field(default_factory=list)
    done_owed: bool = False


WAITING = object()  # yielded by install work that waits for a NIXL read: stop installing for now


@dataclass
class PendingRead:
    """A KV descriptor's READ: posted (``read``), or waiting for room in this worker's arena, until
    it resolves to the payload's bytes (``data``) or a reason it failed (``error``)."""

    header: bytes
    descriptor: bytes
    read: Read | None = None
    data: bytes | None = None
    error: str | None = None

    @property
    def resolved(self) -> bool:
        return self.data is not None or self.error is not None


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, model: LlamaModel, link: Link, *, model_digest: str, num_blocks: int = 512,
                 block_size: int = 16, kv_dtype: str = "float32",
                 wires: tuple[str, ...] = ("fp32", "bf16", "fp8"),
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 32,
                 stream_timeout: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 install_share: float | None = 0.25, nixl: NixlSink | None = None) -> None:
        self.nixl = nixl  # None: KV descriptors are refused (the TCP carrier only)
        self.model, self.link, self.digest, self.clock = model, link, model_digest, clock
        c = model.config
        self.block_size, self.wires = block_size, wires
        self.runner = model.make_runner(num_blocks, block_size, kv_dtype)  # the engines' data plane
        self.cache = self.runner.cache  # KV lands here from the wire
        self.block_manager = BlockManager(num_blocks, block_size)
        self.max_model_len = min(c.max_position, num_blocks * block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            SchedulerConfig(max_num_batched_tokens, max_num_seqs, self.max_model_len),
            self.fair_queuing(),
        )
        self.streams: dict[int, DecodeStream] = {}
        self.stream_timeout = stream_timeout
        self.counters = link.counters
        self.install_share = install_share
        # KV and DONE work not done yet, in arrival order
        self.installs: deque[Iterator[object]] = deque()
        self.install_s = 0.0  # CPU seconds of install work since the last step
        self.waiting_on_read = False  # the queue's head waits for a NIXL read (_install)
        self.last_step_s = 0.0

    # -- frames in ------------------------------------------------------------------------
    def on_frame(self, frame: Frame) -> None:
        if frame.kind is Kind.REQUEST:
            return self._expect(frame)
        st = self.streams.get(frame.stream)
        if st is None:
            self.link.count("frames_for_unknown_stream")
            return
        st.last_activity = self.clock()
        if frame.kind is Kind.MANIFEST:
            self._manifest(st, frame)
        elif frame.kind is Kind.KV:
            if len(frame.payload) > 3 and frame.payload[3] == DESCRIPTOR_FLAG:
                self._queue(self._kv_nixl(st, frame))
            else:
                self._queue(self._kv(st, frame))
        elif frame.kind is Kind.DONE:
            body = messages.load(Kind.DONE, frame.payload)
            self._poll_reads(st)
            if all(r.resolved for r in st.reads):
                self._ack(st, "done")
            else:  # the prefill worker frees its arena on this ACK: not while reads are in flight
                st.done_owed = True
            self._queue(self._done(st, body))
        elif frame.kind is Kind.ABORT:
            self._install(float("inf"))  # what arrived before the ABORT lands first
            body = messages.load(Kind.ABORT, frame.payload)
            if body["action"] == "cancel":
                self._cancel(st)
            elif st.state in ("expected", "receiving"):
                self.link.count("handoffs_aborted")
                self._admit(st, first_token=None)

    def _expect(self, frame: Frame) -> None:
        body = messages.load(Kind.REQUEST, frame.payload)
        if frame.stream in self.streams:  # already known: a repeated REQUEST changes nothing
            return
        eos = body["eos_token_ids"]
        try:
            params = self.sampling_of(body)
            self.check_grammar(params)
            seq = SchedSequence(prompt_token_ids=body["prompt"], max_tokens=body["max_tokens"],
                                eos_token_id=eos[0] if eos else None, stop_token_ids=tuple(eos[1:]),
                                **self.tenant_of(body))
            if max(seq.prompt_token_ids) >= self.model.config.vocab_size or \
                    seq.num_prompt_tokens >= self.max_model_len:
                raise RequestError(f"prompt ids must be < {self.model.config.vocab_size} and the "
                                   "prompt shorter "
                                   f"than {self.max_model_len} tokens")
        except RequestError as e:
            return self._finish_message(frame.stream, body["id"], [], "error",
                                        f"decode worker refused: {e}")
        st = DecodeStream(frame.stream, body["id"], seq, last_activity=self.clock(), params=params,
                          generated=min(body.get("generated", 0), seq.num_prompt_tokens))
        seq.request = st
        self.streams[st.stream] = st

    def _manifest(self, st: DecodeStream, frame: Frame) -> None:
        if st.state == "receiving":  # a resent manifest: our ACK was lost
            return self._ack(st, "manifest")
        if st.state != "expected":
            return self.link.count("manifests_late")
        body = messages.load(Kind.MANIFEST, frame.payload)
        problem = self._manifest_problem(st, body)
        if problem is None and "kv_source" in body:
            problem = (
                "this decode worker reads no NIXL (started with the TCP carrier)"
                if self.nixl is None
                else self.nixl.connect(body["kv_source"])
            )
        if problem is None and not self.block_manager.can_allocate(st.seq):
            problem = "no free KV blocks on the decode worker"
        if problem is not None:
            self.link.count("manifests_refused")
            self.link.send(
                Kind.ABORT,
                st.stream,
                messages.dump(Kind.ABORT, {"reason": problem, "action": "refused"}),
            )
            return self._admit(st, first_token=None)
        lay = body["layout"]
        st.source = body.get("kv_source")
        st.layout = KVLayout(lay["num_layers"], lay["num_kv_heads"], lay["head_dim"],
                             lay["block_size"], lay["wire"])
        bm, seq = self.block_manager, st.seq
        bm.allocate(seq)
        seq.num_computed_tokens = seq.num_cached_tokens
        for src, dst in bm.may_append(seq, seq.num_prompt_tokens - seq.num_computed_tokens):
            # a cached block that the received positions would write into
            self.cache.copy_block(src, dst)
        st.cached = seq.num_cached_tokens
        st.covered = np.zeros((st.layout.num_layers, seq.num_prompt_tokens), dtype=bool)
        st.covered[:, :st.cached] = True
        st.state = "receiving"
        self._ack(st, "manifest")

    def _manifest_problem(self, st: DecodeStream, body: dict) -> str | None:
        """Why this manifest cannot be accepted, or None. Checked before any memory is touched."""
        c, lay = self.model.config, body["layout"]
        if body["model_digest"] != self.digest:
            return "model mismatch: the sender runs other weights or another config"
        mine = {"num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "block_size": self.block_size}
        for name, value in mine.items():
            if lay[name] != value:
                return f"layout mismatch: {name} is {lay[name]} there, {value} here"
        if lay["wire"] not in self.wires:
            return (
                f"wire dtype {lay['wire']!r} not accepted here (accepted: {', '.join(self.wires)})"
            )
        expected_rule = "pow2-per-block-head" if lay["wire"] == "fp8" else "none"
        if lay["scale_rule"] != expected_rule:
            return f"scale rule {lay['scale_rule']!r} does not go with wire dtype {lay['wire']!r}"
        if body["id"] != st.request_id or body["prompt_len"] != st.seq.num_prompt_tokens:
            return (
                "manifest does not describe the request this stream carries (id or prompt length)"
            )
        keys = [k.hex() for k in prefix_keys(st.seq.prompt_token_ids, self.block_size,
                                             st.seq.cache_salt)]
        if body["prefix_keys"] != keys:
            return "prefix-block keys disagree with the keys computed here from the prompt"
        return None

    # -- installing received KV -----------------------------------------------------------
    def _queue(self, work: Iterator[object]) -> None:
        self.installs.append(work)
        # nobody's next token waits for it
        if self.install_share is None or not self.scheduler.running:
            self._install(float("inf"))
        else:
            self.link.count("kv_install_deferred")

    def _install(self, budget_s: float) -> None:
        """Run queued install work for up to ``budget_s`` CPU seconds (at least one unit, if any).
        Its time counts as ``kv_install_us``; with sequences running, also as blocking their next
        token."""
        if not self.installs:
            return
        start = time.process_time()
        self.waiting_on_read = False
        while self.installs:
            try:
                if next(self.installs[0]) is WAITING:
                    # a NIXL read in flight: take frames (post their reads) meanwhile
                    self.waiting_on_read = True
                    break
            except StopIteration:
                self.installs.popleft()
            if time.process_time() - start >= budget_s:
                break
        spent = time.process_time() - start
        self.link.count("kv_install_us", int(spent * 1e6))
        if self.scheduler.running:
            self.install_s += spent

    def has_work(self) -> bool:
        """Work to do now. Install work that waits for a NIXL read is not: the loop then sleeps
        ``poll_s`` between polls instead of spinning beside the prefill worker's compute."""
        return (bool(self.installs) and not self.waiting_on_read) or super().has_work()

    def poll_s(self) -> float:
        """How long the worker loop may wait for a frame when ``has_work`` is False."""
        return 0.0005 if self.waiting_on_read else 0.02

    def _kv(self, st: DecodeStream, frame: Frame) -> Iterator[None]:
        if st.state != "receiving" or st.layout is None or st.covered is None:
            return self.link.count("kv_frames_late")
        yield from self._write_kv(st, frame.payload)

    def _write_kv(self, st: DecodeStream, payload: bytes) -> Iterator[None]:
        """Check one KV payload against the stream's layout, write it into this worker's cache."""
        assert st.layout is not None and st.covered is not None
        try:
            layer, start, k, v = decode_kv(st.layout, st.seq.num_prompt_tokens, payload)
        except WireError:
            return self.link.count("kv_frames_refused")
        if start < st.cached:  # those positions live in shared cached blocks: never written
            return self.link.count("kv_frames_refused")
        self.cache.write(layer, self.cache.slots(st.seq.block_table, start, len(k)), k, v)
        st.covered[layer, start:start + len(k)] = True
        self.link.count("kv_frames_received")
        self.link.count("kv_bytes_received", len(payload))
        yield

    def _kv_nixl(self, st: DecodeStream, frame: Frame) -> Iterator[object]:
        """A KV descriptor (NIXL carrier): post the READ now, install its bytes once they land."""
        if st.state != "receiving" or st.source is None or self.nixl is None:
            return self.link.count("kv_frames_late" if st.state != "receiving" else
                                   "kv_frames_refused")
        size = KV_HEADER.size
        pending = PendingRead(frame.payload[:size], frame.payload[size:])
        st.reads.append(pending)
        self._poll_reads(st)
        yield
        while not pending.resolved:
            self._poll_reads(st)
            if not pending.resolved:
                yield WAITING
        if pending.error is not None:
            self.link.count("kv_nixl_reads_failed")
            self.link.count("kv_frames_refused")
            self.nixl.forget(st.source["agent"])
            return
        assert pending.data is not None
        # the bytes read must be the payload the signed descriptor announced: layer, wire, positions
        mine, theirs = KV_HEADER.unpack_from(pending.header), KV_HEADER.unpack_from(pending.data)
        if mine[:2] != theirs[:2] or mine[3:] != theirs[3:] or theirs[2] != 0:
            return self.link.count("kv_frames_refused")
        self.link.count("kv_bytes_read_nixl", len(pending.data))
        if st.state == "receiving":
            yield from self._write_kv(st, pending.data)

    def _poll_reads(self, st: DecodeStream) -> None:
        """Post what waits for arena room, collect finished reads, and send an owed ACK(done) once
        every read of the stream has resolved."""
        if self.nixl is None or st.source is None:
            return
        for pending in st.reads:
            if pending.resolved:
                continue
            if pending.read is None:
                posted = self.nixl.post(st.source, pending.descriptor)
                if isinstance(posted, str):
                    pending.error = posted
                elif posted is not None:
                    pending.read = posted
                continue
            result = self.nixl.poll(pending.read)
            if isinstance(result, str):
                pending.error = result
            elif result is not None:
                pending.data = result
        if st.done_owed and all(r.resolved for r in st.reads):
            st.done_owed = False
            self._ack(st, "done")

    def _done(self, st: DecodeStream, body: dict) -> Iterator[None]:
        if st.state != "receiving" or st.layout is None:
            return
        first = body["first_token"]
        if first >= self.model.config.vocab_size:
            self.link.count("done_refused")
            return self._admit(st, first_token=None)
        if st.layout.wire == "fp32" and self._landed(st) == st.seq.num_prompt_tokens:
            mine = yield from kv_digest_by_layer(self.cache, st.seq.block_table,
                                                 st.seq.num_prompt_tokens)
            if st.state != "receiving":  # aborted or cancelled while the digest was computed
                return
            if mine != body["kv_digest"]:
                self.link.count("kv_digest_mismatch")
                st.covered[:, st.cached:] = False  # trust only our own cached prefix
            else:
                self.link.count("kv_digest_match")
        st.first_logprob = logprob_from(body, first)
        self._admit(st, first_token=first)

    def _landed(self, st: DecodeStream) -> int:
        """Length of the prefix whose K/V are here in every layer."""
        if st.covered is None:
            return 0
        full = st.covered.all(axis=0)
        return len(full) if full.all() else int(np.argmin(full))

    def _admit(self, st: DecodeStream, first_token: int | None) -> None:
        """Join the running batch with what landed; compute the rest here if anything is missing."""
        seq, n = st.seq, st.seq.num_prompt_tokens
        landed = self._landed(st)
        if st.state == "expected":  # no blocks yet: an ordinary request, prefilled here
            st.state, st.recomputed = "running", True
            self.link.count("prefills_recomputed")
            try:
                return self.scheduler.add(seq, self.clock())
            except (RequestError, SchedulerError) as e:
                return self._end(st, "error", f"decode worker cannot serve the request: {e}")
        st.state = "running"
        if landed == n and first_token is not None:
            seq.num_computed_tokens = n
            self.block_manager.cache_full_blocks(seq)
            seq.token_ids.append(first_token)
            self._token(st, first_token, st.first_logprob)
            if first_token == seq.eos_token_id or first_token in seq.stop_token_ids:
                return self._end(st, "stop", None)
            if seq.max_tokens == 1 or seq.num_tokens >= self.max_model_len:
                return self._end(st, "length", None)
            self.link.count("handoffs_complete")
        else:
            # prompt logprobs asked: every row computed here (the prefill worker's may not come)
            wants_rows = st.params.prompt_logprobs is not None
            seq.num_computed_tokens = 0 if wants_rows else min(landed, n - 1)
            st.recomputed = True
            self.link.count("prefills_recomputed")
        self.scheduler.add_running(seq, self.clock())

    def _cancel(self, st: DecodeStream) -> None:
        if self.scheduler.abort(st.seq.seq_id, self.clock()) is None and st.seq.block_table:
            self.block_manager.free(st.seq)  # receiving: blocks held outside the scheduler
        st.state = "cancelled"  # install work still queued for it must not write into freed blocks
        self.streams.pop(st.stream, None)
        self.link.count("requests_cancelled")

    # -- frames out -----------------------------------------------------------------------
    def _ack(self, st: DecodeStream, of: str) -> None:
        self.link.send(
            Kind.ACK, st.stream, messages.dump(Kind.ACK, {"of": of, "cached_tokens": st.cached})
        )

    def _token(self, st: DecodeStream, token: int, lp: Logprob | None = None) -> None:
        self.link.send(Kind.TOKEN, st.stream, messages.dump(Kind.TOKEN, {
            "index": st.seq.num_output_tokens - 1, "token": token,
            "cpu_us": int(time.process_time() * 1e6), **logprob_fields(lp),
            # the prompt's logprobs when this worker computed them (a recomputed prompt)
            **(prompt_logprob_fields(st, st.seq.num_prompt_tokens)
               if st.seq.num_output_tokens == 1 else {})}))

    def _end(self, st: DecodeStream, reason: str, error: str | None) -> None:
        """The request is over here: free what it holds, tell the coordinator."""
        if self.scheduler.abort(st.seq.seq_id, self.clock()) is None and st.seq.block_table:
            self.block_manager.free(st.seq)
        self._finish_message(st.stream, st.request_id, st.seq.output_token_ids, reason, error,
                             st.recomputed)
        self.streams.pop(st.stream, None)

    def _finish_message(self, stream: int, request_id: str, output: list[int], reason: str,
                        error: str | None, recomputed: bool = False) -> None:
        self.link.send(Kind.FINISH, stream, messages.dump(Kind.FINISH, {
            "id": request_id, "output": list(output), "finish_reason": reason, "error": error,
            "recomputed": int(recomputed)}))

    # -- the loop -------------------------------------------------------------------------
    def tick(self) -> bool:
        # whose tokens an install before the step would delay
        running = bool(self.scheduler.running)
        self._install(
            self.install_share * self.last_step_s
            if running and self.install_share is not None
            else float("inf")
        )
        now = self.clock()
        for st in list(self.streams.values()):
            if st.state == "receiving" and now - st.last_activity > self.stream_timeout:
                self.link.count("stream_timeouts")
                self._admit(st, first_token=None)
        return self.step()

    def step(self) -> bool:
        start = time.process_time()
        ran = self.run_step()
        if ran is None:
            return False
        if self.install_s > 0:  # install work that ran while sequences waited for this step
            us = int(self.install_s * 1e6)
            self.link.count("kv_install_blocking_us", us)
            self.link.count("kv_install_blocking_steps")
            self.counters["kv_install_blocking_us_max"] = max(
                self.counters.get("kv_install_blocking_us_max", 0), us
            )
            self.install_s = 0.0
        batch, logits = ran
        picked = [self.pick(e.seq.request, e.seq, lg) if e.needs_sample else (None, None)
                  for e, lg in zip(batch.entries, logits, strict=True)]
        tokens = [token for token, _ in picked]
        self.scheduler.postprocess(batch, tokens, self.clock())
        for e, (token, lp) in zip(batch.entries, picked, strict=True):
            st: DecodeStream = e.seq.request
            if token is None or st.stream not in self.streams:
                continue
            self._token(st, token, lp)
            if e.seq.is_finished:
                self._finish_message(st.stream, st.request_id, e.seq.output_token_ids,
                                     e.seq.finish_reason, None, st.recomputed)
                del self.streams[st.stream]
        self.last_step_s = time.process_time() - start
        self.link.count("decode_step_us", int(self.last_step_s * 1e6))
        self.link.count("decode_steps")
        return True

    def inflight_tokens(self) -> int:
        return sum(
            s.num_prompt_tokens + s.max_tokens
            for s in (*self.scheduler.waiting, *self.scheduler.running)
        )
