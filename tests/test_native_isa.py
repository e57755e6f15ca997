"""``UNFIRE_CPU_ISA`` (fast/cpu_isa.py) obeyed by the native kernels outside the tile products: the Huffman and rANS
decoders, the decode attention and the fused ops each run under every instruction set this CPU can execute, take
no path above the cap, and give what they give today (the decoders: the original bits; the attention: the bits of
the loops the cap leaves, within the float64 bound; the fused ops: the torch lines' bits). A set this CPU lacks
is refused with CpuIsaError at the first call."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from fast import build_c, cpu_isa
from fast.codec import decode_c, decode_rans_c
from fast.codec.decode_c import decode_cpu
from fast.codec.decode_rans_c import decode_rans_cpu
from fast.engine import fused_c
from fast.engine.elementwise_torch import apply_rope, rms_norm, signed
from fast.errors import KernelInputError
from fast.kv import attention_c
from reference.codec import decode, decode_rans, encode, encode_rans
from tests.test_decode_cpu import many_threads
from tests.test_fast_fused import _bits, _cache, _norm_case, assert_silu_mul_as_torch
from tests.test_fast_kv_native import _run, _setup

ISAS = cpu_isa.supported()


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each instruction set this CPU can execute, as ``UNFIRE_CPU_ISA`` (the libraries take a changed cap at their
    next call: no cache to reset)."""
    monkeypatch.setenv(cpu_isa.ENV, request.param)
    return request.param


def _allows(isa: str, name: str) -> bool:
    names = cpu_isa.chain()
    return name in names and names.index(name) <= names.index(isa)


def _trained(seed: int, rows: int, cols: int) -> np.ndarray:
    """bf16 bits of trained-like weights, one subnormal (an exponent outside the palette: a verbatim chunk)."""
    r = np.random.default_rng(seed)
    bits = ((r.standard_normal((rows, cols)) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    bits[rows // 2, 5] = 0x0001
    return bits


@pytest.fixture
def lacking(monkeypatch: pytest.MonkeyPatch) -> str:
    """``UNFIRE_CPU_ISA`` set to an instruction set this CPU cannot execute (of another architecture if need be)."""
    name = next((name for name in cpu_isa.ALL if name not in ISAS), None)
    if name is None:
        pytest.skip("this CPU executes every set its architecture has")
    monkeypatch.setenv(cpu_isa.ENV, name)
    return name


# ---- the decoders ----

needs_decoders = pytest.mark.skipif(decode_c.library() is None or decode_rans_c.library() is None,
                                    reason="no C compiler: the C decoders are not built")


@needs_decoders
@pytest.mark.parametrize("threads", [1, 3])
def test_huffman_decoder_under_every_isa(isa: str, threads: int) -> None:
    """Many groups at L = 12 (the four-group rounds; in assembly in the AVX2 + BMI2 build), an odd shape, a verbatim
    chunk: the original bits under every cap, and no path above it (the CRC level, the wide build, the AVX-512BW
    assembly, as the library reports them)."""
    bits = _trained(1, 37, 1500)
    ct = encode(bits, chunks_per_group=4)
    with many_threads():
        got = decode_cpu(ct, threads=threads, native=True)
    assert np.array_equal(got, bits) and np.array_equal(got, decode(ct))
    lib = decode_c.library()
    level = build_c.isa_level()
    assert cpu_isa.chain()[level] == isa
    assert lib.unw_crc_use(-1) <= level  # 0 tables, 1 PCLMULQDQ / ARM CRC32, 2 VPCLMULQDQ
    assert lib.unw_decode_use(1) <= _allows(isa, "avx2")
    assert lib.unw_assemble_use(1) <= _allows(isa, "avx512")


@needs_decoders
def test_crc32_under_every_isa(isa: str) -> None:
    """zlib's CRC-32 on every path the cap leaves (lengths below and above each path's block, odd alignments)."""
    data = np.random.default_rng(5).integers(0, 256, 5000, dtype=np.uint8)
    for n, skip in ((0, 0), (7, 1), (63, 3), (64, 0), (255, 5), (256, 0), (1000, 9), (4093, 7)):
        assert decode_c.crc32(data[skip:skip + n]) == zlib.crc32(data[skip:skip + n].tobytes())
    assert decode_c.crc32(data, threads=3) == zlib.crc32(data.tobytes())


@needs_decoders
@pytest.mark.parametrize("threads", [1, 2])
def test_rans_decoder_under_every_isa(isa: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default rANS parameters (32 lanes, 12 probability bits, 2 mantissa bits: the AVX2 lanes' case) and
    another mantissa width: the original bits under every cap; the AVX2 build only from avx2 on, the AVX-512 lanes
    only from avx512 on."""
    monkeypatch.setattr(decode_rans_c, "MIN_WEIGHTS_PER_THREAD", 1)
    bits = _trained(2, 64, 700)
    for params in ({}, {"mantissa_bits": 3, "block_size": 1000}):
        t = encode_rans(bits, **params)
        got = decode_rans_cpu(t, threads=threads, native=True)
        assert np.array_equal(got, bits) and np.array_equal(got, decode_rans(t))
    assert decode_rans_c.library().unw_rans_use(1) <= _allows(isa, "avx2")
    assert decode_rans_c.library().unw_rans_use512(1) <= _allows(isa, "avx512")  # the AVX-512 lanes: avx512 on


@needs_decoders
def test_a_set_this_cpu_lacks_is_refused_by_the_decoders(lacking: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ct = encode(_trained(3, 4, 100))
    with pytest.raises(cpu_isa.CpuIsaError, match="cannot execute"):
        decode_cpu(ct, native=True)
    with pytest.raises(cpu_isa.CpuIsaError, match="cannot execute"):
        decode_rans_cpu(encode_rans(_trained(3, 4, 100)), native=True)
    monkeypatch.setenv(cpu_isa.ENV, "sse9")
    with pytest.raises(cpu_isa.CpuIsaError, match="unknown instruction set"):
        decode_cpu(ct, native=True)


# ---- the decode attention ----

needs_attention = pytest.mark.skipif(attention_c.library() is None, reason="no C compiler: kernel not built")


def _attention(cache, step, q, scale, isa: str, simd: str, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """The kernel's rows under UNFIRE_NATIVE_SIMD=simd and the cap isa."""
    monkeypatch.setenv("UNFIRE_NATIVE_SIMD", simd)
    monkeypatch.setenv(cpu_isa.ENV, isa)
    return _run(cache, step, q, scale)


@needs_attention
@pytest.mark.parametrize("d", [32, 64])
def test_decode_attention_under_every_isa(isa: str, d: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """amx: the AMX path where the CPU has it, today's default bits; avx512: the AVX-512 BF16 loops, the bits of
    UNFIRE_NATIVE_SIMD=3; below: the plain loops (the AVX2 build under avx2), the bits of UNFIRE_NATIVE_SIMD=0's
    portable build. Each within the float64 bound of tests/test_fast_kv_native.py."""
    cache, step, q, scale, want = _setup([70, 1, 33, 129], 2, 3, d, 16, 11)
    if _allows(isa, "avx512") and attention_c.has_simd():
        got = _attention(cache, step, q, scale, isa, "1", monkeypatch)
        path = attention_c.last_path()
        assert path == ("amx" if attention_c.has_amx() else "avx512-bf16")
        assert path != "amx" or isa == "amx"
        ref_isa, ref_simd = (isa, "1") if path == "amx" else (cpu_isa.best(), "3")
    else:
        monkeypatch.setenv("UNFIRE_NATIVE_SIMD", "1")
        assert attention_c.applies(q, cache) and not attention_c.has_simd() and not attention_c.has_amx()
        got = _attention(cache, step, q, scale, isa, "1", monkeypatch)
        assert attention_c.last_path() == ("plain-avx2" if _allows(isa, "avx2") else "plain")
        ref_isa, ref_simd = cpu_isa.best(), "0"
    assert torch.equal(got.view(torch.int16), _attention(cache, step, q, scale, ref_isa, ref_simd,
                                                         monkeypatch).view(torch.int16))
    err = (got.double() - want).abs()
    assert (err <= 2.0**-8 * want.abs() + 1e-5).all(), float(err.max())


@needs_attention
def test_decode_attention_refuses_a_set_this_cpu_lacks(lacking: str) -> None:
    cache, step, q, scale, _ = _setup([5], 1, 1, 16, 4, 0)
    with pytest.raises(cpu_isa.CpuIsaError, match="cannot execute"):
        attention_c.applies(q, cache)


# ---- the fused ops ----

needs_fused = pytest.mark.skipif(fused_c.library() is None, reason="no C compiler: fused ops not built")
CPU = torch.device("cpu")


@needs_fused
@pytest.mark.parametrize("simd", ["1", "0"])
def test_fused_ops_under_every_isa(isa: str, simd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """From avx512 on (where the CPU has AVX-512) the ops apply with their AVX-512 loops; below they do not (the torch
    lines run) unless UNFIRE_NATIVE_SIMD=0 forces the plain loops. Whatever runs gives the torch lines' bits: RoPE
    and the cache write, the residual add and the norm, silu(gate) * up (AVX-512 only: refused below)."""
    monkeypatch.setenv("UNFIRE_NATIVE_SIMD", simd)
    vector = _allows(isa, "avx512") and bool(fused_c.library().unf_fused_simd()) and simd == "1"
    cache = _cache(2, 32)
    assert fused_c._simd() == int(_allows(isa, "avx512") and simd == "1")
    assert fused_c.applies(torch.bfloat16, CPU, cache) == (vector or simd == "0")
    if fused_c.norm_lanes() is not None:
        assert fused_c.norm_applies(torch.bfloat16, CPU) == (vector or simd == "0")
    if not vector:
        assert not fused_c.silu_applies(torch.bfloat16, CPU)
    gen = torch.Generator().manual_seed(4)
    n, heads, kv, d = 7, 4, 2, 32
    qkv = (torch.randn((n, (heads + 2 * kv) * d), generator=gen) * 4).bfloat16()
    cos, sin = torch.randn((16, d), generator=gen), signed(torch.randn((16, d), generator=gen))
    positions, slots = torch.randint(0, 16, (n,), generator=gen), torch.randperm(32, generator=gen)[:n]
    q = fused_c.rope_write(qkv, cos, sin, positions, slots, cache, 1, heads)
    qk = apply_rope(qkv[:, :(heads + kv) * d].reshape(n, heads + kv, d).float(), cos[positions], sin[positions])
    assert torch.equal(q, qk[:, :heads].bfloat16())
    assert torch.equal(cache.k[1].view(-1, kv, d)[slots], qk[:, heads:].bfloat16())
    if fused_c.norm_lanes() is not None:
        x, delta, w = _norm_case(9, 1000, 2, 3.0)
        x_out = torch.full_like(x, float("nan"))
        got = fused_c.add_rms_norm(x, delta, w, 1e-5, x_out)
        assert torch.equal(_bits(x_out), _bits(x + delta.float()))
        assert torch.equal(_bits(got), _bits(rms_norm(x + delta.float(), w, 1e-5).to(torch.bfloat16)))
    gate_up = (torch.randn((5, 2 * 100), generator=gen) * 6).bfloat16()
    if fused_c.silu_applies(torch.bfloat16, CPU):
        assert vector
        assert_silu_mul_as_torch(gate_up)
    elif not vector and fused_c._silu.get("table") is not None:  # probed under another cap: refused here
        with pytest.raises(KernelInputError, match="does not run here"):
            fused_c.silu_mul(gate_up)


@needs_fused
def test_fused_ops_refuse_a_set_this_cpu_lacks(lacking: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNFIRE_NATIVE_SIMD", "0")  # the cap is checked even where the plain loops are forced
    with pytest.raises(cpu_isa.CpuIsaError, match="cannot execute"):
        fused_c.applies(torch.bfloat16, CPU, _cache(1, 16))
