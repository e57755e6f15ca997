"""The C decode attention (fast/kv/attention_c.py): float64 agreement, both loop sets, bad steps, fallback."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fast.errors import KernelInputError
from fast.kv import KVStep, PagedKVCache, attention_c
from fast.kv import attention_torch as at

pytestmark = pytest.mark.skipif(attention_c.library() is None, reason="no C compiler: kernel not built")


def _setup(lengths: list[int], kv: int, group: int, d: int, block_size: int, seed: int):
    """A bf16 cache whose unused slots hold NaN, shuffled block tables, bf16 queries, and the float64 answer."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + 2
    cache = PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=kv, head_dim=d,
                         dtype="bfloat16")
    cache.k[0].fill_(float("nan"))
    cache.v[0].fill_(float("nan"))
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at_id = [], 0
    for n in need:
        tables.append(ids[at_id:at_id + n])
        at_id += n
    q = torch.randn((len(lengths), kv * group, d), generator=gen).bfloat16()
    scale = d ** -0.5
    want = []
    for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        k = torch.randn((n, kv, d), generator=gen).bfloat16()
        v = torch.randn((n, kv, d), generator=gen).bfloat16()
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        cache.write(0, slots, k, v)
        qi = q[i].double().view(kv, group, d)
        s = torch.einsum("kgd,lkd->kgl", qi, k.double()) * scale
        p = torch.softmax(s, dim=-1)
        want.append(torch.einsum("kgl,lkd->kgd", p, v.double()).reshape(kv * group, d))
    step = KVStep.build(query_lens=[1] * len(lengths), starts=[n - 1 for n in lengths], block_tables=tables,
                        block_size=block_size, num_blocks=num_blocks)
    return cache, step, q, scale, torch.stack(want)


def _run(cache: PagedKVCache, step: KVStep, q: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    every = torch.arange(step.num_chunks)
    assert attention_c.decode_rows(q, cache, 0, step, every, every, scale, out)
    return out


@pytest.mark.parametrize("simd", ["1", "3", "2", "0"])
@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=6), shape=st.sampled_from(
    [(1, 1, 16), (2, 2, 16), (3, 3, 64), (2, 5, 32), (1, 17, 16), (1, 17, 32), (8, 4, 128)]),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16))
def test_matches_float64(simd: str, lengths: list[int], shape: tuple[int, int, int], block_size: int,
                         seed: int) -> None:
    """Within one bf16 rounding (2^-8 relative) plus float32 summation of the float64 result, NaN slots unread."""
    kv, group, d = shape
    cache, step, q, scale, want = _setup(lengths, kv, group, d, block_size, seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UNFIRE_NATIVE_SIMD", simd)
        got = _run(cache, step, q, scale).double()
    assert torch.isfinite(got).all()
    assert ((got - want).abs() <= 2.0**-8 * want.abs() + 1e-5).all(), float((got - want).abs().max())


@pytest.mark.parametrize("d", [16, 32, 64, 128, 48])
def test_simd_and_plain_loops_agree(monkeypatch: pytest.MonkeyPatch, d: int) -> None:
    """The four paths (AMX where the CPU has it, AVX-512 BF16, AVX-512 float32, plain C) give one answer within one
    bf16 step."""
    cache, step, q, scale, _ = _setup([200, 33, 1, 129, 17], 3, 3, d, 16, 7)
    outs = []
    for simd in ("1", "3", "2", "0"):
        monkeypatch.setenv("UNFIRE_NATIVE_SIMD", simd)
        outs.append(_run(cache, step, q, scale).float())
    for other in outs[:3]:
        assert ((other - outs[3]).abs() <= 2.0**-7 * outs[3].abs() + 1e-6).all()  # one bf16 step at most


def test_decode_attention_uses_it_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path's entry point takes the kernel for bf16 on a CPU; switched off, the gather path answers
    within the looser bf16-products tolerance."""
    monkeypatch.setenv("UNFIRE_NATIVE_SIMD", "0")  # usable on any CPU
    cache, step, q, scale, want = _setup([50, 7, 120], 2, 4, 32, 16, 3)
    native = at.decode_attention(q, cache, 0, step, scale)
    assert torch.equal(native, _run(cache, step, q, scale))
    monkeypatch.setenv("UNFIRE_NATIVE_ATTENTION", "0")
    assert not attention_c.applies(q, cache)
    gathered = at.decode_attention(q, cache, 0, step, scale).double()
    assert ((gathered - want).abs() <= 2.0**-6 * (want.abs() + 1)).all()


def test_bad_steps_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block id outside the cache or a length past the table is an error naming it, not a read out of bounds."""
    monkeypatch.setenv("UNFIRE_NATIVE_SIMD", "0")
    cache, step, q, scale, _ = _setup([20, 5], 1, 2, 16, 4, 1)
    step.block_tables[0, 1] = cache.num_blocks + 5
    with pytest.raises(KernelInputError, match="block id"):
        _run(cache, step, q, scale)
    cache, step, q, scale, _ = _setup([20, 5], 1, 2, 16, 4, 1)
    step.seq_lens[1] = 10_000
    with pytest.raises(KernelInputError, match="length"):
        _run(cache, step, q, scale)


def test_not_taken_for_other_dtypes() -> None:
    cache, _, q, _, _ = _setup([3], 1, 2, 16, 4, 0)
    assert not attention_c.applies(q.float(), cache)
    fp32 = PagedKVCache(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=16, dtype="float32")
    assert not attention_c.applies(q, fp32)
    odd = PagedKVCache(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=24, dtype="bfloat16")
    assert not attention_c.applies(torch.zeros((1, 2, 24), dtype=torch.bfloat16), odd)


def test_rows_split_between_threads_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With two torch threads the rows are shared by two calls (the GIL released); each row is computed alike."""
    monkeypatch.setenv("UNFIRE_NATIVE_SIMD", "0")
    cache, step, q, scale, _ = _setup([(i * 37) % 90 + 1 for i in range(24)], 2, 2, 16, 4, 5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(cache, step, q, scale)
        torch.set_num_threads(2)
        two = _run(cache, step, q, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bf16_engine_decodes_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast engine's bf16 decode steps take the kernel, and generate what the gather path generates."""
    from tests.tiny_llama import bf16_outputs_on_and_off

    outputs, on, _ = bf16_outputs_on_and_off(monkeypatch, attention_c, "decode_rows", "UNFIRE_NATIVE_ATTENTION")
    assert on >= 2 * 11  # every decode step, both layers
    assert all(len(o) == 12 for o in outputs["1"])
    same = sum(a == b for x, y in zip(outputs["1"], outputs["0"], strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 30  # of 36: float32 vs bf16-rounded scores may flip a near tie on random weights


@pytest.mark.parametrize("simd", ["1", "3", "2", "0"])
@settings(max_examples=10, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), min_size=1, max_size=4),
       shape=st.sampled_from([(1, 2, 16), (3, 3, 64), (2, 2, 32)]), block_size=st.sampled_from([1, 16]),
       seed=st.integers(0, 2**16))
def test_prefill_rows_are_causal(simd: str, chunks: list[tuple[int, int]], shape: tuple[int, int, int],
                                 block_size: int, seed: int) -> None:
    """Prefill chunks (a cached prefix of ``start`` tokens, then ``n`` new ones) through the kernel, each row up to
    its own position: the float64 causal answer within the decode rows' bound; slots past each length hold NaN."""
    kv, group, d = shape
    lengths = [start + n for start, n in chunks]
    cache, whole, _, scale, _ = _setup(lengths, kv, group, d, block_size, seed)
    tables = whole.block_tables.tolist()
    gen = torch.Generator().manual_seed(seed + 1)
    step = KVStep.build(query_lens=[n for _, n in chunks], starts=[s for s, _ in chunks], block_tables=tables,
                        block_size=block_size, num_blocks=cache.num_blocks)
    q = torch.randn((step.num_tokens, kv * group, d), generator=gen).bfloat16()
    want, row = [], 0
    for (start, n), table in zip(chunks, tables, strict=True):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(start + n)])
        k = cache.k[0].view(-1, kv, d)[slots].double()
        v = cache.v[0].view(-1, kv, d)[slots].double()
        for j in range(n):
            qi = q[row + j].double().view(kv, group, d)
            s = torch.einsum("kgd,lkd->kgl", qi, k[:start + j + 1]) * scale
            want.append(torch.einsum("kgl,lkd->kgd", torch.softmax(s, -1), v[:start + j + 1]).reshape(kv * group, d))
        row += n
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UNFIRE_NATIVE_SIMD", simd)
        got = at.prefill_attention(q, cache, 0, step, scale).double()
    want_t = torch.stack(want)
    assert torch.isfinite(got).all()
    assert ((got - want_t).abs() <= 2.0**-8 * want_t.abs() + 1e-5).all(), float((got - want_t).abs().max())


def test_row_lengths_past_the_sequence_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A per-row length beyond its sequence's (or a malformed lengths tensor) is refused, never read past."""
    monkeypatch.setenv("UNFIRE_NATIVE_SIMD", "0")
    cache, step, q, scale, _ = _setup([20, 5], 1, 2, 16, 4, 1)
    every = torch.arange(2)
    out = torch.empty_like(q)
    with pytest.raises(KernelInputError, match="length"):
        attention_c.decode_rows(q, cache, 0, step, every, every, scale, out,
                                     torch.tensor([20, 6], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="int32"):
        attention_c.decode_rows(q, cache, 0, step, every, every, scale, out, torch.tensor([20, 5]))


@pytest.mark.parametrize("simd", ["1", "3", "0"])
@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(1, 80), min_size=1, max_size=4), shape=st.sampled_from(
    [(3, 3, 64), (2, 5, 32), (1, 17, 32), (8, 4, 128), (2, 2, 16)]), block_size=st.sampled_from([1, 4, 16]),
    cut=st.integers(0, 79), seed=st.integers(0, 2**16))
def test_a_row_has_the_same_bits_wherever_it_is_computed(simd: str, lengths: list[int], shape: tuple[int, int, int],
                                                        block_size: int, cut: int, seed: int) -> None:
    """Every position of every sequence computed three ways, over a cache whose unused slots (and the kernel's
    scratch) hold NaN: in one prefill chunk per sequence; each row alone (a step of one-row chunks, as a chunk's
    last token may be; the last rows also as a decode step computes them); and a mixed step (each sequence's rows
    from ``cut`` on as a chunk beside the rows before it as one-row chunks, and threads splitting the rows). The
    same bits every way: chunking, prefix caching, preemption and the P/D and pipelined topologies rely on it (the
    AMX path puts up to 16 rows' heads in one tile product)."""
    kv, group, d = shape
    cache, whole, _, scale, _ = _setup(lengths, kv, group, d, block_size, seed)
    tables = whole.block_tables.tolist()
    total = sum(lengths)
    q = torch.randn((total, kv * group, d), generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    cache.scratch["native.scores"] = torch.full((1 << 22,), float("nan"))  # the kernel's scratch poisoned too
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UNFIRE_NATIVE_SIMD", simd)
        chunked = at.prefill_attention(q, cache, 0, KVStep.build(
            query_lens=lengths, starts=[0] * len(lengths), block_tables=tables, block_size=block_size,
            num_blocks=cache.num_blocks), scale)
        starts = [p for n in lengths for p in range(n)]
        alone_step = KVStep.build(query_lens=[1] * total, starts=starts,
                                  block_tables=[tables[i] for i, n in enumerate(lengths) for _ in range(n)],
                                  block_size=block_size, num_blocks=cache.num_blocks)
        every = torch.arange(total)
        alone = torch.full_like(q, float("nan"))
        assert attention_c.decode_rows(q, cache, 0, alone_step, every, every, scale, alone,
                                       torch.tensor([s + 1 for s in starts], dtype=torch.int32))
        last = torch.tensor(lengths).cumsum(0) - 1  # each sequence's last row, as a decode step computes it
        decode = torch.full_like(q, float("nan"))
        chunks = torch.arange(len(lengths))
        assert attention_c.decode_rows(q, cache, 0, whole, chunks, last, scale, decode)
        query_lens, mixed_starts, mixed_tables = [], [], []
        for i, n in enumerate(lengths):
            c = min(cut, n - 1)
            for pos in range(c):  # one-row chunks first, then the rest of the sequence as one chunk
                query_lens.append(1), mixed_starts.append(pos), mixed_tables.append(tables[i])
            query_lens.append(n - c), mixed_starts.append(c), mixed_tables.append(tables[i])
        mixed_step = KVStep.build(query_lens=query_lens, starts=mixed_starts, block_tables=mixed_tables,
                                  block_size=block_size, num_blocks=cache.num_blocks)
        torch.set_num_threads(2)
        try:
            chunk, rows, lens, longest = at.row_layout(mixed_step)
            mixed = torch.full_like(q, float("nan"))
            assert attention_c.decode_rows(q, cache, 0, mixed_step, chunk, rows, scale, mixed, lens, longest)
        finally:
            torch.set_num_threads(1)
    assert torch.isfinite(chunked).all()
    assert torch.equal(chunked, alone) and torch.equal(chunked, mixed)
    assert torch.equal(chunked[last], decode[last])


def test_amx_path_is_taken_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where AMX is there the default path is the tile products' (=3 the AVX-512 BF16 loops'), and both meet the
    float64 answer; a head size the tiles do not take (16) falls back to the loops."""
    cache, step, q, scale, want = _setup([300, 17, 64], 3, 3, 64, 16, 11)
    paths = {}
    for simd in ("1", "3"):
        monkeypatch.setenv("UNFIRE_NATIVE_SIMD", simd)
        got = _run(cache, step, q, scale)
        paths[simd] = attention_c.last_path()
        assert ((got.double() - want).abs() <= 2.0**-8 * want.abs() + 1e-5).all()
    if not attention_c.has_simd():
        pytest.skip("no AVX-512 on this CPU")
    assert paths == {"1": "amx" if attention_c.has_amx() else "avx512-bf16", "3": "avx512-bf16"}
    cache, step, q, scale, _ = _setup([40], 1, 2, 16, 16, 1)
    monkeypatch.setenv("UNFIRE_NATIVE_SIMD", "1")
    _run(cache, step, q, scale)
    assert attention_c.last_path() == "avx512-bf16"
