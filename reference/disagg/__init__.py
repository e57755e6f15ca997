"""Disaggregated prefill/decode: a prefill worker streams each prompt's KV, layer by layer, to a
decode worker, over a written, checked protocol (``PROTOCOL.md``).

    from reference.disagg.batch import run_requests
    from reference.disagg.pool import InProcessPool, ProcessPool
    with ProcessPool("smollm2", num_prefill=1, num_decode=1) as pool:       # OS processes, TCP
        results = run_requests(pool, [{"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 8}])

Files: ``frames.py`` (header, tag, checks), ``messages.py`` (control payload schemas), ``wire.py``
(KV payload in fp32 / bf16 / fp8, model and KV digests), ``transport.py`` (in-process queues,
sockets,
``Link``), ``prefill.py`` and ``decode.py`` (the workers), ``coordinator.py`` (routing, relaying,
request migration, worker leases, every request ends once), ``accounting.py`` (per-worker counts),
``faults.py`` (seeded injector), ``pool.py`` (in one process or as processes, local or remote;
restarts), ``batch.py`` and ``__main__.py`` (the batch command). The endpoint ``python -m serve
--prefill-workers P --decode-workers
D`` (``serve/disagg.py``) runs on the same coordinator and pool.
``fast/disagg`` carries the same frames over torch.distributed.
"""
