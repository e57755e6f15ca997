"""Workers and coordinator in one process (queues): identity with the colocated engine, KV bytes,
prefix skipping, refusals, and the two small APIs the handoff added (on_layer, add_running)."""

from __future__ import annotations

import numpy as np
import pytest

from reference.disagg import messages, prefill
from reference.disagg.batch import run_requests
from reference.disagg.decode import DecodeWorker
from reference.disagg.frames import Kind, decode_frame
from reference.disagg.models import digest_of, load_model, tiny_llama
from reference.disagg.pool import FAST_FAULTS, InProcessPool, WorkerOptions
from reference.disagg.transport import Link, pipe
from reference.disagg.wire import KVLayout, encode_kv, kv_digest
from reference.engine.engine import Engine
from reference.engine.params import SamplingParams
from reference.kv.block_manager import BlockManager
from reference.kv.prefix_hash import prefix_keys
from reference.sched import RequestError, Scheduler, SchedulerConfig
from reference.sched import Sequence as SchedSequence

OPTS = WorkerOptions(num_blocks=128, block_size=8, **FAST_FAULTS)


def workload(n: int, seed: int = 0, max_tokens: int = 10) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"r{i}", "prompt_token_ids": rng.integers(1, 128, size=int(rng.integers(3, 60))).tolist(),
             "max_tokens": max_tokens} for i in range(n)]


def colocated(requests: list[dict]) -> list[list[int]]:
    engine = Engine(load_model("tiny"), num_blocks=128, block_size=8)
    params = SamplingParams(max_tokens=requests[0]["max_tokens"])
    outs = engine.generate([r["prompt_token_ids"] for r in requests], params)
    return [o.output_token_ids for o in outs]


@pytest.mark.parametrize("num_prefill,num_decode", [(1, 1), (2, 3)])
def test_fp32_handoff_is_identical_to_colocated_and_kv_bytes_match(monkeypatch, num_prefill, num_decode):
    sent: dict[str, tuple[np.ndarray, ...]] = {}

    def recording_digest(cache, table, length):  # the prefill side's K/V, as it puts its digest in DONE
        sent[len(sent)] = tuple(np.concatenate(cache.read(layer, table, length)) for layer in range(cache.num_layers))
        return kv_digest(cache, table, length)

    monkeypatch.setattr(prefill, "kv_digest", recording_digest)
    requests = workload(10)
    with InProcessPool("tiny", num_prefill, num_decode, opts=OPTS) as pool:
        results = run_requests(pool, requests)
        decoders = [w for w, _ in pool.workers.values() if isinstance(w, DecodeWorker)]
        counters = [w.counters for w in decoders]
    assert [r["output_token_ids"] for r in results] == colocated(requests)
    assert all(r["error"] is None and r["finish_reason"] == "length" for r in results)
    assert sum(c.get("kv_digest_match", 0) for c in counters) == len(requests)  # every prompt's KV, bit for bit
    assert sum(c.get("kv_digest_mismatch", 0) + c.get("prefills_recomputed", 0) for c in counters) == 0
    assert len(sent) == len(requests)


def test_received_kv_arrays_equal_the_prefill_workers(monkeypatch):
    sent, received = {}, {}

    def recording_digest(cache, table, length):
        sent[length] = [np.concatenate(cache.read(i, table, length)) for i in range(cache.num_layers)]
        return kv_digest(cache, table, length)

    monkeypatch.setattr(prefill, "kv_digest", recording_digest)
    requests = [{"id": f"q{n}", "prompt_token_ids": list(range(1, n + 1)), "max_tokens": 3} for n in (5, 17, 40)]
    with InProcessPool("tiny", 1, 1, opts=OPTS) as pool:
        d = next(w for w, _ in pool.workers.values() if isinstance(w, DecodeWorker))
        admit = d._admit

        def capture(st, first_token):
            n = st.seq.num_prompt_tokens
            received[n] = [np.concatenate(d.cache.read(i, st.seq.block_table, n)) for i in range(3)]
            return admit(st, first_token)

        d._admit = capture
        run_requests(pool, requests)
    assert sorted(sent) == sorted(received) == [5, 17, 40]
    for n in sent:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(sent[n], received[n], strict=True))


def test_a_prefix_the_decode_worker_holds_is_not_sent_again():
    rng = np.random.default_rng(5)
    shared = rng.integers(1, 128, size=40).tolist()
    requests = [{"id": f"s{i}", "prompt_token_ids": shared + rng.integers(1, 128, size=7).tolist(), "max_tokens": 4}
                for i in range(2)]
    with InProcessPool("tiny", 1, 1, opts=OPTS) as pool:
        first = run_requests(pool, requests[:1])
        d = next(w for w, _ in pool.workers.values() if isinstance(w, DecodeWorker))
        bytes_first = d.counters["kv_bytes_received"]
        second = run_requests(pool, requests[1:])
        bytes_second = d.counters["kv_bytes_received"] - bytes_first
        assert d.counters["kv_digest_match"] == 2  # the digest covers the cached prefix too
    assert bytes_second < bytes_first * 0.35  # 40 of 47 tokens (5 full blocks) were already there
    assert [first[0]["output_token_ids"], second[0]["output_token_ids"]] == colocated(requests)[:2]


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
def test_lossy_wire_dtypes_complete_and_stay_close(wire):
    requests = workload(6, seed=2)
    with InProcessPool("tiny", 1, 1, opts=WorkerOptions(num_blocks=128, block_size=8, wire=wire)) as pool:
        results = run_requests(pool, requests)
        d = next(w for w, _ in pool.workers.values() if isinstance(w, DecodeWorker))
        assert d.counters["handoffs_complete"] == len(requests)
        assert "kv_digest_match" not in d.counters  # no bit-exact claim for lossy wire dtypes
        fp32_bytes = sum(len(r["prompt_token_ids"]) for r in requests) * 3 * (2 * 2 * 8 * 4)  # layers x K,V x heads
        assert d.counters["kv_bytes_received"] < {"bf16": 0.55, "fp8": 0.32}[wire] * fp32_bytes
    assert all(r["error"] is None and len(r["output_token_ids"]) == 10 for r in results)


# -- refusals at the decode worker -----------------------------------------------------------------

def decode_worker_with_stream(prompt: list[int]):
    a, b = pipe()
    d = DecodeWorker(load_model("tiny"), Link(b, b"s" * 32, node=2), model_digest=digest_of("tiny"), num_blocks=32,
                     block_size=8)
    coord = Link(a, b"s" * 32, node=1)
    coord.send(Kind.REQUEST, 9, messages.dump(Kind.REQUEST, {"id": "x", "prompt": prompt, "max_tokens": 3,
                                                             "eos_token_ids": []}))
    d.on_frame(d.link.accept(b.inbox.get_nowait()[1]))
    return d, coord, a


def manifest(prompt, **changes):
    layout = {**KVLayout(3, 2, 8, 8, "fp32").as_message(), **changes.pop("layout", {})}
    body = {"id": "x", "prompt_len": len(prompt), "prefix_keys": [k.hex() for k in prefix_keys(prompt, 8)],
            "model_digest": digest_of("tiny"), "layout": layout}
    body.update(changes)
    return messages.dump(Kind.MANIFEST, body)


@pytest.mark.parametrize("change,reason", [
    ({"model_digest": "0" * 64}, "model mismatch"),
    ({"layout": {"head_dim": 16}}, "layout mismatch: head_dim"),
    ({"layout": {"block_size": 16}}, "layout mismatch: block_size"),
    ({"layout": {"scale_rule": "pow2-per-block-head"}}, "scale rule"),
    ({"prefix_keys": ["00" * 16, "11" * 16]}, "prefix-block keys disagree"),
    ({"prompt_len": 5}, "prompt length"),
])
def test_decode_worker_refuses_a_manifest_that_does_not_match_and_serves_the_request_itself(change, reason):
    prompt = list(range(1, 20))
    d, coord, a = decode_worker_with_stream(prompt)
    coord.send(Kind.MANIFEST, 9, manifest(prompt, **change))
    d.on_frame(d.link.accept(d.link.endpoint.inbox.get_nowait()[1]))
    reply = decode_frame(a.inbox.get_nowait()[1], b"s" * 32)
    body = messages.load(Kind.ABORT, reply.payload)
    assert reply.kind is Kind.ABORT and body["action"] == "refused" and reason in body["reason"]
    assert d.block_manager.num_free_blocks == 32  # nothing allocated for the refused handoff
    while d.has_work():  # ...and the request is computed here instead
        d.tick()
    kinds = [decode_frame(raw, b"s" * 32).kind for _, raw in list(a.inbox.queue)]
    assert kinds.count(Kind.TOKEN) == 3 and kinds[-1] is Kind.FINISH


def test_decode_worker_refuses_kv_outside_the_layout_without_writing():
    prompt = list(range(1, 20))
    d, coord, a = decode_worker_with_stream(prompt)
    coord.send(Kind.MANIFEST, 9, manifest(prompt))
    d.on_frame(d.link.accept(d.link.endpoint.inbox.get_nowait()[1]))
    before = [x.copy() for x in d.cache.k]
    k = np.ones((5, 2, 8), np.float32)
    for payload in (encode_kv(KVLayout(3, 2, 8, 8, "fp32"), 0, 17, k, k),  # past the prompt
                    encode_kv(KVLayout(3, 2, 8, 8, "bf16"), 0, 0, k, k),  # other wire dtype
                    encode_kv(KVLayout(3, 2, 8, 8, "fp32"), 0, 0, k, k)[:-4]):  # short
        coord.send(Kind.KV, 9, payload)
        d.on_frame(d.link.accept(d.link.endpoint.inbox.get_nowait()[1]))
    assert d.counters["kv_frames_refused"] == 3
    assert all(np.array_equal(x, y) for x, y in zip(before, d.cache.k, strict=True))


# -- the two small APIs ----------------------------------------------------------------------------

def test_on_layer_is_called_after_each_layers_kv_is_written():
    model = tiny_llama(0)
    cache = model.new_cache(8, 8)
    from reference.model.llama import Chunk
    seen = []

    def hook(i):
        k, _ = cache.read(i, [0], 5)
        seen.append((i, bool(np.any(k != 0)), bool(np.any(cache.read(min(i + 1, 2), [0], 5)[0] != 0)) or i == 2))

    model.forward([Chunk([1, 2, 3, 4, 5], 0, [0])], cache, on_layer=hook)
    assert [s[0] for s in seen] == [0, 1, 2]
    assert all(written for _, written, _ in seen)  # layer i is in the cache when on_layer(i) runs
    assert not any(nxt for i, _, nxt in seen if i < 2)  # layer i + 1 is not yet


def test_add_running_admits_a_sequence_computed_elsewhere():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4))
    seq = SchedSequence(prompt_token_ids=[1, 2, 3, 4, 5, 6], max_tokens=3)
    with pytest.raises(RequestError, match="hold its blocks"):
        sched.add_running(seq)
    bm.allocate(seq)
    seq.num_computed_tokens = 6
    seq.token_ids.append(9)  # the first token, sampled by the prefill worker
    sched.add_running(seq, now=0.0)
    batch = sched.schedule(0.0)
    (entry,) = batch.entries
    assert (entry.start, entry.num_new_tokens, entry.needs_sample, entry.is_prefill) == (6, 1, True, False)
    sched.postprocess(batch, [7], 0.1)
    assert seq.output_token_ids == [9, 7]
    other = SchedSequence(prompt_token_ids=[1, 2], max_tokens=2)
    bm.allocate(other)
    other.num_computed_tokens = 2
    with pytest.raises(RequestError, match="at least the last token"):
        sched.add_running(other)
