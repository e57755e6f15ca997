"""The NIXL carrier in one process (queues for the frames, two NIXL agents for the KV): the decode worker
reads every KV payload from the prefill worker's registered arena, and the output equals the colocated
engine's with every prompt's KV digest equal (fp32 wire); the arena allocator; the refusal without nixl."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from reference.disagg import nixl_carrier
from reference.disagg.batch import run_requests
from reference.disagg.decode import DecodeWorker
from reference.disagg.nixl_carrier import Arena
from reference.disagg.pool import FAST_FAULTS, InProcessPool, WorkerOptions
from reference.disagg.prefill import PrefillWorker
from tests.test_disagg_inprocess import colocated, workload

OPTS = WorkerOptions(num_blocks=128, block_size=8, kv_carrier="nixl", nixl_arena_mb=8, **FAST_FAULTS)


def test_arena_first_fit_merges_freed_holes() -> None:
    a = Arena(1024)
    x, y, z = a.alloc(100), a.alloc(200), a.alloc(640)
    assert (x, y, z) == (0, 128, 384) and a.alloc(1) is None
    a.free(y, 200)
    a.free(x, 100)
    assert a.alloc(300) == 0  # the two holes merged
    a.free(0, 300)
    a.free(z, 640)
    assert a.free_list == [(0, 1024)]


def test_missing_nixl_is_refused_with_the_install_command(monkeypatch) -> None:
    monkeypatch.setattr(nixl_carrier, "nixl_available", lambda: False)
    with pytest.raises(nixl_carrier.CarrierError, match=r"`nixl`.*pip install 'nixl==1\.5\.1'"):
        nixl_carrier.require_nixl()


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_nixl_handoff_reads_the_kv_and_matches_colocated(wire: str) -> None:
    pytest.importorskip("nixl")
    requests = workload(6)
    opts = dataclasses.replace(OPTS, wire=wire)
    with InProcessPool("tiny", 1, 1, opts=opts) as pool:
        results = run_requests(pool, requests)
        workers = [w for w, _ in pool.workers.values()]
        dec = next(w for w in workers if isinstance(w, DecodeWorker)).counters
        pre = next(w for w in workers if isinstance(w, PrefillWorker))
        arena_free = pre.nixl.arena.free_bytes() if pre.nixl else -1
    assert all(r["error"] is None for r in results)
    if wire == "fp32":
        assert [r["output_token_ids"] for r in results] == colocated(requests)
        assert dec.get("kv_digest_match", 0) == len(requests)
    assert dec.get("prefills_recomputed", 0) == 0 and dec.get("kv_nixl_reads_failed", 0) == 0
    assert dec["kv_bytes_read_nixl"] == dec["kv_bytes_received"] > 0  # every KV byte came by NIXL
    assert arena_free == 8 << 20  # every staged region freed once its DONE was acknowledged


def test_nixl_source_stages_what_the_sink_reads() -> None:
    pytest.importorskip("nixl")
    src, sink = nixl_carrier.NixlSource(1, 1 << 16), nixl_carrier.NixlSink(2, 1 << 16)
    assert sink.connect(src.descriptor()) is None
    payload = np.arange(5000, dtype=np.uint8).tobytes()
    off, descriptor = src.stage(payload)
    read = sink.post(src.descriptor(), descriptor)
    assert isinstance(read, nixl_carrier.Read)
    got = None
    for _ in range(100000):
        got = sink.poll(read)
        if got is not None:
            break
    assert got == payload
    bad = bytearray(descriptor)
    bad[-1] ^= 1  # a descriptor whose digest does not match the arena's bytes
    read = sink.post(src.descriptor(), bytes(bad))
    for _ in range(100000):
        got = sink.poll(read)
        if got is not None:
            break
    assert isinstance(got, str) and "digest" in got
