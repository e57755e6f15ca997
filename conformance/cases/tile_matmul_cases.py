"""The CPU tile products (fast/codec/native/tile_matmul.c): compressed == plain, bit for bit.

Level: same-kernel exact. For a weight W and input x, the reference side is the tile product of the
plain bf16 tiles of W (``TileWeight.from_dense``); the fast side is the same product reading the
palette form (``TileWeight.from_palette``: each tile decoded in registers or L1 right before use).
The fast side runs every path this CPU can execute (``fast.cpu_isa.supported()``: AMX, AVX-512 BF16,
AVX2, NEON, scalar; none is skipped because another is missing). Its reference is the same path on the
plain tiles for AMX, and the scalar fmaf chain on the plain tiles for every other path: they follow the
portable order, so compressed AVX2 equals plain scalar bit for bit. Each row alone equals the batch on
the default path. A second output checks the decoded tiles against the plain tiles word by word.

Families: odd shapes (K not a multiple of the 32-input step nor of the 64-weight chunk), a full
palette (16 exponents in use, so padding words are patches), every chunk verbatim, and weights with
NaN, infinities, subnormals and -0.0; batches of 1, 2, 3, 4, 5, 17, 33 and 64 rows. The input rows'
values are random bf16; the output is compared as bit patterns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.registry import Case, Gen, Level, register

ROWS = (1, 2, 3, 4, 5, 17, 33, 64)


def _weights(kind: str, rng: np.random.Generator) -> np.ndarray:
    """bf16 bits [N, K] of one family."""
    from reference.bf16 import float32_to_bf16

    n, k = {"odd": (37, 101), "full_palette": (33, 130), "all_verbatim": (20, 70), "special": (18, 96)}[kind]
    w = float32_to_bf16((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    if kind == "full_palette":  # 20 exponents spread evenly: the top 16 leave no zero slot
        exps = rng.integers(100, 120, size=w.shape).astype(np.uint16)
        w = (w & 0x807F) | (exps << 7)
    elif kind == "all_verbatim":  # every chunk holds an exponent outside any 16-entry palette
        w[:, ::3] = (w[:, ::3] & 0x807F) | (rng.integers(1, 250, size=w[:, ::3].shape).astype(np.uint16) << 7)
    elif kind == "special":
        flat = w.reshape(-1)
        spots = rng.choice(flat.size, 60, replace=False)
        flat[spots[:10]] = 0x7FC1  # NaN with a payload
        flat[spots[10:20]] = 0x7F80  # +inf
        flat[spots[20:30]] = 0xFF80  # -inf
        flat[spots[30:45]] = rng.integers(1, 0x7F, 15)  # subnormals
        flat[spots[45:]] = 0x8000  # -0.0
    return w


def _inputs(kind: str):
    def make(gen: Gen) -> dict[str, Any]:
        import torch

        from fast.codec.encode import encode

        bits = _weights(kind, gen.rng)
        w = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        _, form = encode(w.contiguous(), with_palette_form=True)
        xs = [torch.from_numpy((gen.rng.standard_normal((m, bits.shape[1])) * 2).astype(np.float32)).to(
            torch.bfloat16) for m in ROWS]
        return {"w": w, "form": form, "xs": xs}

    return make


def _paths() -> list[int]:
    from fast.codec import matmul_c

    return matmul_c.runnable_paths()


def _same_bits(y: Any) -> Any:
    """The output as int16 bit patterns with every NaN made one NaN (payloads follow each ISA's rules)."""
    import torch

    bits = y.view(torch.int16).clone()
    bits[torch.isnan(y)] = 0x7FC0
    return bits


def _run(tw: Any, inputs: dict[str, Any], reference: bool) -> dict[str, Any]:
    from fast.codec import matmul_c

    out = {"tiles": tw.decoded_tiles(vector=False)}
    for x in inputs["xs"]:
        for path in _paths():
            name = matmul_c.ISA_OF_PATH[path]
            # the reference of a portable-order path is the scalar fmaf chain
            ref_path = path if path == matmul_c.AMX else matmul_c.SCALAR
            y = tw.matmul(x, path=ref_path if reference else path, threads=2)
            out[f"rows={x.shape[0]} {name}"] = _same_bits(y)
    return out


def _reference(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.codec.matmul_c import TileWeight

    tw = TileWeight.from_dense(inputs["w"])
    out = _run(tw, inputs, reference=True)
    for x in inputs["xs"]:  # batch invariance: the fast side multiplies each row alone
        out[f"rows={x.shape[0]} default path, each row alone"] = _same_bits(tw.matmul(x))
    return out


def _fast(inputs: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fast.codec import matmul_c

    tw = matmul_c.TileWeight.from_palette(inputs["form"])
    out = _run(tw, inputs, reference=False)
    for x in inputs["xs"]:
        alone = torch.cat([tw.matmul(x[i:i + 1]) for i in range(x.shape[0])])
        out[f"rows={x.shape[0]} default path, each row alone"] = _same_bits(alone)
    lib = matmul_c.library()
    if lib is not None and lib.tm_avx512_ready():  # the vector tile decoder, where the CPU has it
        out["tiles"] = tw.decoded_tiles(vector=True)
    return out


def _requires() -> str | None:
    from fast.codec import matmul_c

    return None if matmul_c.library() is not None else "no C compiler: the tile matmul is not built"


for _kind in ("odd", "full_palette", "all_verbatim", "special"):
    register(Case(f"codec.tile_matmul_c.{_kind}", Level.SAME_KERNEL, _inputs(_kind), _reference, _fast,
                  about="C tile product on the palette form vs the plain tiles (AMX) or the scalar fmaf chain "
                  f"(every other ISA), every ISA this CPU has, rows 1-64 ({_kind} weights); each row alone vs "
                  "the batch",
                  requires=_requires))
