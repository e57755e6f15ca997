"""Paged KV cache kernels for the fast engine: fp8 writes, paged decode and prefill attention.

    from fast.kv import KVStep, PagedKVCache, paged_attention, write_kv

    cache = PagedKVCache(num_layers=L, num_blocks=N, block_size=16, num_kv_heads=kv, head_dim=d,
                         dtype="bfloat16" | "float32" | "fp8", device="cuda")
    step = KVStep.build(query_lens=[...], starts=[...], block_tables=[[...], ...], block_size=16,
                        num_blocks=N, device="cuda")          # once per engine step
    for layer in range(L):
        write_kv(cache, layer, step.slots, k, v)              # k, v: [T, kv, d]; write before attending
        out = paged_attention(q, cache, layer, step)          # q: [T, H, d] -> [T, H, d]

Layout and fp8 rule are the reference's (``reference/kv/cache.py``, ``reference/kv/fp8.py``): fp8
bytes and scales are bit-exact to it; attention is bounded against float64 (``conformance/cases/
kv_cases.py`` states the bound). Each op has a torch path (any device) and a Triton kernel;
``backend=`` or ``UNFIRE_KV_BACKEND`` forces one, else Triton on CUDA and torch on CPU.
"""

from fast.kv.cache import PagedKVCache
from fast.kv.ops import attention_rows, decode_attention, paged_attention, pick_backend, prefill_attention, write_kv
from fast.kv.step import KVStep

__all__ = ["KVStep", "PagedKVCache", "attention_rows", "decode_attention", "paged_attention", "pick_backend",
           "prefill_attention", "write_kv"]
