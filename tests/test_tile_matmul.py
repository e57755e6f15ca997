"""The CPU tile products (fast/codec/matmul_c.py): compressed == plain bit for bit, close to float64.

Shapes and values come from hypothesis; every path this CPU can execute runs (AMX, AVX-512 BF16, AVX2,
NEON, scalar: never skipped for a missing AMX), and every path but AMX gives the scalar path's bits (the
portable order). The engine tests run on every instruction set of the CPU (``UNFIRE_CPU_ISA``): a model
served compressed gives the plain model's tokens, and a prompt's logits do not depend on its batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fast import cpu_isa
from fast.codec import matmul_c
from fast.codec.encode import encode
from fast.codec.matmul_c import TileWeight
from fast.errors import KernelInputError

pytestmark = pytest.mark.skipif(matmul_c.library() is None, reason="no C compiler: the tile matmul is not built")


def _paths(m: int) -> list[int]:  # noqa: ARG001 (every path serves every row count)
    return matmul_c.runnable_paths()


# the instruction sets the engine can serve with here (scalar is the conformance anchor, not a server)
SERVING_ISAS = [name for name in cpu_isa.supported() if name != "scalar"]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN need only be a NaN (payloads follow each ISA's NaN rules)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a.view(torch.int16)[~na], b.view(torch.int16)[~nb])


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
    portable = plain.matmul(x, path=matmul_c.SCALAR, threads=2)
    for path in _paths(m):
        yp, yc = plain.matmul(x, path=path, threads=2), comp.matmul(x, path=path, threads=2)
        assert torch.equal(yp.view(torch.int16), yc.view(torch.int16)), f"path {path}"
        if path != matmul_c.AMX:  # the portable order: the same bits on every ISA that follows it
            assert _same(yp, portable), f"path {path} differs from the scalar fmaf chain"
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


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 100), m=st.integers(1, 9), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["subnormal", "tiny products", "special"]))
def test_the_portable_order_is_one_answer_on_every_isa(k: int, m: int, seed: int, kind: str) -> None:
    """Subnormal weights and inputs (flushed), products and sums that underflow (flushed), NaN and infinities:
    AVX-512 BF16, AVX2 and NEON give the scalar fmaf chain's bits (NaN where it has NaN)."""
    rng = np.random.default_rng(seed)
    n = 20
    wb = rng.integers(0, 1 << 16, (n, k)).astype(np.uint16)
    xb = rng.integers(0, 1 << 16, (m, k)).astype(np.uint16)
    top = 90 if kind == "tiny products" else 200  # exponents 40-89: products near and below float32's least normal
    wb = (wb & 0x807F) | (rng.integers(40, top, (n, k)) << 7).astype(np.uint16)
    xb = (xb & 0x807F) | (rng.integers(40, top, (m, k)) << 7).astype(np.uint16)
    if kind == "subnormal":  # exponent 0 in a third of the words
        wb[rng.random((n, k)) < 0.3] &= 0x807F
        xb[rng.random((m, k)) < 0.3] &= 0x807F
    if kind == "special":
        wb.reshape(-1)[rng.choice(n * k, min(5, n * k), replace=False)] = rng.choice([0x7F80, 0xFF80, 0x7FC1, 0x0001])
    w = torch.from_numpy(wb.view(np.int16)).view(torch.bfloat16)
    x = torch.from_numpy(xb.view(np.int16)).view(torch.bfloat16)
    tw = TileWeight.from_dense(w)
    want = tw.matmul(x, path=matmul_c.SCALAR)
    for path in _paths(m):
        if path != matmul_c.AMX:
            assert _same(tw.matmul(x, path=path), want), f"path {path} ({matmul_c.ISA_OF_PATH[path]})"


def test_every_isa_the_cpu_has_is_gated_and_a_missing_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The products run on every ISA of this CPU (never skipped for a missing AMX); an ISA it lacks, or an
    unknown name, is refused with the CPU named."""
    assert {matmul_c.ISA_OF_PATH[p] for p in matmul_c.runnable_paths()} == set(cpu_isa.supported())
    w = TileWeight.from_dense(torch.ones((3, 40), dtype=torch.bfloat16))
    for name in cpu_isa.supported():
        monkeypatch.setenv("UNFIRE_CPU_ISA", name)
        assert matmul_c._default_path(1) == matmul_c.PATH_OF_ISA[name]
        assert float(w.matmul(torch.ones((2, 40), dtype=torch.bfloat16))[1, 2]) == 40.0
    lacking = [name for name in cpu_isa.ALL if name not in cpu_isa.supported()]
    for name in [*lacking, "sse9"]:
        monkeypatch.setenv("UNFIRE_CPU_ISA", name)
        with pytest.raises(cpu_isa.CpuIsaError, match=name):
            w.matmul(torch.ones((2, 40), dtype=torch.bfloat16))
    monkeypatch.delenv("UNFIRE_CPU_ISA")
    for name in lacking:
        with pytest.raises(KernelInputError, match="cannot run on this CPU"):
            w.matmul(torch.ones((2, 40), dtype=torch.bfloat16), path=matmul_c.PATH_OF_ISA[name])


@pytest.mark.parametrize("isa", SERVING_ISAS)
def test_engine_compressed_gives_plain_tokens_through_the_tile_products(isa: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
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

    monkeypatch.setenv("UNFIRE_CPU_ISA", isa)
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


@pytest.mark.parametrize("isa", SERVING_ISAS)
@pytest.mark.parametrize("compressed", [False, True])
def test_logits_do_not_depend_on_the_batch_or_the_threads(compressed: bool, isa: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch invariance: a prompt's logits computed alone, packed after another prompt and a decode row, and on
    two threads are the same bits (each output of every product is summed in order of k, whatever M)."""
    from fast.engine import TorchLlama
    from fast.kv import KVStep
    from tests.tiny_llama import CONFIG, tiny_weights

    monkeypatch.setenv("UNFIRE_CPU_ISA", isa)
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


FAST_PATHS = [matmul_c.PATH_OF_ISA[name] for name in SERVING_ISAS]


@pytest.mark.parametrize("path", FAST_PATHS, ids=[matmul_c.ISA_OF_PATH[p] for p in FAST_PATHS])
@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 150), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_a_rows_product_does_not_depend_on_the_other_rows(path: int, m: int, threads: int, seed: int) -> None:
    """Each output row equals that row multiplied alone, plain or compressed, whatever the row count (1-150: every
    way the compressed products take), the row's place among the blocks of 16 and 32, and the threads: the
    batch invariance the engine relies on.
    (oneDNN's products differ here: their blocking over k changes with the row count at this shape.)"""
    rng = np.random.default_rng(seed)
    w = _bf16(rng.standard_normal((1536, 576)) * 0.05)
    x = _bf16(rng.standard_normal((m, 576)))
    _, form = encode(w.contiguous(), with_palette_form=True)
    plain, comp = TileWeight.from_dense(w), TileWeight.from_palette(form)
    y = plain.matmul(x, path=path, threads=threads)
    assert torch.equal(comp.matmul(x, path=path, threads=threads).view(torch.int16), y.view(torch.int16))
    for i in sorted({0, m // 2, m - 1, int(rng.integers(0, m))}):
        one = comp.matmul(x[i:i + 1], path=path)
        assert torch.equal(y[i:i + 1].view(torch.int16), one.view(torch.int16)), i


@pytest.mark.parametrize("path", FAST_PATHS, ids=[matmul_c.ISA_OF_PATH[p] for p in FAST_PATHS])
@pytest.mark.parametrize("k, m, n", [(4130, 300, 40), (576, 1000, 1000), (64, 1100, 2048), (64, 1100, 2056)])
def test_rows_in_passes_and_k_in_blocks_give_each_rows_product(k: int, m: int, n: int, path: int) -> None:
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
    y = plain.matmul(x, path=path, threads=2)
    assert torch.equal(comp.matmul(x, path=path, threads=1).view(torch.int16), y.view(torch.int16))
    for i in (0, 127, 128, 129, 255, 256, 299, 895, 896, 999):
        if i < m:
            one = plain.matmul(x[i:i + 1], path=path)
            assert torch.equal(y[i:i + 1].view(torch.int16), one.view(torch.int16)), i
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
