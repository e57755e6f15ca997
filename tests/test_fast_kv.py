"""fast.kv against the reference cache: fp8 bytes and scales bit for bit, attention within float error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fast.kv import KVStep, PagedKVCache, decode_attention, fp8_torch, paged_attention, prefill_attention
from reference.kv import fp8
from reference.kv.cache import KVCache
from reference.kv.errors import KVCacheError
from reference.model.llama import attention as reference_attention

KV, D, BS = 2, 8, 4


def _pair(dtype: str, num_blocks: int = 12) -> tuple[KVCache, PagedKVCache]:
    ref = KVCache(1, num_blocks, BS, KV, D, "fp8" if dtype == "fp8" else "float32")
    fast = PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=BS, num_kv_heads=KV, head_dim=D, dtype=dtype)
    return ref, fast


def _same_store(ref: KVCache, fast: PagedKVCache) -> None:
    for r, f in ((ref.k[0], fast.k[0]), (ref.v[0], fast.v[0])):
        assert np.array_equal(r.view(np.uint8), f.numpy().view(np.uint8))
    if fast.is_fp8:
        assert np.array_equal(ref.k_exp[0], fast.k_exp[0].numpy())
        assert np.array_equal(ref.v_exp[0], fast.v_exp[0].numpy())


def _values(rng: np.random.Generator, n: int, spread: int) -> np.ndarray:
    x = rng.standard_normal((n, KV, D)) * np.exp2(rng.integers(-spread, spread + 1, (n, KV, 1)))
    x = x.astype(np.float32)
    if n and rng.random() < 0.3:
        x.flat[rng.integers(x.size)] = rng.choice([np.nan, np.inf, -np.inf, -0.0, 1e-42])
    return x


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), spread=st.sampled_from([0, 3, 40]))
def test_fp8_writes_equal_the_reference_bytes(seed: int, spread: int) -> None:
    """Sequences fill blocks over several steps (prefill, then decode tokens), scales grow: same bytes."""
    rng = np.random.default_rng(seed)
    ref, fast = _pair("fp8")
    lengths = [0, 0, 0]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    for _ in range(5):
        chunk = [int(rng.integers(1, 6)) for _ in lengths]
        chunk = [min(n, 3 * BS - length) for n, length in zip(chunk, lengths, strict=True)]
        slots = np.concatenate([ref.slots(t, s, n) for t, s, n in zip(tables, lengths, chunk, strict=True)])
        k, v = _values(rng, len(slots), spread), _values(rng, len(slots), spread)
        ref.write(0, slots, k, v)
        fast.write(0, torch.from_numpy(slots), torch.from_numpy(k), torch.from_numpy(v))
        lengths = [s + n for s, n in zip(lengths, chunk, strict=True)]
        _same_store(ref, fast)


def test_torch_fp8_codec_matches_reference_on_every_bit_class() -> None:
    rng = np.random.default_rng(1)
    x = rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    e = rng.integers(-126, 121, x.size)
    assert np.array_equal(fp8.encode(x, e), fp8_torch.encode(torch.from_numpy(x), torch.from_numpy(e)).numpy())
    a = np.abs(x)
    assert np.array_equal(fp8.scale_exponent(a), fp8_torch.scale_exponent(torch.from_numpy(a)).numpy())


def _step_and_fill(dtype: str, query_lens: list[int], starts: list[int], seed: int, poison: bool = True):
    """A cache holding every position [0, start + n) of each chunk (written in one go), both sides."""
    rng = np.random.default_rng(seed)
    nb = sum(-(-(s + n) // BS) for s, n in zip(starts, query_lens, strict=True)) + 2
    ref, fast = _pair(dtype, nb)
    if poison:  # unused slots hold NaN (fp8: code 0x7F), so a read past the end shows
        fast.k[0].fill_(0x7F if dtype == "fp8" else float("nan"))
        fast.v[0].fill_(0x7F if dtype == "fp8" else float("nan"))
    perm = rng.permutation(nb - 1)  # block nb - 1 stays unused (padding points at it)
    tables, used = [], 0
    for s, n in zip(starts, query_lens, strict=True):
        need = -(-(s + n) // BS)
        tables.append([int(b) for b in perm[used:used + need]])
        used += need
    for t, s, n in zip(tables, starts, query_lens, strict=True):
        slots = ref.slots(t, 0, s + n)
        k, v = _values(rng, s + n, 2), _values(rng, s + n, 2)
        k[~np.isfinite(k)] = 1.0
        v[~np.isfinite(v)] = 1.0
        if dtype == "bfloat16":  # the reference stores what a bf16 cache can hold
            k, v = (torch.from_numpy(a).bfloat16().float().numpy() for a in (k, v))
        ref.write(0, slots, k, v)
        fast.write(0, torch.from_numpy(slots), torch.from_numpy(k), torch.from_numpy(v))
    step = KVStep.build(query_lens=query_lens, starts=starts, block_tables=tables, block_size=BS, num_blocks=nb,
                        pad_block=nb - 1, max_blocks=max(map(len, tables)) + 1)
    return ref, fast, step, tables, rng


def _expected(ref: KVCache, q: np.ndarray, step: KVStep, tables: list[list[int]]) -> np.ndarray:
    out, row = [], 0
    for t, s, n in zip(tables, step.starts, step.query_lens, strict=True):
        k, v = ref.read(0, t, s + n)
        out.append(reference_attention(q[row:row + n].astype(np.float64), k.astype(np.float64),
                                       v.astype(np.float64), s))
        row += n
    return np.concatenate(out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("query_lens,starts", [([1, 1, 1], [0, 5, 9]), ([3, 1, 6], [0, 7, 4]), ([5], [0])])
def test_torch_attention_matches_reference(dtype: str, query_lens: list[int], starts: list[int]) -> None:
    ref, fast, step, tables, rng = _step_and_fill(dtype, query_lens, starts, seed=len(query_lens) + starts[-1])
    q = rng.standard_normal((step.num_tokens, 2 * KV, D)).astype(np.float32)
    got = paged_attention(torch.from_numpy(q), fast, 0, step, backend="torch").numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _expected(ref, q, step, tables), rtol=1e-5, atol=1e-5)


def test_prefill_kernel_handles_a_decode_step_too() -> None:
    _, fast, step, _, rng = _step_and_fill("float32", [1, 1], [3, 8], seed=3)
    q = torch.from_numpy(rng.standard_normal((2, 2 * KV, D)).astype(np.float32))
    a = decode_attention(q, fast, 0, step, backend="torch")
    b = prefill_attention(q, fast, 0, step, backend="torch")
    torch.testing.assert_close(a, b)


def test_bad_steps_raise_clear_errors() -> None:
    with pytest.raises(KVCacheError, match="chunk 1: positions up to 8 need 3 blocks"):
        KVStep.build(query_lens=[1, 2], starts=[0, 7], block_tables=[[0], [1, 2]], block_size=BS, num_blocks=4)
    with pytest.raises(KVCacheError, match="outside"):
        KVStep.build(query_lens=[1], starts=[0], block_tables=[[9]], block_size=BS, num_blocks=4)
    with pytest.raises(KVCacheError, match="one entry per chunk"):
        KVStep.build(query_lens=[1], starts=[0, 1], block_tables=[[0]], block_size=BS, num_blocks=4)
    _, fast = _pair("fp8")
    step = KVStep.build(query_lens=[2], starts=[0], block_tables=[[0]], block_size=BS, num_blocks=12)
    with pytest.raises(ValueError, match="one token per chunk"):
        decode_attention(torch.zeros(2, KV, D), fast, 0, step)
    with pytest.raises(ValueError, match="q must be"):
        prefill_attention(torch.zeros(2, 3, D), fast, 0, step)
    with pytest.raises(ValueError, match="backend must be"):
        prefill_attention(torch.zeros(2, KV, D), fast, 0, step, backend="cuda")
    with pytest.raises(ValueError, match="k must be"):
        fast.write(0, step.slots, torch.zeros(2, KV, D + 1), torch.zeros(2, KV, D))


@settings(max_examples=30, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 20)), min_size=1, max_size=4),
       dtype=st.sampled_from(["float32", "bfloat16", "fp8"]), seed=st.integers(0, 2**16))
def test_torch_attention_matches_reference_on_random_steps(chunks: list[tuple[int, int]], dtype: str,
                                                           seed: int) -> None:
    """Any mix of decode tokens and prefill pieces over any prefix, unused slots NaN: float64 agreement."""
    query_lens, starts = [n for n, _ in chunks], [s for _, s in chunks]
    ref, fast, step, tables, rng = _step_and_fill(dtype, query_lens, starts, seed=seed)
    q = rng.standard_normal((step.num_tokens, 2 * KV, D)).astype(np.float32)
    got = paged_attention(torch.from_numpy(q), fast, 0, step, backend="torch").numpy()
    np.testing.assert_allclose(got, _expected(ref, q, step, tables), rtol=2e-5, atol=2e-5)


def test_copy_block_and_read_match_the_reference() -> None:
    """Copy-on-write copies codes and scales; ``read`` returns what the reference's ``read`` does."""
    rng = np.random.default_rng(5)
    ref, fast = _pair("fp8")
    slots = ref.slots([2, 7], 0, 6)
    k, v = _values(rng, 6, 5), _values(rng, 6, 5)
    ref.write(0, slots, k, v)
    fast.write(0, torch.from_numpy(slots), torch.from_numpy(k), torch.from_numpy(v))
    ref.copy_block(7, 9)
    fast.copy_block(7, 9)
    _same_store(ref, fast)
    for got, want in zip(fast.read(0, [2, 9], 6), ref.read(0, [2, 9], 6), strict=True):
        np.testing.assert_array_equal(got.numpy(), want)
    with pytest.raises(KVCacheError, match="needs 2 blocks"):
        fast.read(0, [2], 6)


def _padded_cost(lengths: list[int], groups: list[list[int]], cost: int) -> int:
    return sum(len(g) * -(-max(lengths[i] for i in g) // BS) * BS + cost for g in groups)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=7), cost=st.sampled_from([0, 5, 30, 1000]))
def test_length_groups_partition_optimally(lengths: list[int], cost: int) -> None:
    """Groups partition the indices, shortest first, and no split into contiguous runs of the sorted
    lengths pads fewer positions (brute force over every cut set)."""
    from itertools import combinations

    from fast.kv.attention_torch import length_groups

    groups = length_groups(lengths, BS, cost)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = min(_padded_cost(lengths, [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)), strict=True)],
                            cost)
               for r in range(len(order)) for cuts in combinations(range(1, len(order)), r))
    assert _padded_cost(lengths, groups, cost) == best


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("bf16_query", [False, True])
def test_decode_in_many_length_groups_matches_reference(monkeypatch: pytest.MonkeyPatch, dtype: str,
                                                        bf16_query: bool) -> None:
    """With no cost per batch every distinct length is its own batch: rows land where they belong,
    and a mixed step's one-token chunks (batched) sit next to its prefill chunks."""
    from fast.kv import attention_torch

    monkeypatch.setattr(attention_torch, "BATCH_COST_POSITIONS", 0)
    for query_lens, starts in (([1] * 6, [30, 0, 17, 3, 30, 9]), ([1, 4, 1, 1, 3], [22, 0, 2, 13, 5])):
        ref, fast, step, tables, rng = _step_and_fill(dtype, query_lens, starts, seed=len(query_lens))
        q = torch.from_numpy(rng.standard_normal((step.num_tokens, 2 * KV, D)).astype(np.float32))
        if bf16_query:
            q = q.bfloat16()
        got = paged_attention(q, fast, 0, step, backend="torch").float().numpy()
        want = _expected(ref, q.float().numpy(), step, tables)
        tol = 3e-2 if bf16_query else 2e-5  # bf16 products and output (conformance bounds them exactly)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
        batches = step.memo["decode"] if step.is_decode else step.memo["prefill"][0]
        assert len(batches) > 1


@pytest.mark.parametrize("with_nan", [False, True])
def test_bf16_store_rounding_equals_the_reference_on_every_bit_class(with_nan: bool) -> None:
    """Both branches of ``to_store`` (torch's cast when there is no NaN, integer rounding otherwise)
    give ``reference.bf16.float32_to_bf16``'s bits: ties, subnormals, infinities, NaN payloads."""
    from fast.kv.cache import to_store
    from reference.bf16 import float32_to_bf16

    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    bits[:1000] = (bits[:1000] & 0xFFFF0000) | 0x8000  # exact ties
    x = bits.view(np.float32)
    x = x if with_nan else x[~np.isnan(x)]
    assert np.isnan(x).any() == with_nan
    got = to_store(torch.from_numpy(x.copy()), torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got, np.asarray(float32_to_bf16(x)).view(np.uint16))
