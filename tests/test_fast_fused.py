"""The fused C RoPE + cache write of the bf16 model (fast/engine/fused.py): torch's bits, both loop sets, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fast.engine import fused
from fast.engine.model import apply_rope, signed
from fast.errors import KernelInputError
from fast.kv import PagedKVCache

pytestmark = pytest.mark.skipif(fused.library() is None, reason="no C compiler: fused ops not built")
SIMD = ["1", "0"]


def _cache(kv: int, d: int, blocks: int = 8, block_size: int = 4) -> PagedKVCache:
    cache = PagedKVCache(num_layers=2, num_blocks=blocks, block_size=block_size, num_kv_heads=kv, head_dim=d,
                         dtype="bfloat16")
    for t in (*cache.k, *cache.v):
        t.fill_(float("nan"))  # every slot not written must stay NaN
    return cache


@pytest.mark.parametrize("simd", SIMD)
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 20), heads_kv=st.sampled_from([(1, 1), (4, 2), (9, 3)]), d=st.sampled_from([2, 16, 48, 64]),
       seed=st.integers(0, 2**16))
def test_rope_write_is_torch_bit_for_bit(simd: str, n: int, heads_kv: tuple[int, int], d: int, seed: int) -> None:
    """q, k rotated and k, v stored exactly as the torch lines of the model do it; no other slot touched."""
    heads, kv = heads_kv
    gen = torch.Generator().manual_seed(seed)
    cache = _cache(kv, d)
    qkv = (torch.randn((n, (heads + 2 * kv) * d), generator=gen) * 4).bfloat16()
    cos, sin = torch.randn((40, d), generator=gen), signed(torch.randn((40, d), generator=gen))
    positions = torch.randint(0, 40, (n,), generator=gen)
    slots = torch.randperm(32, generator=gen)[:n]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UNFIRE_NATIVE_SIMD", simd)
        q = fused.rope_write(qkv, cos, sin, positions, slots, cache, 1, heads)
    qk = apply_rope(qkv[:, :(heads + kv) * d].reshape(n, heads + kv, d).float(), cos[positions], sin[positions])
    assert torch.equal(q, qk[:, :heads].bfloat16())
    flat_k, flat_v = cache.k[1].view(-1, kv, d), cache.v[1].view(-1, kv, d)
    assert torch.equal(flat_k[slots], qk[:, heads:].bfloat16())
    assert torch.equal(flat_v[slots], qkv[:, (heads + kv) * d:].reshape(n, kv, d))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()
    assert cache.k[0].isnan().all()  # another layer


def test_simd_and_plain_loops_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn((33, 15 * 64), generator=gen).bfloat16()
    cos, sin = torch.randn((64, 64), generator=gen), torch.randn((64, 64), generator=gen)
    positions, slots = torch.randint(0, 64, (33,), generator=gen), torch.randperm(64, generator=gen)[:33]
    outs = []
    for simd in ("1", "0"):
        monkeypatch.setenv("UNFIRE_NATIVE_SIMD", simd)
        cache = _cache(3, 64, blocks=16)
        q = fused.rope_write(qkv, cos, sin, positions, slots, cache, 0, 9)
        outs.append((q, cache.k[0].clone(), cache.v[0].clone()))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_bad_input_is_refused() -> None:
    """Positions past the RoPE tables, slots past the cache, wrong dtypes and shapes: errors naming them."""
    cache = _cache(1, 16)
    qkv = torch.zeros((2, 3 * 16), dtype=torch.bfloat16)
    cos = sin = torch.zeros((10, 16))
    ok = torch.tensor([0, 1])
    with pytest.raises(KernelInputError, match="position"):
        fused.rope_write(qkv, cos, sin, torch.tensor([0, 10]), ok, cache, 0, 1)
    with pytest.raises(KernelInputError, match="slot"):
        fused.rope_write(qkv, cos, sin, ok, torch.tensor([0, 32]), cache, 0, 1)
    with pytest.raises(KernelInputError, match="slot"):
        fused.rope_write(qkv, cos, sin, ok, torch.tensor([-1, 0]), cache, 0, 1)
    with pytest.raises(KernelInputError, match="width"):
        fused.rope_write(qkv, cos, sin, ok, ok, cache, 0, 2)
    with pytest.raises(KernelInputError, match="int64"):
        fused.rope_write(qkv, cos, sin, ok.int(), ok, cache, 0, 1)
    with pytest.raises(KernelInputError, match="layer"):
        fused.rope_write(qkv, cos, sin, ok, ok, cache, 5, 1)


def test_bf16_engine_runs_them_and_generates_what_the_torch_lines_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast engine in bf16 takes the fused RoPE write (switched off, its torch lines) with the same greedy
    tokens, bit for bit."""
    from fast.engine import Engine, FastModel, TorchLlama
    from reference.engine import SamplingParams
    from tests.tiny_llama import CONFIG, tiny_weights

    monkeypatch.setenv("UNFIRE_NATIVE_SIMD", "0")  # the plain loops: taken on any CPU
    calls = []
    real = fused.rope_write

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused, "rope_write", counted)
    prompts = [list(range(1, 30)), [7] * 5, list(range(40, 80))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    options = dict(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_num_seqs=3)
    outputs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("UNFIRE_NATIVE_FUSED", flag)
        engine = Engine(FastModel(TorchLlama(CONFIG, tiny_weights(), dtype="bfloat16")), **options)
        outputs[flag] = [o.output_token_ids for o in engine.generate(prompts, params)]
        if flag == "1":
            assert len(calls) >= 2 * 12  # every step, both layers
            calls_on = len(calls)
    assert len(calls) == calls_on  # switched off: never called
    assert outputs["1"] == outputs["0"]
