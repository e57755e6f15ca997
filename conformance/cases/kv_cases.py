"""The paged KV cache kernels (``fast/kv``) against ``reference/kv`` and a float64 attention.

* ``kv.fp8_encode.*`` (bit-exact): e4m3 codes of random float32 bit patterns (NaN, inf, subnormals,
  -0.0 included) at random scale exponents, by the Triton encoder and the torch path.
* ``kv.fp8_write.*`` (bit-exact): sequences filled over several steps (a prefill piece, then a few
  tokens at a time, magnitudes growing so blocks get rescaled); the cache's codes and scale
  exponents afterwards equal the reference cache's byte for byte. Both caches start full of the
  same garbage, so a write into a wrong block or a block not restarted at offset 0 shows.
* ``kv.write.bfloat16.*`` (bit-exact): a bf16 cache holds round-to-nearest-even of the values.
* ``kv.decode_attention.*``, ``kv.prefill_attention.*`` (bounded; ``split_kv``: the decode kernel with
  every sequence cut into 3 parts and merged, as a GPU does for small batches): paged attention over a cache
  whose every unused slot (the tail of each last block, unused blocks, the padding block the
  tables point at past their end) holds NaN (fp8: code 0x7F), against the float64 attention of
  ``reference.model.llama.attention`` on the reference cache's values. Per element:

      |o - o64| <= (2 (D + 2) u S + 4 L u + 2^-20) * sum_j p_j |v_j| + 2^-140,   u = 2^-24

  S = scale * max_j sum_d |q_d k_jd| (bounds the float32 error of a score, D products summed in any
  order; a score error e changes a softmax weight by a factor within exp(+-2e)); L = positions
  attended (the weights' sum and the weighted sum of values, in any order, online-softmax rescales
  included); 2^-20 covers the GPU's approximate exp. p_j are the float64 weights. With bf16 queries
  the output is bf16 and rounding it adds 2^-8 |o| <= 2^-8 (|o64| + the bound above). A slot read
  past the end gives NaN; a wrong block or a wrong mask misses by orders of magnitude.
  The torch path with bf16 queries (the bf16 engine's; one-token rows and prefill chunks) multiplies in
  bf16: each score, summed in float32, is rounded to bf16 (error <= 2^-9 |s| more, so the score error is at most
  e = ((D+2)u + 2^-9) S and a weight moves by a factor within exp(+-2e)), and each weight is rounded
  to bf16 (2^-9 relative): the factor becomes expm1(2e) + 2^-9 + 4Lu + 2^-20, plus 2^-133 for fp8
  values below bf16's smallest subnormal. Those cases also run on a bf16 cache.
"""

from __future__ import annotations

import functools
import os
import zlib
from typing import Any

import numpy as np

from conformance import isa
from conformance.registry import Bound, Case, Gen, Level, register
from reference.kv import fp8
from reference.kv.cache import KVCache
from reference.model.llama import attention as attention64

U = 2.0**-24
BOUND_TEXT = ("|o-o64| <= (2(D+2)uS + 4Lu + 2^-20) sum_j p_j|v_j| (bf16 output: + 2^-8(|o64| + that)), u=2^-24, "
              "S=scale max_j sum|q k_j|")
BF16_PRODUCTS_TEXT = ("|o-o64| <= (expm1(2((D+2)u + 2^-9)S) + 2^-9 + 4Lu + 2^-20) sum_j p_j|v_j| + 2^-133 "
                      "(+ bf16 output), u=2^-24: scores and weights rounded to bf16")


# -- fp8 codes ------------------------------------------------------------------------------
def _encode_inputs(gen: Gen) -> dict[str, Any]:
    import torch

    n = gen.size(20_000, 2_000_000)
    x = gen.rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x[:8] = [np.nan, -np.inf, np.inf, -0.0, 448.0, 464.0, 2.0**-10, -(2.0**-149)]
    e = gen.rng.integers(fp8.MIN_SCALE_EXP, fp8.MAX_SCALE_EXP + 1, n).astype(np.int32)
    return {"x": x, "e": e, "xt": torch.from_numpy(x).to(gen.device), "et": torch.from_numpy(e).to(gen.device)}


def _encode_fast(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.kv import fp8_torch, write_triton

    return {"triton": write_triton.encode_codes(inputs["xt"], inputs["et"]),
            "torch": fp8_torch.encode(inputs["xt"], inputs["et"])}


def _encode_reference(inputs: dict[str, Any]) -> dict[str, Any]:
    codes = fp8.encode(inputs["x"], inputs["e"])
    return {"triton": codes, "torch": codes}


# -- writes ---------------------------------------------------------------------------------
def _write_inputs(dtype: str):
    def make(gen: Gen) -> dict[str, Any]:
        seqs, steps = gen.size((3, 4), (16, 5))
        kv, d, bs = gen.size((2, 16, 16), (8, 128, 16))
        per_seq = -(-(gen.size(20, 200) + 3 * steps) // bs)
        nb = seqs * per_seq + 3
        tables = gen.rng.permutation(nb).reshape(-1)[:seqs * per_seq].reshape(seqs, per_seq).tolist()
        garbage = {"codes": gen.rng.integers(0, 256, (2, nb, bs, kv, d), dtype=np.uint8),
                   "exps": gen.rng.integers(-126, 121, (2, nb, kv)).astype(np.int8)}
        lengths, writes = [0] * seqs, []
        for step in range(steps):
            chunk = [int(gen.rng.integers(1, gen.size(20, 200) + 1)) if step == 0 else int(gen.rng.integers(1, 4))
                     for _ in range(seqs)]
            slots = np.concatenate([(np.asarray(t)[np.arange(s, s + n) // bs] * bs + np.arange(s, s + n) % bs)
                                    for t, s, n in zip(tables, lengths, chunk, strict=True)])
            lengths = [s + n for s, n in zip(lengths, chunk, strict=True)]
            growth = np.exp2(gen.rng.integers(-3, 4 + 2 * step, (len(slots), kv, 1)))
            k, v = (gen.rng.standard_normal((len(slots), kv, d)) * growth for _ in range(2))
            for a in (k, v):
                a.flat[gen.rng.integers(0, a.size, 3)] = [np.nan, -np.inf, 3e-41]
            writes.append((slots.astype(np.int64), k.astype(np.float32), v.astype(np.float32)))
        return {"dtype": dtype, "shape": (nb, bs, kv, d), "garbage": garbage, "writes": writes, "device": gen.device}

    return make


def _write_reference(inputs: dict[str, Any]) -> dict[str, Any]:
    from reference.bf16 import float32_to_bf16

    nb, bs, kv, d = inputs["shape"]
    if inputs["dtype"] == "bfloat16":
        store = np.zeros((nb * bs, kv, d), np.uint16)
        for slots, k, _ in inputs["writes"]:
            store[slots] = float32_to_bf16(k)
        return {"k": store.reshape(nb, bs, kv, d)}
    cache = KVCache(1, nb, bs, kv, d, "fp8")
    cache.k[0][:], cache.v[0][:] = inputs["garbage"]["codes"]
    cache.k_exp[0][:], cache.v_exp[0][:] = inputs["garbage"]["exps"]
    for slots, k, v in inputs["writes"]:
        cache.write(0, slots, k, v)
    return {"k": cache.k[0], "v": cache.v[0], "k_exp": cache.k_exp[0], "v_exp": cache.v_exp[0]}


def _write_fast(backend: str):
    def run(inputs: dict[str, Any]) -> dict[str, Any]:
        import torch

        from fast.kv import PagedKVCache, write_kv

        nb, bs, kv, d = inputs["shape"]
        dev = inputs["device"]
        cache = PagedKVCache(num_layers=1, num_blocks=nb, block_size=bs, num_kv_heads=kv, head_dim=d,
                             dtype=inputs["dtype"], device=dev)
        if cache.is_fp8:
            cache.k[0].copy_(torch.from_numpy(inputs["garbage"]["codes"][0]))
            cache.v[0].copy_(torch.from_numpy(inputs["garbage"]["codes"][1]))
            cache.k_exp[0].copy_(torch.from_numpy(inputs["garbage"]["exps"][0]))
            cache.v_exp[0].copy_(torch.from_numpy(inputs["garbage"]["exps"][1]))
        for slots, k, v in inputs["writes"]:
            write_kv(cache, 0, torch.from_numpy(slots).to(dev), torch.from_numpy(k).to(dev),
                     torch.from_numpy(v).to(dev), backend=backend)
        if not cache.is_fp8:
            return {"k": cache.k[0]}
        return {"k": cache.k[0], "v": cache.v[0], "k_exp": cache.k_exp[0], "v_exp": cache.v_exp[0]}

    return run


# -- attention ------------------------------------------------------------------------------
def _attention_inputs(dtype: str, small: tuple, large: tuple, bf16_query: bool = False):
    """Chunks (query_lens, starts) small/large; the cache holds positions [0, start + n) of each.

    Built once per (setup, scale, seed, device) and shared by the torch and Triton cases (attention
    only reads the cache), with an RNG seeded by the setup rather than the case name.
    """
    def frozen(sizes: tuple) -> tuple:
        return tuple(tuple(x) if isinstance(x, list) else x for x in sizes)

    def make(gen: Gen) -> dict[str, Any]:
        return _attention_setup(dtype, frozen(small), frozen(large), bf16_query, gen.large, gen.seed, str(gen.device))

    return make


@functools.lru_cache(maxsize=4)
def _attention_setup(dtype: str, small: tuple, large: tuple, bf16_query: bool, is_large: bool, seed: int,
                     device: str) -> dict[str, Any]:
    import torch

    from fast.kv import KVStep, PagedKVCache

    key = repr((dtype, small, large, bf16_query))
    gen = Gen(device=torch.device(device), large=is_large, rng=np.random.default_rng([seed, zlib.crc32(key.encode())]),
              seed=seed)
    query_lens, starts, kv, group, d, bs = gen.size(small, large)
    needs = [-(-(s + n) // bs) for s, n in zip(starts, query_lens, strict=True)]
    nb = sum(needs) + 2  # one spare block, and the padding block nb - 1 (never written)
    perm = gen.rng.permutation(nb - 1).tolist()
    tables = [perm[sum(needs[:i]):sum(needs[:i + 1])] for i in range(len(needs))]
    ref = KVCache(1, nb, bs, kv, d, "fp8" if dtype == "fp8" else "float32")
    used = np.zeros((nb, bs), bool)
    for t, s, n in zip(tables, starts, query_lens, strict=True):
        slots = ref.slots(t, 0, s + n)
        used.reshape(-1)[slots] = True
        heads_scale = np.exp2(gen.rng.integers(-2, 3, (1, kv, 1)))  # different fp8 scales per head
        k, v = (gen.rng.standard_normal((s + n, kv, d)) * heads_scale for _ in range(2))
        if dtype == "bfloat16":  # values a bf16 cache holds exactly
            k, v = (torch.from_numpy(a.astype(np.float32)).bfloat16().float().numpy() for a in (k, v))
        ref.write(0, slots, k.astype(np.float32), v.astype(np.float32))
    cache = PagedKVCache(num_layers=1, num_blocks=nb, block_size=bs, num_kv_heads=kv, head_dim=d, dtype=dtype,
                         device=gen.device)
    unused = torch.from_numpy(~used).to(gen.device)
    for store, src in ((cache.k[0], ref.k[0]), (cache.v[0], ref.v[0])):
        store.copy_(torch.from_numpy(src).to(store.dtype))
        store[unused] = 0x7F if dtype == "fp8" else float("nan")  # poison every unused slot
    if dtype == "fp8":
        cache.k_exp[0].copy_(torch.from_numpy(ref.k_exp[0]))
        cache.v_exp[0].copy_(torch.from_numpy(ref.v_exp[0]))
    step = KVStep.build(query_lens=query_lens, starts=starts, block_tables=tables, block_size=bs, num_blocks=nb,
                        device=gen.device, pad_block=nb - 1, max_blocks=max(needs) + 2)
    q = gen.rng.standard_normal((sum(query_lens), kv * group, d)).astype(np.float32)
    qt = torch.from_numpy(q).to(gen.device)
    if bf16_query:  # the output is bf16 too
        qt = qt.bfloat16()
        q = qt.float().cpu().numpy()
    return {"ref": ref, "tables": tables, "step": step, "cache": cache, "q": q, "qt": qt, "bf16": bf16_query,
            "scale": float(np.float32(1 / np.sqrt(d)))}


def _per_chunk(inputs: dict[str, Any]):
    """(rows, q, k, v, start) in float64 for every chunk, from the reference cache."""
    step, row = inputs["step"], 0
    for t, s, n in zip(inputs["tables"], step.starts, step.query_lens, strict=True):
        k, v = inputs["ref"].read(0, t, s + n)
        yield slice(row, row + n), inputs["q"][row:row + n].astype(np.float64), k.astype(np.float64), \
            v.astype(np.float64), s
        row += n


def _attention_reference(inputs: dict[str, Any]) -> np.ndarray:
    return np.concatenate([attention64(q, k, v, s) for _, q, k, v, s in _per_chunk(inputs)])


def _attention_allowed(inputs: dict[str, Any], ref: np.ndarray, bf16_products: bool = False) -> np.ndarray:
    allowed = np.empty_like(ref)
    d = ref.shape[-1]
    for rows, q, k, v, s in _per_chunk(inputs):
        n, heads, _ = q.shape
        length, kv, _ = k.shape
        qg = q.reshape(n, kv, heads // kv, d)
        abs_qk = np.einsum("nkgd,lkd->nkgl", np.abs(qg), np.abs(k))
        scores = np.einsum("nkgd,lkd->nkgl", qg, k) * inputs["scale"]
        causal = np.arange(length)[None, :] <= (s + np.arange(n))[:, None]  # [n, L]
        scores = np.where(causal[:, None, None, :], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        pv = np.einsum("nkgl,lkd->nkgd", p, np.abs(v))
        big_s = inputs["scale"] * np.where(causal[:, None, None, :], abs_qk, 0).max(-1, keepdims=True)
        factor = 2 * (d + 2) * U * big_s + 4 * length * U + 2.0**-20
        if bf16_products:  # scores rounded to bf16 (+ 2^-9 |s| each), then the weights (+ 2^-9 each)
            factor = np.expm1(2 * ((d + 2) * U + 2.0**-9) * big_s) + 4 * length * U + 2.0**-20 + 2.0**-9
        allowed[rows] = (factor * pv).reshape(n, heads, d) + 2.0**-140 + (2.0**-133 if bf16_products else 0.0)
    if inputs["bf16"]:  # rounding the float32 result o to bf16 (nearest even): at most 2^-8 |o|
        allowed += 2.0**-8 * (np.abs(ref) + allowed) + 2.0**-133
    return allowed


def _attention_allowed_bf16_products(inputs: dict[str, Any], ref: np.ndarray) -> np.ndarray:
    return _attention_allowed(inputs, ref, bf16_products=True)


def _attention_fast(kind: str, backend: str):
    def run(inputs: dict[str, Any]) -> Any:
        from fast.kv import ops

        fn = ops.decode_attention if kind == "decode" else ops.prefill_attention
        return fn(inputs["qt"], inputs["cache"], 0, inputs["step"], scale=inputs["scale"], backend=backend)

    return run


def _native_fast(kind: str, native: bool):
    """The CPU torch path with the C decode kernel (``fast/kv/attention_c.py``) on, or forced off."""
    def run(inputs: dict[str, Any]) -> Any:
        from fast.kv import attention_c, ops

        # the kernel's default path for the instruction set in force (conformance/isa.py sets it per case)
        want = {"UNFIRE_NATIVE_ATTENTION": "1" if native else "0", "UNFIRE_NATIVE_SIMD": "1"}
        old = {name: os.environ.get(name) for name in want}
        os.environ.update(want)
        try:
            if native and not attention_c.applies(inputs["qt"], inputs["cache"]):
                raise RuntimeError("the C decode attention does not take these inputs")
            fn = ops.decode_attention if kind == "decode" else ops.prefill_attention
            return fn(inputs["qt"], inputs["cache"], 0, inputs["step"], scale=inputs["scale"], backend="torch")
        finally:
            for name, value in old.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value

    return run


def _requires_native() -> str | None:
    from fast.kv import attention_c

    if attention_c.library() is None:
        return "no C compiler (or UNFIRE_NATIVE=0): the C decode attention is not built"
    return None


def _split_decode(inputs: dict[str, Any]) -> Any:
    """The Triton decode kernel with each sequence's blocks cut into 3 parts merged by the combine kernel."""
    from fast.kv import attention_triton

    return attention_triton.decode_attention(inputs["qt"], inputs["cache"], 0, inputs["step"], inputs["scale"],
                                             num_splits=3)


def _register_all() -> None:
    register(Case("kv.fp8_encode.bit_classes", Level.BIT_EXACT, _encode_inputs, _encode_reference, _encode_fast,
                  about="e4m3 codes of random float32 bit patterns at random scales: Triton and torch"))
    for backend in ("torch", "triton"):
        register(Case(f"kv.fp8_write.{backend}", Level.BIT_EXACT, _write_inputs("fp8"), _write_reference,
                      _write_fast(backend), about="fp8 cache codes and scales after multi-step writes with rescales"))
        register(Case(f"kv.write.bfloat16.{backend}", Level.BIT_EXACT, _write_inputs("bfloat16"), _write_reference,
                      _write_fast(backend), about="bf16 cache holds the values rounded to nearest even"))
    bound = Bound(BOUND_TEXT, _attention_allowed)
    bf16_bound = Bound(BF16_PRODUCTS_TEXT, _attention_allowed_bf16_products)
    # (query_lens, starts, kv_heads, group, head_dim, block_size), small (CPU) and large (GPU)
    # small head size 32: the smallest the CPU's AMX path takes (the C kernel's other paths take 16 too)
    decode = (([1, 1, 1], [0, 17, 40], 2, 2, 32, 16),
              ([1] * 64, [int(x) for x in np.linspace(0, 1000, 64)], 3, 3, 64, 16))
    prefill = (([5, 1, 20], [0, 33, 7], 2, 2, 32, 16),
               ([256, 1, 1, 128, 512, 37], [0, 300, 5, 1000, 64, 700], 3, 3, 64, 16))
    register(Case("kv.decode_attention.split_kv.fp8.triton", Level.BOUNDED, _attention_inputs("fp8", *decode),
                  _attention_reference, _split_decode, bound=bound,
                  about="split-KV decode (3 parts per sequence, some empty), fp8 cache, vs float64"))
    long_decode = ([1] * 4, [4095, 1, 2048, 3000], 8, 4, 128, 16)
    setups = [("decode", decode, False, False), ("prefill", prefill, False, False)]
    setups += [(kind, sizes, True, False) for kind, sizes in (("decode", decode), ("prefill", prefill))]
    setups.append(("decode", (long_decode, long_decode), False, True))
    for dtype in ("float32", "bfloat16", "fp8"):
        for kind, (small, large), bf16_query, long in setups:
            if (bf16_query and dtype == "float32") or (long and dtype == "bfloat16"):
                continue
            label = "long_context." if long else "bf16_query." if bf16_query else ""
            about = (f"paged {kind} attention, {dtype} cache, unused slots NaN, vs float64"
                     + (", bf16 queries and output" if bf16_query else "")
                     + (", up to 4096 positions, 32 heads on 8 kv heads" if long else ""))
            make = _attention_inputs(dtype, small, large, bf16_query)  # shared by both backends (cached)
            for backend in ("torch", "triton"):
                # the torch path multiplies bf16 queries in bf16 (scores, weights rounded), decode and prefill
                products = bf16_query and backend == "torch"
                register(Case(f"kv.{kind}_attention.{label}{dtype}.{backend}", Level.BOUNDED, make,
                              _attention_reference, _attention_fast(kind, backend),
                              bound=bf16_bound if products else bound, large_only=long,
                              about=about))
            if bf16_query and dtype == "bfloat16":  # the CPU path's two ways for one-token rows
                for name in isa.isas():  # the C kernel under every instruction set of this architecture
                    register(Case(f"kv.{kind}_attention.{label}{dtype}.native.{name}", Level.BOUNDED, make,
                                  _attention_reference, isa.under(name, _native_fast(kind, True)),
                                  bound=bound if kind == "decode" else bf16_bound,  # prefill chunks: bf16 products
                                  requires=isa.requires(name, _requires_native),
                                  about=about + f"; rows by the C kernel (CPU), UNFIRE_CPU_ISA={name}"))
                register(Case(f"kv.{kind}_attention.{label}{dtype}.torch_gather", Level.BOUNDED, make,
                              _attention_reference, _native_fast(kind, False), bound=bf16_bound,
                              about=about + "; the C kernel off (gather + bf16 products)"))

_register_all()
