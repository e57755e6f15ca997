"""The disaggregated workers on the fast engine's runner (``fast/disagg/worker_runner.py``), in one process, and the
tenant fields of REQUEST revision 1 (salted prefix caches, fair queuing by weight, revision-0 peers).

The workers and coordinator are the real ones (``InProcessPool``: queues instead of sockets); only the
model they step on is the torch one. Its output must equal the colocated fast engine's token for token,
and with fp32 on the wire the decode worker's KV must equal the prefill worker's bit for bit (DONE digest).
"""

from __future__ import annotations

import numpy as np
import pytest

from reference.disagg import messages
from reference.disagg import pool as pool_mod
from reference.disagg.batch import run_requests
from reference.disagg.coordinator import Coordinator, RequestState
from reference.disagg.decode import DecodeWorker
from reference.disagg.frames import Kind
from reference.disagg.models import load_model
from reference.disagg.pool import FAST_FAULTS, InProcessPool, WorkerOptions
from reference.disagg.prefill import PrefillWorker
from reference.disagg.routing import Worker
from reference.engine.params import SamplingParams

torch = pytest.importorskip("torch")

from fast.disagg.worker_runner import HostCache, load_worker_model  # noqa: E402
from fast.engine import Engine, FastModel, TorchLlama  # noqa: E402


def workload(n: int, seed: int = 0, max_tokens: int = 10) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"r{i}", "prompt_token_ids": rng.integers(1, 128, size=int(rng.integers(3, 60))).tolist(),
             "max_tokens": max_tokens} for i in range(n)]


def colocated_fast(requests: list[dict], dtype: str, compressed: bool) -> list[list[int]]:
    ref = load_model("tiny")
    model = TorchLlama(ref.config, ref.weights, dtype=dtype, compressed=compressed)
    engine = Engine(FastModel(model), num_blocks=128, block_size=8)
    outs = engine.generate([r["prompt_token_ids"] for r in requests], SamplingParams(max_tokens=10))
    return [o.output_token_ids for o in outs]


def fast_pool(monkeypatch: pytest.MonkeyPatch, opts: WorkerOptions, dtype: str,
                 compressed: tuple) -> InProcessPool:
    loaded = load_worker_model("tiny", dtype=dtype, compressed=compressed, device="cpu")
    plain = pool_mod.make_worker
    monkeypatch.setattr(pool_mod, "make_worker", lambda role, spec, link, o: plain(role, spec, link, o, loaded))
    return InProcessPool("tiny", 1, 1, opts=opts)


@pytest.mark.parametrize("dtype,wire,compressed", [("float32", "fp32", ()), ("bfloat16", "bf16", ()),
                                                    ("bfloat16", "fp32", ("qkv", "o", "gate_up", "down"))])
def test_workers_on_the_fast_runner_give_the_colocated_fast_engines_tokens(monkeypatch, dtype, wire, compressed):
    torch.set_num_threads(1)
    requests = workload(8)
    opts = WorkerOptions(num_blocks=128, block_size=8, wire=wire, kv_dtype=dtype, **FAST_FAULTS)
    with fast_pool(monkeypatch, opts, dtype, compressed) as pool:
        results = run_requests(pool, requests)
        workers = [w for w, _ in pool.workers.values()]
        decode = next(w for w in workers if isinstance(w, DecodeWorker))
        assert all(isinstance(w.cache, HostCache) for w in workers)  # the torch cache behind the wire code
        assert decode.cache.dtype == dtype
        counters = dict(decode.counters)
    assert [r["output_token_ids"] for r in results] == colocated_fast(requests, dtype, bool(compressed))
    assert counters.get("prefills_recomputed", 0) == 0  # every sequence continued from the KV it was sent
    if wire == "fp32":
        assert counters.get("kv_digest_match", 0) == len(requests)  # bit for bit, prefill cache == decode cache


def test_prefill_worker_sends_each_layer_as_the_torch_model_writes_it(monkeypatch):
    opts = WorkerOptions(num_blocks=64, block_size=8, **FAST_FAULTS)
    with fast_pool(monkeypatch, opts, "float32", ()) as pool:
        run_requests(pool, workload(2))
        prefill = next(w for w, _ in pool.workers.values() if isinstance(w, PrefillWorker))
        layers = [layer for layer, _ in prefill.layer_times]
    n = load_model("tiny").config.num_layers
    assert layers and layers == list(range(n)) * (len(layers) // n)  # in order, once per layer per step


def test_fast_worker_digest_differs_from_the_reference_workers():
    from reference.disagg.models import digest_of

    f32, bf16 = load_worker_model("tiny", dtype="float32")[1], load_worker_model("tiny", dtype="bfloat16")[1]
    assert len({f32, bf16, digest_of("tiny")}) == 3  # a decode worker refuses KV computed with other numbers
    with pytest.raises(ValueError, match="unknown matrices"):
        load_worker_model("tiny", compressed=("attn",))


# -- REQUEST revision 1: tenants -------------------------------------------------------------------------
SHARED = list(range(1, 41))  # five full blocks of 8: a prompt two tenants both send


def test_salts_separate_tenants_in_the_workers_prefix_caches_and_weights_reach_their_schedulers():
    opts = WorkerOptions(num_blocks=128, block_size=8, **FAST_FAULTS)
    with InProcessPool("tiny", 1, 1, opts=opts) as pool:
        coord = pool.coordinator
        decode = next(w for w, _ in pool.workers.values() if isinstance(w, DecodeWorker))
        prefill = next(w for w, _ in pool.workers.values() if isinstance(w, PrefillWorker))

        def run(rid: str, tenant: str, weight: float = 1.0) -> int:
            before = decode.counters.get("kv_bytes_received", 0)
            coord.submit(rid, SHARED, 4, tenant=tenant, cache_salt=tenant, weight=weight)
            while coord.requests[rid].result is None:
                pool.pump()
            assert coord.requests[rid].result["error"] is None
            return decode.counters.get("kv_bytes_received", 0) - before

        first = run("a1", "acme", 4.0)
        again = run("a2", "acme", 4.0)  # the same tenant: its cached blocks are not sent again
        other = run("b1", "bob")  # the same prompt, another salt: no hit, everything is sent
        assert 0 < again < first and other == first
        for w in (decode, prefill):
            assert w.scheduler.policy.tenants.weight("acme") == 4.0
            assert w.scheduler.policy.tenants.weight("bob") == 1.0
        with pytest.raises(ValueError, match="weight"):
            coord.submit("bad", SHARED, 4, weight=0.0)


def finish_order(paid_weight: float) -> list[str]:
    worker_opts = WorkerOptions(num_blocks=256, block_size=8, max_num_seqs=1, **FAST_FAULTS)
    with InProcessPool("tiny", 1, 1, opts=worker_opts) as pool:
        coord = pool.coordinator
        for i in range(3):  # all queued at once: the workers run one sequence at a time
            coord.submit(f"free{i}", SHARED[:10 + i], 6, tenant="free", weight=1.0)
            coord.submit(f"paid{i}", SHARED[:20 + i], 6, tenant="paid", weight=paid_weight)
        while coord.unfinished():
            pool.pump()
        return [r.id[:4] for r in sorted(coord.requests.values(), key=lambda r: r.token_times[-1])]


def test_wfq_on_the_worker_serves_the_heavier_tenant_first():
    # the first request runs at once; then the weight-8 tenant's go before the rest, not turn about
    assert finish_order(8.0)[1:4] == ["paid"] * 3
    assert finish_order(1.0)[1:4] != ["paid"] * 3  # equal weights: turn about


def test_revision_0_peers_interoperate():
    # a revision-0 REQUEST (no tenant fields) is still accepted, meaning the default tenant
    body = {"id": "x", "prompt": [1, 2], "max_tokens": 3, "eos_token_ids": [0]}
    assert messages.load(Kind.REQUEST, messages.dump(Kind.REQUEST, body)) == body
    with pytest.raises(messages.MessageError, match="weight"):
        messages.dump(Kind.REQUEST, {**body, "tenant": "a", "cache_salt": None, "weight": float("nan")})
    # a worker whose HELLO said no revision is sent REQUESTs without the fields it would refuse
    coord = Coordinator(b"k" * 32)
    coord.eos = (0,)
    req = RequestState("x", [1, 2], 3, 0.0, 1.0, tenant="a", cache_salt="a", weight=2.0)
    old, new = (Worker(1, "decode", None, 8, 8, revision=r) for r in (0, 1))
    assert "tenant" not in messages.load(Kind.REQUEST, coord._request_body(req, old))
    assert messages.load(Kind.REQUEST, coord._request_body(req, new))["weight"] == 2.0
