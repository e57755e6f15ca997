"""The tile products on aarch64, under ``qemu-aarch64`` (issue 42): the NEON path and the scalar fmaf loop, plain and
compressed, give the x86 products' bits (AVX-512 BF16, AVX2 and scalar follow one order: fast/codec/matmul_c.py).

The driver is tests/native/tile_check.c; the records and the tools are those of tests/test_aarch64.py (skipped
without ``gcc-aarch64-linux-gnu`` and ``qemu-user``, except under ``CI=true``, where they fail).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fast.codec import matmul_c
from fast.codec.encode import encode
from fast.codec.matmul_c import TileWeight
from tests.test_aarch64 import i64, run_driver


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aarch64_tiles")


def _weights(rng: np.random.Generator, n: int, k: int, kind: str) -> torch.Tensor:
    bits = (rng.standard_normal((n, k)) * 0.05).astype(np.float32).view(np.uint32) >> 16
    bits = bits.astype(np.uint16)
    if kind == "verbatim":  # exponents outside any 16-entry palette: patched words
        bits[:, ::5] = (bits[:, ::5] & 0x807F) | (rng.integers(1, 250, bits[:, ::5].shape) << 7).astype(np.uint16)
    if kind == "subnormal":  # flushed on every path, as VDPBF16PS flushes them
        bits[rng.random(bits.shape) < 0.2] &= 0x807F
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


@pytest.mark.parametrize("kind", ["plain", "verbatim", "subnormal"])
def test_neon_and_scalar_tile_products_give_the_x86_bits(kind: str, where: Path) -> None:
    rng = np.random.default_rng({"plain": 1, "verbatim": 2, "subnormal": 3}[kind])
    cases, want = [], []
    for m, n, k, threads in ((1, 70, 101, 1), (3, 33, 64, 2), (9, 40, 576, 3)):
        w = _weights(rng, n, k, kind)
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(torch.bfloat16)
        if kind == "subnormal":
            x.view(torch.int16)[torch.from_numpy(rng.random((m, k)) < 0.2)] &= 0x807F
        _, form = encode(w.contiguous(), with_palette_form=True)
        plain, comp = TileWeight.from_dense(w), TileWeight.from_palette(form)
        kp = -(-k // 32) * 32
        xp = torch.zeros((m, kp), dtype=torch.bfloat16)
        xp[:, :k] = x
        cases.append([i64(m, n, k, threads), xp, plain.plain, comp.sm, comp.idx, comp.palette, comp.pstart,
                      comp.pword, comp.pexp])
        x86 = {p: plain.matmul(x, path=p) for p in matmul_c.runnable_paths() if p != matmul_c.AMX}
        first = next(iter(x86.values()))
        assert all(torch.equal(y.view(torch.int16), first.view(torch.int16)) for y in x86.values())
        want.append(first.view(torch.int16).numpy().reshape(-1))
    out = run_driver("tile_check", cases, where)
    assert len(out) == 8 * len(cases)
    for i, bits in enumerate(want):
        for j, what in enumerate(("neon plain", "neon compressed", "scalar plain", "scalar compressed")):
            rc, y = out[8 * i + 2 * j], out[8 * i + 2 * j + 1]
            assert int(np.frombuffer(rc, np.int32)[0]) == 0, f"case {i} {what}: tm_matmul returned {rc}"
            got = np.frombuffer(y, np.int16)
            diff = np.flatnonzero(got != bits)
            assert diff.size == 0, (f"case {i} {what} ({kind}): {diff.size} outputs differ from x86's, first at "
                                    f"{diff[0]}: {got[diff[0]]:#06x} vs {bits[diff[0]]:#06x}")
