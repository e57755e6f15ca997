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


def test_strided_and_odd_inputs_give_the_contiguous_result() -> None:
    """x as a column slice of a wider tensor (rows further apart than K), a transposed copy, and K not a
    multiple of 32: the C code packs x from its strides and pads it with zeros itself."""
    rng = np.random.default_rng(4)
    for k in (576, 77):
        w = _bf16(rng.standard_normal((50, k)))
        tw = TileWeight.from_dense(w)
        wide = _bf16(rng.standard_normal((37, k + 45)))
        for x in (wide[:, :k], wide[:, 3:k + 3], _bf16(rng.standard_normal((k, 21))).t(), wide[:1, :k]):
            want = tw.matmul(x.contiguous())
            assert torch.equal(tw.matmul(x).view(torch.int16), want.view(torch.int16))


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
    """Every product takes the tile products (1-row decode steps to 64-row prefills), plain and compressed
    alike: same tokens, and a prompt's tokens alone are its tokens in a batch."""
    from fast.engine import Engine, FastModel, TorchLlama
    from fast.engine.linear import CompressedLinear, DenseLinear
    from reference.engine import SamplingParams
    from tests.tiny_llama import CONFIG, tiny_weights

    rows: list[int] = []
    real = TileWeight.matmul

    def counted(self: TileWeight, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        rows.append(x.numel() // x.shape[-1])
        return real(self, x, *args, **kwargs)

    prompts = [list(range(1, 30)), [7] * 5, list(range(40, 80))]
    outputs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TileWeight, "matmul", counted)
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
    assert outputs[True] == outputs[False]
    alone, together = outputs[False][:3], outputs[False][3]
    assert [a[0] for a in alone] == together
    assert min(rows) == 1 and max(rows) > 32  # decode steps and packed prefills both went through the tiles


@pytest.mark.skipif(not matmul_c.available(), reason="the CPU lacks AVX-512 BF16 or AMX: the engine keeps oneDNN")
@pytest.mark.parametrize("compressed", [False, True])
def test_logits_do_not_depend_on_the_batch_or_the_threads(compressed: bool) -> None:
    """Batch invariance: a prompt's logits computed alone, packed after another prompt and a decode row, and on
    two threads are the same bits (each output of every product is summed in order of k, whatever M)."""
    from fast.engine import TorchLlama
    from fast.kv import KVStep
    from tests.tiny_llama import CONFIG, tiny_weights

    model = TorchLlama(CONFIG, tiny_weights(), dtype="bfloat16", compressed=compressed)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, CONFIG.vocab_size, (37,), generator=gen)
    other = torch.randint(1, CONFIG.vocab_size, (23,), generator=gen)

    def logits(chunks: list[torch.Tensor], threads: int) -> torch.Tensor:
        """The last row's logits of the last chunk; every chunk starts at position 0 in its own blocks."""
        tables, first = [], 0
        for c in chunks:
            tables.append(list(range(first, first + -(-len(c) // 4))))
            first += len(tables[-1])
        step = KVStep.build(query_lens=[len(c) for c in chunks], starts=[0] * len(chunks), block_tables=tables,
                            block_size=4, num_blocks=first)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = model.forward(torch.cat(chunks), torch.cat([torch.arange(len(c)) for c in chunks]), step,
                                model.new_cache(first, 4), torch.tensor([sum(len(c) for c in chunks) - 1]))
        finally:
            torch.set_num_threads(before)
        return out.view(torch.int32)

    alone = logits([prompt], 1)
    assert torch.equal(logits([other, prompt[:1], prompt], 1), alone)
    assert torch.equal(logits([other, prompt], 2), alone)


def _amx() -> bool:
    lib = matmul_c.library()
    return lib is not None and bool(lib.tm_amx_ready())


@pytest.mark.skipif(not _amx(), reason="no AMX: products of up to 4 rows take AVX-512, more rows another path")
@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 150), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_a_rows_product_does_not_depend_on_the_other_rows(m: int, threads: int, seed: int) -> None:
    """Each output row equals that row multiplied alone, plain or compressed, whatever the row count (1-150: every
    way the compressed products take), the row's place among the blocks of 16 and 32, and the threads: the
    batch invariance the engine relies on.
    (oneDNN's products differ here: their blocking over k changes with the row count at this shape.)"""
    rng = np.random.default_rng(seed)
    w = _bf16(rng.standard_normal((1536, 576)) * 0.05)
    x = _bf16(rng.standard_normal((m, 576)))
    _, form = encode(w.contiguous(), with_palette_form=True)
    plain, comp = TileWeight.from_dense(w), TileWeight.from_palette(form)
    y = plain.matmul(x, threads=threads)
    assert torch.equal(comp.matmul(x, threads=threads).view(torch.int16), y.view(torch.int16))
    for i in sorted({0, m // 2, m - 1, int(rng.integers(0, m))}):
        assert torch.equal(y[i:i + 1].view(torch.int16), comp.matmul(x[i:i + 1]).view(torch.int16)), i


@pytest.mark.skipif(not _amx(), reason="no AMX: products of up to 4 rows take AVX-512, more rows another path")
@pytest.mark.parametrize("k, m, n", [(4130, 300, 40), (576, 1000, 1000), (64, 1100, 2048), (64, 1100, 2056)])
def test_rows_in_passes_and_k_in_blocks_give_each_rows_product(k: int, m: int, n: int) -> None:
    """Past TM_PASS_BYTES of x the rows go through the panels in passes (128 rows at k = 4130, 896 at 576; the
    compressed panels decoded in groups of up to TM_GROUP_BYTES: 28 panels at k = 576, so 3 groups for n = 1000), and
    k splits into blocks over 64 steps (4130: 3 blocks, partial sums kept as float32); an output of 4 MiB or
    more is written around the caches (n = 2048: every row's lines whole and aligned; 2056: most not): every
    row still equals that row multiplied alone, plain or compressed, and the result is close to float64."""
    rng = np.random.default_rng(k)
    w = _bf16(rng.standard_normal((n, k)) * 0.05)
    x = _bf16(rng.standard_normal((m, k)))
    _, form = encode(w.contiguous(), with_palette_form=True)
    plain, comp = TileWeight.from_dense(w), TileWeight.from_palette(form)
    y = plain.matmul(x, threads=2)
    assert torch.equal(comp.matmul(x, threads=1).view(torch.int16), y.view(torch.int16))
    for i in (0, 127, 128, 129, 255, 256, 299, 895, 896, 999):
        if i < m:
            assert torch.equal(y[i:i + 1].view(torch.int16), plain.matmul(x[i:i + 1]).view(torch.int16)), i
    exact = torch.nn.functional.linear(x.double(), w.double())
    scale = torch.nn.functional.linear(x.double().abs(), w.double().abs())
    assert torch.all((y.double() - exact).abs() <= scale * (2**-8 + k * 2**-23))


def test_the_thread_pool_serves_concurrent_callers_and_a_forked_child() -> None:
    """The products' threads stay alive between calls (fast/codec/native/threads.h): callers on several Python
    threads at once (one holds the pool, the others start threads of their own) and a child forked after the
    pool started (it builds a pool of its own) all get the one-thread result."""
    script = r"""
import os, threading
import numpy as np, torch
torch.set_num_threads(1)
from fast.codec.matmul_c import TileWeight
w = torch.from_numpy(np.random.default_rng(0).standard_normal((1000, 576)).astype(np.float32)).bfloat16()
tw = TileWeight.from_dense(w)
xs = {m: torch.from_numpy(np.random.default_rng(m).standard_normal((m, 576)).astype(np.float32)).bfloat16()
      for m in (1, 3, 40)}
want = {m: tw.matmul(x, threads=1).view(torch.int16).numpy().copy() for m, x in xs.items()}
bad = []
def hammer(seed):
    r = np.random.default_rng(seed)
    for _ in range(300):
        m, nt = int(r.choice([1, 3, 40])), int(r.integers(1, 5))
        if not np.array_equal(tw.matmul(xs[m], threads=nt).view(torch.int16).numpy(), want[m]):
            bad.append((m, nt))
ts = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
[t.start() for t in ts]
[t.join() for t in ts]
assert not bad, bad
pid = os.fork()
if pid == 0:
    ok = np.array_equal(tw.matmul(xs[40], threads=3).view(torch.int16).numpy(), want[40])
    os._exit(0 if ok else 1)
assert os.waitpid(pid, 0)[1] == 0
print("pool ok")
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "pool ok" in out.stdout, out.stderr[-2000:]
