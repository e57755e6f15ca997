"""The fused C RoPE + cache write of the bf16 model (fast/engine/fused_c.py): torch's bits, both loop sets,
bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fast.engine import fused_c
from fast.engine.elementwise_torch import apply_rope, signed
from fast.errors import KernelInputError
from fast.kv import PagedKVCache

pytestmark = pytest.mark.skipif(fused_c.library() is None, reason="no C compiler: fused ops not built")
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
        q = fused_c.rope_write(qkv, cos, sin, positions, slots, cache, 1, heads)
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
        q = fused_c.rope_write(qkv, cos, sin, positions, slots, cache, 0, 9)
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
        fused_c.rope_write(qkv, cos, sin, torch.tensor([0, 10]), ok, cache, 0, 1)
    with pytest.raises(KernelInputError, match="slot"):
        fused_c.rope_write(qkv, cos, sin, ok, torch.tensor([0, 32]), cache, 0, 1)
    with pytest.raises(KernelInputError, match="slot"):
        fused_c.rope_write(qkv, cos, sin, ok, torch.tensor([-1, 0]), cache, 0, 1)
    with pytest.raises(KernelInputError, match="width"):
        fused_c.rope_write(qkv, cos, sin, ok, ok, cache, 0, 2)
    with pytest.raises(KernelInputError, match="int64"):
        fused_c.rope_write(qkv, cos, sin, ok.int(), ok, cache, 0, 1)
    with pytest.raises(KernelInputError, match="layer"):
        fused_c.rope_write(qkv, cos, sin, ok, ok, cache, 5, 1)


def test_bf16_engine_runs_them_and_generates_what_the_torch_lines_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast engine in bf16 takes the fused RoPE write (switched off, its torch lines) with the same greedy
    tokens, bit for bit."""
    from tests.tiny_llama import bf16_outputs_on_and_off

    outputs, on, off = bf16_outputs_on_and_off(monkeypatch, fused_c, "rope_write", "UNFIRE_NATIVE_FUSED")
    assert on >= 2 * 12  # every step, both layers
    assert off == 0  # switched off: never called
    assert outputs["1"] == outputs["0"]


def _norm_case(n: int, h: int, seed: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, h), generator=gen) * scale
    delta = (torch.randn((n, h), generator=gen) * scale).bfloat16()
    return x, delta, torch.randn(h, generator=gen)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.skipif(not fused_c.norm_applies(torch.bfloat16, torch.device("cpu")),
                    reason="the C norm does not know this CPU's summation order")
@pytest.mark.parametrize("one_call", [True, False])
@pytest.mark.parametrize("simd", SIMD)
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), h=st.sampled_from([1, 3, 7, 8, 9, 15, 16, 17, 33, 64, 100, 255, 576, 960, 1023, 2048,
                                                 4100, 9000]),
       seed=st.integers(0, 2**16), log_scale=st.integers(-12, 12), eps=st.sampled_from([1e-5, 1e-6, 0.0]))
def test_add_rms_norm_is_torch_bit_for_bit(simd: str, one_call: bool, n: int, h: int, seed: int, log_scale: int,
                                           eps: float) -> None:
    """x + float(delta) and bf16(rms_norm(...)) exactly as the model's torch lines compute them (the sum of
    squares in ATen's order, torch's sqrt: MKL's called from C in one call, or torch.sqrt between two C passes),
    into a separate output and in place; every cell written."""
    from fast.engine.elementwise_torch import rms_norm

    if one_call and fused_c._lanes.get("sqrt") is None:
        pytest.skip("torch's sqrt cannot be called from C here: the two-pass norm runs")

    x, delta, w = _norm_case(n, h, seed, 2.0 ** log_scale)
    want_x = x + delta.float()
    want = rms_norm(want_x, w, eps).to(torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UNFIRE_NATIVE_SIMD", simd)
        if not one_call:
            mp.setitem(fused_c._lanes, "sqrt", None)
        x_out = torch.full_like(x, float("nan"))  # every cell must be overwritten
        got = fused_c.add_rms_norm(x, delta, w, eps, x_out)
        assert torch.equal(_bits(x_out), _bits(want_x)) and torch.equal(_bits(got), _bits(want))
        alone = fused_c.add_rms_norm(want_x, None, w, eps)  # the norm without an add
        assert torch.equal(_bits(alone), _bits(want))
        inplace = x.clone()
        assert fused_c.add_rms_norm(inplace, delta, None, eps, inplace) is None  # the add alone, in place
        assert torch.equal(_bits(inplace), _bits(want_x))


@pytest.mark.skipif(not fused_c.norm_applies(torch.bfloat16, torch.device("cpu")),
                    reason="the C norm does not know this CPU's summation order")
def test_add_rms_norm_split_between_threads_and_special_values() -> None:
    """Rows split between two threads give the same bits; infinities, NaNs, zero rows and huge values go
    through as in torch (NaN rows stay NaN in both, compared as NaN)."""
    from fast.engine.elementwise_torch import rms_norm

    x, delta, w = _norm_case(97, 576, 7, 30.0)
    x[3] = 0.0
    x[5, 7] = float("inf")
    x[8, 9] = float("nan")
    x[11] *= 1e18  # squares overflow to inf
    delta[13] = 0.0
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        x_out = torch.empty_like(x)
        got = fused_c.add_rms_norm(x, delta, w, 1e-5, x_out)
    finally:
        torch.set_num_threads(before)
    want_x = x + delta.float()
    want = rms_norm(want_x, w, 1e-5).to(torch.bfloat16)
    assert torch.equal(x_out.nan_to_num(), want_x.nan_to_num())
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_norm_probe_under_other_cpu_capabilities(capability: str) -> None:
    """With torch's kernels forced to another capability, the probe still finds the order and the bits still
    equal torch's (or the norm declines: then the model runs the torch lines)."""
    import subprocess
    import sys

    code = ("import torch\nfrom fast.engine import fused_c\nfrom fast.engine.elementwise_torch import rms_norm\n"
            "ok = fused_c.norm_applies(torch.bfloat16, torch.device('cpu'))\n"
            "g = torch.Generator().manual_seed(1)\nbad = 0\n"
            "for h in (5, 40, 576, 3000):\n"
            "    x, d, w = torch.randn((9, h), generator=g), torch.randn((9, h), generator=g).bfloat16(), "
            "torch.randn(h, generator=g)\n"
            "    if ok:\n"
            "        xo = torch.empty_like(x)\n"
            "        got = fused_c.add_rms_norm(x, d, w, 1e-5, xo)\n"
            "        bad += not torch.equal(got.view(torch.int16), rms_norm(x + d.float(), w, 1e-5).bfloat16()"
            ".view(torch.int16))\n"
            "print(torch.backends.cpu.get_cpu_capability(), ok, fused_c.norm_lanes(), bad)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "ATEN_CPU_CAPABILITY": capability})
    assert run.returncode == 0, run.stderr
    cap, ok, lanes, bad = run.stdout.split()
    assert bad == "0"
    assert ok == "False" or lanes in ("8", "16")


def test_norm_bad_input_is_refused() -> None:
    if not fused_c.norm_applies(torch.bfloat16, torch.device("cpu")):
        pytest.skip("the C norm does not run here")
    x, delta, w = _norm_case(2, 16, 0, 1.0)
    with pytest.raises(KernelInputError, match="x_out"):
        fused_c.add_rms_norm(x, delta, w, 1e-5)
    with pytest.raises(KernelInputError, match="shape"):
        fused_c.add_rms_norm(x, delta[:1], w, 1e-5, torch.empty_like(x))
    with pytest.raises(KernelInputError, match="weight"):
        fused_c.add_rms_norm(x, None, w[:8], 1e-5)
    with pytest.raises(KernelInputError, match="float32"):
        fused_c.add_rms_norm(x.bfloat16(), None, w, 1e-5)
    with pytest.raises(KernelInputError, match="delta, a weight"):
        fused_c.add_rms_norm(x, None, None, 1e-5)


def test_bf16_model_logits_equal_with_and_without_the_c_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """One prefill step and one decode step of the bf16 model: the logits with the C norm and silu (and the C RoPE)
    equal those of the torch lines bit for bit, and the C norm ran."""
    from fast.engine import TorchLlama
    from fast.kv import KVStep
    from tests.tiny_llama import CONFIG, tiny_weights

    if not fused_c.norm_applies(torch.bfloat16, torch.device("cpu")):
        pytest.skip("the C norm does not run here")
    model = TorchLlama(CONFIG, tiny_weights(), dtype="bfloat16")
    calls = []
    real, bound = fused_c.add_rms_norm, fused_c.StepOps.add_rms_norm

    def counted(*args: object, **kwargs: object) -> torch.Tensor | None:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    def counted_bound(*args: object, **kwargs: object) -> torch.Tensor | None:
        calls.append(1)
        return bound(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_c, "add_rms_norm", counted)  # the public function, or the step's bound one
    monkeypatch.setattr(fused_c.StepOps, "add_rms_norm", counted_bound)
    tokens = torch.randint(1, CONFIG.vocab_size, (37,), generator=torch.Generator().manual_seed(4))
    logits = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("UNFIRE_NATIVE_NORM", flag)
        monkeypatch.setenv("UNFIRE_NATIVE_SILU", flag)
        cache = model.new_cache(16, 4)
        prefill = KVStep.build(query_lens=[30, 7], starts=[0, 0], block_tables=[list(range(8)), [8, 9]],
                               block_size=4, num_blocks=16)
        a = model.forward(tokens, torch.cat([torch.arange(30), torch.arange(7)]), prefill, cache,
                          torch.tensor([29, 36]))
        decode = KVStep.build(query_lens=[1, 1], starts=[30, 7], block_tables=[list(range(8)), [8, 9]],
                              block_size=4, num_blocks=16)
        b = model.forward(tokens[:2], torch.tensor([30, 7]), decode, cache, torch.tensor([0, 1]))
        logits[flag] = (a, b)
        if flag == "1":
            # per step: the first norm, two per layer (the last one an add alone), the final norm
            assert len(calls) >= 2 * (2 * CONFIG.num_layers + 2)
            calls_on = len(calls)
    assert len(calls) == calls_on  # switched off: not called again
    for x, y in zip(logits["1"], logits["0"], strict=True):
        assert torch.equal(_bits(x), _bits(y))


def assert_silu_mul_as_torch(gate_up: torch.Tensor) -> None:
    """The C silu_mul against the model's torch lines (F.silu of the gate half, times the up half): NaN where torch
    gives NaN (payloads aside), every other value bit for bit."""
    import torch.nn.functional as F

    got = fused_c.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(_bits(got[finite]), _bits(want[finite]))


@pytest.mark.skipif(not fused_c.silu_applies(torch.bfloat16, torch.device("cpu")),
                    reason="the C silu does not run here (no AVX-512, or not torch's bits on the probe)")
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), inter=st.sampled_from([1, 5, 31, 63, 64, 65, 100, 127, 128, 700, 1536, 1537]),
       seed=st.integers(0, 2**16), scale=st.sampled_from([0.01, 1.0, 6.0, 40.0, 200.0]))
def test_silu_mul_is_torch_bit_for_bit(n: int, inter: int, seed: int, scale: float) -> None:
    """silu(gate) * up exactly as the model's torch lines (F.silu, then the product), whole vector steps and the
    scalar tail of each row alike; special values give NaN where torch gives NaN (NaN payloads aside)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn((n, 2 * inter), generator=gen) * scale).bfloat16()
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 89.0, -89.0, -104.0])
    k = min(len(specials), inter)
    gate_up[0, :k] = specials[:k]
    assert_silu_mul_as_torch(gate_up)


@pytest.mark.skipif(not fused_c.silu_applies(torch.bfloat16, torch.device("cpu")),
                    reason="the C silu does not run here (no AVX-512, or not torch's bits on the probe)")
@pytest.mark.parametrize("inter", [1024, 1030])
def test_silu_mul_every_bf16_gate(inter: int) -> None:
    """Every one of the 65536 bf16 gates, laid out as the model's gate/up rows (the gate a strided half), against
    the torch lines: the table's lookups in the vector steps and the scalar tail (inter 1030: 6 tail values a row)."""
    gates = fused_c.every_bf16()
    n = -(-65536 // inter)
    gates = torch.cat([gates, gates[: n * inter - 65536]]).view(n, inter)
    up = torch.randn((n, inter), generator=torch.Generator().manual_seed(1)).bfloat16()
    gate_up = torch.cat([gates, up], dim=1)
    assert_silu_mul_as_torch(gate_up)


def test_silu_mul_refuses_bad_input() -> None:
    if not fused_c.silu_applies(torch.bfloat16, torch.device("cpu")):
        pytest.skip("the C silu does not run here")
    with pytest.raises(KernelInputError, match="odd width"):
        fused_c.silu_mul(torch.zeros((2, 7), dtype=torch.bfloat16))
    with pytest.raises(KernelInputError, match="bfloat16"):
        fused_c.silu_mul(torch.zeros((2, 8)))


def test_silu_switch_and_simd_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """UNFIRE_NATIVE_SILU=0 or the plain loops forced (UNFIRE_NATIVE_SIMD=0): the torch lines run (the C silu
    has AVX-512 loops only)."""
    monkeypatch.setenv("UNFIRE_NATIVE_SILU", "0")
    assert not fused_c.silu_applies(torch.bfloat16, torch.device("cpu"))
    monkeypatch.setenv("UNFIRE_NATIVE_SILU", "1")
    monkeypatch.setenv("UNFIRE_NATIVE_SIMD", "0")
    assert not fused_c.silu_applies(torch.bfloat16, torch.device("cpu"))
    assert not fused_c.silu_applies(torch.float32, torch.device("cpu"))


def test_last_layer_on_kept_rows_gives_the_same_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill step whose last layer runs attention, projection and MLP on the logit rows alone (the C attention
    takes single rows) gives the logits of the full last layer bit for bit, and the cache the same K/V."""
    from fast.engine import TorchLlama
    from fast.kv import KVStep, attention_c, attention_rows, paged_attention
    from tests.tiny_llama import CONFIG, tiny_weights

    model = TorchLlama(CONFIG, tiny_weights(), dtype="bfloat16")
    probe = model.new_cache(4, 4)
    if not attention_c.applies(torch.zeros((1, CONFIG.num_heads, CONFIG.head_dim), dtype=torch.bfloat16), probe):
        pytest.skip("the C attention does not run here: the last layer runs on every row")
    tokens = torch.randint(1, CONFIG.vocab_size, (41,), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(30), torch.arange(4, 15)])
    step = KVStep.build(query_lens=[30, 11], starts=[0, 4], block_tables=[list(range(8)), [8, 9, 10, 11]],
                        block_size=4, num_blocks=16)
    rows = torch.tensor([29, 40])
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("UNFIRE_PRUNE_LAST_LAYER", flag)
        cache = model.new_cache(16, 4)
        for layer in range(CONFIG.num_layers):  # the second chunk's cached prefix: positions 0-3, block 8
            cache.k[layer][8] = torch.randn((4, CONFIG.num_kv_heads, CONFIG.head_dim),
                                            generator=torch.Generator().manual_seed(layer)).bfloat16()
            cache.v[layer][8] = -cache.k[layer][8]
        got[flag] = (model.forward(tokens, positions, step, cache, rows), cache.k[-1].clone(), cache.v[-1].clone())
    for a, b in zip(got["1"], got["0"], strict=True):
        assert torch.equal(_bits(a), _bits(b))
    q = torch.randn((41, CONFIG.num_heads, CONFIG.head_dim), generator=torch.Generator().manual_seed(6)).bfloat16()
    cache = model.new_cache(16, 4)
    some = torch.tensor([0, 7, 29, 30, 35, 40])
    assert torch.equal(_bits(attention_rows(q, cache, 0, step, some)), _bits(paged_attention(q, cache, 0, step)[some]))


def test_step_bound_ops_give_the_same_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops and attention bound to a step (fused_c.StepOps, attention_c.bind: arguments checked once per
    step) give the logits of the per-call public functions bit for bit, in a prefill and a decode step; and they
    refuse a tensor of the wrong shape."""
    from fast.engine import TorchLlama
    from fast.kv import KVStep
    from tests.tiny_llama import CONFIG, tiny_weights

    model = TorchLlama(CONFIG, tiny_weights(), dtype="bfloat16")
    cache = model.new_cache(16, 4)
    positions = torch.cat([torch.arange(30), torch.arange(7)])
    step = KVStep.build(query_lens=[30, 7], starts=[0, 0], block_tables=[list(range(8)), [8, 9]], block_size=4,
                        num_blocks=16)
    torch.set_num_threads(1)
    ops = fused_c.StepOps.bind(cache, CONFIG.num_heads, model.cos, model.signed_sin, positions, step.slots)
    if ops is None:
        pytest.skip("the step-bound ops do not run here (a C op not applicable)")
    with pytest.raises(KernelInputError, match="qkv"):
        ops.rope_write(torch.zeros((5, 3), dtype=torch.bfloat16), 0)
    tokens = torch.randint(1, CONFIG.vocab_size, (37,), generator=torch.Generator().manual_seed(8))
    real = fused_c.StepOps.bind
    got = {}
    for bound in (True, False):
        if not bound:
            monkeypatch.setattr(fused_c.StepOps, "bind", classmethod(lambda cls, *a, **k: None))
        cache = model.new_cache(16, 4)
        a = model.forward(tokens, positions, step, cache, torch.tensor([29, 36]))
        decode = KVStep.build(query_lens=[1, 1], starts=[30, 7], block_tables=[list(range(8)), [8, 9]],
                              block_size=4, num_blocks=16)
        b = model.forward(tokens[:2], torch.tensor([30, 7]), decode, cache, torch.tensor([0, 1]))
        got[bound] = (a, b, cache.k[0].clone(), cache.v[-1].clone())
    monkeypatch.setattr(fused_c.StepOps, "bind", real)
    for x, y in zip(got[True], got[False], strict=True):
        assert torch.equal(_bits(x), _bits(y))
