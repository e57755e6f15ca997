"""The fast engine's CPU speed-ups change no result: packed weights, the fused RoPE, reused attention scratch."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from fast.engine.elementwise_torch import apply_rope, signed  # noqa: E402
from fast.engine.linear import DenseLinear, cpu_packed  # noqa: E402
from fast.kv import KVStep, PagedKVCache, decode_attention  # noqa: E402
from reference.model.rope import apply_rope as reference_rope  # noqa: E402
from reference.model.rope import inverse_frequencies, rope_tables  # noqa: E402


@pytest.fixture
def onednn(monkeypatch: pytest.MonkeyPatch):
    """The engine's products without the tile products (UNFIRE_TILE_MATMUL=0): oneDNN's packed weights."""
    from fast.engine import linear

    monkeypatch.setenv("UNFIRE_TILE_MATMUL", "0")
    linear.tile_products.cache_clear()
    yield
    linear.tile_products.cache_clear()


@pytest.mark.parametrize("shape", [(96, 64), (200, 576), (64, 1536)])
def test_packed_weights_give_f_linear_bit_for_bit(shape: tuple[int, int], onednn: None) -> None:
    gen = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)
    lin = DenseLinear(w)
    assert lin.tiles is None
    if lin.packed is None:
        pytest.skip("oneDNN packing is unavailable on this CPU (DenseLinear serves F.linear)")
    for rows in (1, 7, 64, 300):
        x = torch.randn((rows, shape[1]), generator=gen).to(torch.bfloat16)
        assert torch.equal(lin(x), F.linear(x, w)), rows


def test_only_bf16_cpu_weights_are_packed() -> None:
    w = torch.randn(32, 16)
    assert cpu_packed(w) is None  # float32 goes to MKL, whose packed form is not bit-identical
    assert DenseLinear(w, pack=False).packed is None
    x = torch.randn(3, 16)
    assert torch.equal(DenseLinear(w)(x), F.linear(x, w))


def test_rope_equals_the_reference_bit_for_bit() -> None:
    d = 64
    inv = inverse_frequencies(d, 10000.0, None, None)
    positions = np.array([0, 1, 5, 300, 2047])
    cos, sin = rope_tables(positions, inv)
    x = np.random.default_rng(0).standard_normal((len(positions), 4, d)).astype(np.float32)
    got = apply_rope(torch.from_numpy(x), torch.from_numpy(cos), signed(torch.from_numpy(sin)))
    assert np.array_equal(got.numpy(), reference_rope(x, cos, sin))


def test_decode_scratch_reused_across_batch_sizes_gives_fresh_results() -> None:
    """The bf16 decode path keeps its block-diagonal query matrix in a buffer it only writes the
    diagonal of: after steps of other batch sizes a step must equal the same step on a fresh cache."""
    bs, kv, d, heads = 4, 2, 8, 6
    lengths = [9, 3, 14, 6, 11]
    tables, nb = [], 0
    for n in lengths:
        tables.append(list(range(nb, nb + -(-n // bs))))
        nb += len(tables[-1])
    gen = torch.Generator().manual_seed(1)

    def cache() -> PagedKVCache:
        c = PagedKVCache(num_layers=1, num_blocks=nb, block_size=bs, num_kv_heads=kv, head_dim=d, dtype="bfloat16")
        c.k[0].copy_(torch.randn(c.k[0].shape, generator=torch.Generator().manual_seed(2)))
        c.v[0].copy_(torch.randn(c.v[0].shape, generator=torch.Generator().manual_seed(3)))
        return c

    def step(which: list[int]) -> KVStep:
        return KVStep.build(query_lens=[1] * len(which), starts=[lengths[i] - 1 for i in which],
                            block_tables=[tables[i] for i in which], block_size=bs, num_blocks=nb)

    q = torch.randn((len(lengths), heads, d), generator=gen).to(torch.bfloat16)
    used = cache()
    for which in ([0, 1, 2, 3, 4], [1, 3], [0, 2, 4, 1], [4]):
        got = decode_attention(q[which], used, 0, step(which))
        assert torch.equal(got, decode_attention(q[which], cache(), 0, step(which))), which
