"""The CPU tile products (fast/codec/matmul_c.py): compressed == plain bit for bit, close to float64.

Shapes and values come from hypothesis; every path this CPU has runs (AVX-512 BF16, AMX, portable).
The engine test checks that a model served compressed gives the plain model's greedy tokens when the
engine's matrices go through these products.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fast.codec import matmul_c
from fast.codec.encode import encode
from fast.codec.matmul_c import TileWeight
from fast.errors import KernelInputError

pytestmark = pytest.mark.skipif(matmul_c.library() is None, reason="no C compiler: the tile matmul is not built")


def _paths(m: int) -> list[int]:
    lib = matmul_c.library()
    paths = [matmul_c.PORTABLE]
    if lib.tm_avx512_ready():
        paths += [matmul_c.GEMV] if m <= matmul_c.GEMV_MAX_ROWS else []
        paths += [matmul_c.AMX] if lib.tm_amx_ready() else []
    return paths


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 140), m=st.integers(1, 40), seed=st.integers(0, 2**16),
       spread=st.sampled_from([0.05, 1e3, 1e-30]))
def test_compressed_equals_plain_and_is_close(n: int, k: int, m: int, seed: int, spread: float) -> None:
    rng = np.random.default_rng(seed)
    w = _bf16(rng.standard_normal((n, k)) * spread * np.exp(rng.uniform(-8, 8, (n, k))))
    x = _bf16(rng.standard_normal((m, k)))
    _, form = encode(w.contiguous(), with_palette_form=True)
    plain, comp = TileWeight.from_dense(w), TileWeight.from_palette(form)
    assert torch.equal(comp.dense().view(torch.int16), w.view(torch.int16))
    assert torch.equal(comp.decoded_tiles(vector=False), plain.plain)
    exact = torch.nn.functional.linear(x.double(), w.double())
    for path in _paths(m):
        yp, yc = plain.matmul(x, path=path, threads=2), comp.matmul(x, path=path, threads=2)
        assert torch.equal(yp.view(torch.int16), yc.view(torch.int16)), f"path {path}"
        # bf16 output rounding plus float32 sums of K products (subnormal products may flush to 0)
        scale = torch.nn.functional.linear(x.double().abs(), w.double().abs())
        tol = scale * (2**-8 + k * 2**-23) + 1e-30
        fin = torch.isfinite(exact)
        assert torch.all((yp.double() - exact).abs()[fin] <= tol[fin]), f"path {path}"


def test_padding_words_decode_to_zero_with_a_full_palette() -> None:
    """With 16 exponents in use there is no zero slot: padding words become patches, not palette[0]."""
    rng = np.random.default_rng(1)
    bits = ((rng.integers(0, 2, (21, 45)) << 15) | (rng.integers(100, 120, (21, 45)) << 7)).astype(np.int16)
    bits[3, 7] = 0x7F80  # +inf: exponent 255, outside the palette
    w = torch.from_numpy(bits).view(torch.bfloat16)
    _, form = encode(w.contiguous(), with_palette_form=True)
    assert int((form.palette == 0).sum()) == 0
    comp = TileWeight.from_palette(form)
    assert torch.equal(comp.decoded_tiles(vector=False), TileWeight.from_dense(w).plain)
    x = torch.zeros((3, 45), dtype=torch.bfloat16)
    x[:, 0] = 1
    y = comp.matmul(x)
    assert torch.isnan(y[:, 3]).all() and torch.isfinite(torch.cat([y[:, :3], y[:, 4:]], 1)).all()


def test_bad_inputs_are_named() -> None:
    tw = TileWeight.from_dense(torch.zeros((4, 8), dtype=torch.bfloat16))
    with pytest.raises(KernelInputError, match="expected input"):
        tw.matmul(torch.zeros((2, 9), dtype=torch.bfloat16))
    with pytest.raises(KernelInputError, match="bf16"):
        tw.matmul(torch.zeros((2, 8)))
    with pytest.raises(KernelInputError, match="bf16"):
        TileWeight.from_dense(torch.zeros((4, 8)))
    assert tw.matmul(torch.zeros((0, 8), dtype=torch.bfloat16)).shape == (0, 4)


@pytest.mark.skipif(not matmul_c.available(), reason="the CPU lacks AVX-512 BF16 or AMX: the engine keeps oneDNN")
def test_engine_compressed_gives_plain_tokens_through_the_tile_products() -> None:
    """Batches of 1 and 2 rows take the tile products, bigger ones oneDNN: every step, same bits."""
    from fast.engine import Engine, FastModel, TorchLlama
    from fast.engine.linear import CompressedLinear, DenseLinear
    from reference.engine import SamplingParams
    from tests.tiny_llama import CONFIG, tiny_weights

    calls = {"tile": 0}
    real = TileWeight.matmul

    def counted(self: TileWeight, *args: object, **kwargs: object) -> torch.Tensor:
        calls["tile"] += 1
        return real(self, *args, **kwargs)

    prompts = [list(range(1, 30)), [7] * 5, list(range(40, 80))]
    outputs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine takes the tile products on one thread (fast/engine/linear.py)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TileWeight, "matmul", counted)
        mp.setattr(torch, "set_num_threads", lambda n: None)  # the engine may not change it meanwhile
        for compressed in (False, True):
            model = TorchLlama(CONFIG, tiny_weights(), dtype="bfloat16", compressed=compressed)
            layer = model.layers[0]
            assert isinstance(layer.qkv, CompressedLinear if compressed else DenseLinear)
            assert layer.qkv.tiles is not None and layer.qkv.tiles.compressed == compressed
            engine = Engine(FastModel(model), num_blocks=40, block_size=4, max_num_batched_tokens=64, max_num_seqs=3)
            outputs[compressed] = [[o.output_token_ids for o in engine.generate([p], SamplingParams(max_tokens=10,
                                   ignore_eos=True))] for p in prompts]
            outputs[compressed] += [[o.output_token_ids for o in engine.generate(prompts, SamplingParams(
                max_tokens=10, ignore_eos=True))]]
    torch.set_num_threads(threads)
    assert outputs[True] == outputs[False]
    assert calls["tile"] > 0
