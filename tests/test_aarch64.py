"""ARM64 for real (issue 42): every C source of fast/ compiles for aarch64 with fast/build_c.py's flags, and the kernels
run under ``qemu-aarch64`` on cases made here on the x86 side, their outputs compared byte for byte.

The drivers in tests/native/ (``*_check.c``) each include one kernel's C file, read a case's inputs as records
(tests/native/check_io.h), run the kernel and write its outputs; they are linked statically, so qemu needs no
sysroot. The decoders must give the original bits exactly (and fail on damaged input), with ARM's CRC32
instructions and with the CRC tables; the plain loops of the fused ops must give the torch lines' bits, and
those of the decode attention the bits of the same loops on x86.

Needs Debian's ``gcc-aarch64-linux-gnu`` and ``qemu-user`` (``.ci/run`` installs them): without them the tests
skip, except under ``CI=true``, where they fail (CI must gate them).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from fast import build_c
from fast.codec.decode_c import CRC_ORDER
from fast.codec.decode_rans_c import CRC_ORDER as RANS_CRC_ORDER
from fast.codec.decode_rans_c import SMALL_ARRAYS as RANS_SMALL_ARRAYS
from fast.engine.elementwise_torch import apply_rope, rms_norm, signed
from fast.kv import attention_c
from reference.codec import encode, encode_rans
from reference.codec.layout import Layout
from tests.test_fast_kv_native import _setup
from tests.test_native_isa import _trained

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "tests" / "native"
SYSROOT = "/usr/aarch64-linux-gnu"
CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")
SOURCES = sorted(ROOT.glob("fast/**/native/*.c"))
DRIVERS = sorted(NATIVE.glob("*_check.c"))
ISA_SCALAR, ISA_NEON = 0, 1  # the caps each decoder driver runs under (fast/codec/native/builds.h)


def need(tool: str | None, what: str) -> str:
    """The tool's path; else skip, or fail where ``CI=true`` (the checks must run there)."""
    if tool is None:
        msg = f"{what} not found (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{msg}; CI=true, where the aarch64 checks must run")
        pytest.skip(msg)
    return tool


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("source", SOURCES, ids=_rel)
def test_every_c_source_compiles_for_aarch64(source: Path, tmp_path: Path) -> None:
    """fast/build_c.py's flags; a function used without a declaration (an x86-only one outside its #ifdef) is an
    error here, not a symbol left undefined until the library is loaded."""
    cc = need(CC, "aarch64-linux-gnu-gcc")
    r = subprocess.run([cc, *build_c.FLAGS, "-Werror=implicit-function-declaration", "-o", str(tmp_path / "x.so"),
                        str(source)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{_rel(source)} does not build for aarch64:\n{r.stderr[-4000:]}"


@functools.cache
def _driver(name: str, where: Path) -> Path:
    """tests/native/<name>.c built for aarch64, linked statically (once per session)."""
    exe = where / name
    r = subprocess.run([need(CC, "aarch64-linux-gnu-gcc"), *[f for f in build_c.FLAGS if f not in ("-shared", "-fPIC")],
                        "-static", "-o", str(exe), str(NATIVE / f"{name}.c"), "-lm"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"tests/native/{name}.c does not build for aarch64:\n{r.stderr[-4000:]}"
    return exe


@pytest.fixture(scope="session")
def drivers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aarch64")


@pytest.mark.parametrize("driver", DRIVERS, ids=_rel)
def test_every_driver_builds(driver: Path, drivers: Path) -> None:
    _driver(driver.stem, drivers)


def run_driver(name: str, cases: list[list[object]], where: Path) -> list[bytes]:
    """Run tests/native/<name>.c under qemu-aarch64 on the cases (each a list of arrays, bytes or scalars: one
    record each, in the driver's order); its output records."""
    exe = _driver(name, where)
    qemu = need(QEMU, "qemu-aarch64")
    src, dst = where / f"{name}.in", where / f"{name}.out"
    with open(src, "wb") as f:
        for case in cases:
            for item in case:
                data = _bytes(item)
                f.write(len(data).to_bytes(8, "little") + data)
    r = subprocess.run([qemu, "-L", SYSROOT, str(exe), str(src), str(dst)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"{name} under qemu-aarch64 exited {r.returncode}:\n{r.stderr[-4000:]}"
    out, data = [], dst.read_bytes()
    while data:
        n = int.from_bytes(data[:8], "little")
        out.append(data[8:8 + n])
        data = data[8 + n:]
    return out


def _bytes(item: object) -> bytes:
    """One record's bytes: an array's (C order), a tensor's, or bytes as they are."""
    if isinstance(item, torch.Tensor):
        return item.contiguous().view(torch.uint8).numpy().tobytes() if item.numel() else b""
    if isinstance(item, np.ndarray):
        return np.ascontiguousarray(item).tobytes()
    assert isinstance(item, bytes), type(item)
    return item


def i64(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def _flip(a: np.ndarray, byte: int) -> np.ndarray:
    a = a.copy()
    a.view(np.uint8)[byte] ^= 0x10
    return a


def test_huffman_decoder_under_qemu(drivers: Path) -> None:
    """The original bits under both caps (scalar: the portable build, CRC tables; neon: ARM's CRC32 instructions,
    which qemu's CPU has), many groups in threads and small odd tensors; damaged streams are refused; the CRC-32 of
    any bytes is zlib's."""
    tensors = [(_trained(1, 37, 1500), {}, 3), (_trained(2, 9, 77), {"chunk_size": 3, "chunks_per_group": 5,
                                                                       "max_code_length": 7}, 1),
               (_trained(3, 5, 300), {"palette_size": 8, "max_code_length": 16}, 2)]
    blob = np.random.default_rng(4).integers(0, 256, 4099, dtype=np.uint8)
    cases, want = [], []
    for k, (bits, params, threads) in enumerate(tensors):
        ct = encode(bits, **params)
        g = Layout(ct.shape, ct.chunk_size, ct.chunks_per_group)
        for damaged in (False, True) if k == 0 else (False,):
            stream = _flip(ct.stream, ct.stream.nbytes // 2) if damaged else ct.stream
            cases.append([i64(g.rows, g.cols, g.chunk_size, g.chunks_per_group, ct.max_code_length, ct.stream_bits,
                              threads), np.array(ct.palette, np.uint8), np.array(ct.code_lengths, np.uint8), stream,
                          ct.offsets, ct.vchunks, ct.vexp, ct.sm, np.array([ct.crc[c] for c in CRC_ORDER], np.uint32),
                          blob[k:]])
            want.append((bits, damaged, zlib.crc32(blob[k:].tobytes())))
    out = run_driver("decode_check", cases, drivers)
    assert len(out) == 3 * 2 * len(cases)
    for i, (bits, damaged, crc) in enumerate(want):
        for isa in (ISA_SCALAR, ISA_NEON):
            result, got, crcs = out[6 * i + 3 * isa:6 * i + 3 * isa + 3]
            error, level, _, _ = np.frombuffer(result, np.int32)
            assert level == isa  # neon: the CRC32 instructions in use
            assert (error != 0) == damaged, f"case {i} under cap {isa}: error {error}"
            if not damaged:
                assert np.array_equal(np.frombuffer(got, np.uint16), bits.reshape(-1)), f"case {i} cap {isa}"
            assert np.frombuffer(crcs, np.uint32).tolist() == [crc, crc]


def test_rans_decoder_under_qemu(drivers: Path) -> None:
    """The original bits under both caps, the default parameters (32 lanes, 12 probability bits) and others; a
    damaged stream is refused."""
    tensors = [(_trained(5, 40, 900), {"block_size": 4096}, 2), (_trained(6, 7, 333), {"mantissa_bits": 3,
                                                                                       "lanes": 4}, 1),
               (_trained(7, 20, 500), {"mantissa_bits": 2, "low_bits": 5, "block_size": 4096}, 2),  # two stages
               (_trained(8, 40, 900), {"context": "column", "block_size": 4096}, 2),  # tables by column
               (_trained(9, 20, 500), {"mantissa_bits": 2, "low_bits": 5, "context": "row", "block_size": 4096},
                1)]  # by row, two stages
    cases, want = [], []
    for k, (bits, params, threads) in enumerate(tensors):
        t = encode_rans(bits, **params)
        a = t.arrays()
        for damaged in (False, True) if k == 0 else (False,):
            stream = _flip(a["stream"], a["stream"].nbytes // 3) if damaged else a["stream"]
            cases.append([i64(t.alphabet_size, t.n_tables, t.n, t.block_size, t.lanes, t.prob_bits, t.mantissa_bits,
                              t.n_escapes, threads, t.low_bits, t.low_tables, t.context_stride, t.context_period),
                          a["raw"], a["alphabet"], a["tables"],
                          stream, a["block_words"], a["states"], a["block_table"], a["escapes"], a["block_escapes"],
                          np.array([t.crc[c] for c in RANS_CRC_ORDER + RANS_SMALL_ARRAYS], np.uint32),
                          a["symbol_class"],
                          a["low_freqs"], a["context_table"]])
            want.append((bits, damaged))
    out = run_driver("rans_check", cases, drivers)
    assert len(out) == 2 * 2 * len(cases)
    for i, (bits, damaged) in enumerate(want):
        for isa in (ISA_SCALAR, ISA_NEON):
            result, got = out[4 * i + 2 * isa:4 * i + 2 * isa + 2]
            error = int(np.frombuffer(result, np.int32)[0])
            assert (error != 0) == damaged, f"case {i} under cap {isa}: error {error}"
            if not damaged:
                assert np.array_equal(np.frombuffer(got, np.uint16), bits.reshape(-1)), f"case {i} cap {isa}"


def test_fused_ops_under_qemu(drivers: Path) -> None:
    """RoPE and the cache write, the residual add and the norm's two C passes (torch's sqrt between them): the torch
    lines' bits from the plain loops on aarch64 (the norm's sum in ATen's order, as wide as torch's sum here:
    ``norm_lanes``; where the probe found none, the norm's outputs are not compared)."""
    from fast.engine import fused_c

    gen = torch.Generator().manual_seed(8)
    cases, want = [], []
    lanes = fused_c.norm_lanes()
    for n, heads, kv, d, h in ((5, 4, 2, 32, 1000), (3, 3, 1, 16, 37)):
        slots_n, positions_n = 24, 16
        qkv = (torch.randn((n, (heads + 2 * kv) * d), generator=gen) * 4).bfloat16()
        cos, sin = torch.randn((positions_n, d), generator=gen), signed(torch.randn((positions_n, d), generator=gen))
        positions = torch.randint(0, positions_n, (n,), generator=gen)
        slots = torch.randperm(slots_n, generator=gen)[:n]
        k_cache = torch.full((slots_n, kv, d), float("nan"), dtype=torch.bfloat16)
        v_cache = k_cache.clone()
        x, w = torch.randn((n, h), generator=gen) * 3, torch.randn(h, generator=gen)
        delta = (torch.randn((n, h), generator=gen) * 3).bfloat16()
        x_out = x + delta.float()
        ms = (x_out * x_out).mean(dim=-1) + 1e-5
        cases.append([i64(n, heads, kv, d, positions_n, slots_n, h, lanes or 8), np.float32([1e-5]), qkv, cos, sin,
                      positions, slots, k_cache, v_cache, x, delta, w, torch.sqrt(ms)])
        qk = apply_rope(qkv[:, :(heads + kv) * d].reshape(n, heads + kv, d).float(), cos[positions], sin[positions])
        k_cache[slots], v_cache[slots] = qk[:, heads:].bfloat16(), qkv[:, (heads + kv) * d:].reshape(n, kv, d)
        want.append([np.int32([0]), qk[:, :heads].bfloat16(), k_cache, v_cache, x_out, ms,
                     rms_norm(x_out, w, 1e-5).bfloat16()])
    out = run_driver("fused_check", cases, drivers)
    names = ("return code", "q", "k cache", "v cache", "x + delta", "mean squares", "normed rows")
    assert len(out) == len(names) * len(cases)
    for i, expected in enumerate(want):
        for j, (name, item) in enumerate(zip(names, expected, strict=True)):
            if lanes is None and name in ("mean squares", "normed rows"):
                continue
            assert out[len(names) * i + j] == _bytes(item), f"case {i}: {name} differs from the torch lines"


def test_decode_attention_under_qemu(drivers: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows and causal (prefill) rows over shuffled block tables whose unused slots hold NaN: the plain loops
    give on aarch64 the bits they give on x86."""
    if attention_c.library() is None:
        pytest.skip("no C compiler here: nothing to compare with")
    monkeypatch.setenv("UNFIRE_NATIVE_SIMD", "0")
    cases, want = [], []
    for lengths, (kv, group, d), block_size, causal in (([70, 1, 33, 129], (2, 3, 64), 16, False),
                                                        ([9, 40], (1, 4, 32), 4, True)):
        cache, step, q, scale, _ = _setup(lengths, kv, group, d, block_size, len(cases))
        every = torch.arange(step.num_chunks)
        row_lens = (torch.tensor(lengths, dtype=torch.int32) + 1) // 2 if causal else None
        out = torch.zeros(q.shape, dtype=q.dtype)
        assert attention_c.decode_rows(q, cache, 0, step, every, every, scale, out, row_lens)
        tables = step.block_tables.contiguous()
        cases.append([i64(len(lengths), kv * group, kv, d, block_size, cache.num_blocks, tables.shape[1],
                          max(lengths)), np.float32([scale]), q, cache.k[0], cache.v[0], tables, step.seq_lens,
                      every, every, b"" if row_lens is None else row_lens])
        want.append(out)
    out = run_driver("attention_check", cases, drivers)
    assert len(out) == 2 * len(cases)
    for i, expected in enumerate(want):
        assert np.frombuffer(out[2 * i], np.int32)[0] == 0
        assert out[2 * i + 1] == _bytes(expected), f"case {i}: aarch64's plain loops differ from x86's"
