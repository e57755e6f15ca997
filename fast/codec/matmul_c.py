"""The CPU product y = x W^T over weights in tile order, plain bf16 or palette form (``native/tile_matmul.c``).

    tw = TileWeight.from_dense(w)                # w: bf16 [N, K]; 2 bytes per weight
    tw = TileWeight.from_palette(form)           # fast.codec.forms.PaletteForm; 1.5 bytes per weight
    y = tw.matmul(x)                             # x: bf16 [..., K] -> bf16 [..., N]

Tile order (described atop tile_matmul.c) is the layout both of the C products read: 16 output
features by 32 inputs per tile, inputs paired. A palette-form tile is decoded into that layout in
registers (or an L1-sized buffer) right before it is multiplied, never into a whole bf16 matrix.

Conformance level: same-kernel exact. The two loaders produce the same bf16 words, so for every x the
compressed product equals the plain product of the decoded weight bit for bit, at every batch size
(``conformance/cases/tile_matmul_cases.py``, ``tests/test_tile_matmul.py``). Against a float64 product
the result is bounded like any bf16 matmul with float32 sums (VDPBF16PS and TDPBF16PS treat bf16
subnormal inputs as zero).

Which product runs (``path=None``): one family per machine, the strongest that ``fast.cpu_isa`` allows
(``UNFIRE_CPU_ISA`` caps it), for every row count: AMX (Intel, Sapphire Rapids on); AVX-512 BF16
(``AVX512``: AMD Zen 4/5, Intel Cooper Lake on, and any AMX CPU capped to it); AVX2 + FMA (``AVX2``) or
NEON (``NEON``, aarch64), which follow the portable order (each output one float32 FMA chain in order of
k: the same bits on every ISA that follows it, and the ``SCALAR`` fmaf loop is its anchor). Each output
row is then the same bits whatever the number of rows, the row's place in the batch or the threads:
batch-invariant. AMX and VDPBF16PS round their sums their own way (about 1 output in 10^4 differs by one
bf16 step from the portable order), which is why one of them serves every M. ``path`` forces one (the
benchmarks and the conformance cases compare them); ``available()`` says whether the engine uses them
(the C build, and an ISA above scalar: the scalar loop is the anchor, not a server).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fast import build_c, cpu_isa
from fast.errors import KernelInputError

SOURCE = Path(__file__).with_name("native") / "tile_matmul.c"
_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "tm_amx_ready": (_INT, []),
    "tm_avx512_ready": (_INT, []),
    "tm_avx2_ready": (_INT, []),
    "tm_neon_ready": (_INT, []),
    "tm_matmul": (_INT, [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _INT, _INT, _I64, _I64]),
    "tm_decode_tiles": (_INT, [_P, _P, _P, _P, _P, _P, _I64, _I64, _P, _INT]),
    "tm_unpack": (_INT, [_P, _P, _P, _P, _P, _P, _I64, _I64, _P, _INT, _INT]),
}
TILE_N, TILE_K, TILE_WORDS = 16, 32, 512
AVX512, AMX, SCALAR, AVX2, NEON = 0, 1, 2, 3, 4  # the C code's path numbers
PATH_OF_ISA = {"amx": AMX, "avx512": AVX512, "avx2": AVX2, "neon": NEON, "scalar": SCALAR}
ISA_OF_PATH = {v: k for k, v in PATH_OF_ISA.items()}


def library() -> ctypes.CDLL | None:
    return build_c.load(_state, _lock, SOURCE, _SIGNATURES, "the tile matmul", "oneDNN (torch)")


def available() -> bool:
    """True when the engine's products go through the tile products: the C build, and an ISA above scalar."""
    return library() is not None and cpu_isa.selected() != "scalar"


def runnable_paths() -> list[int]:
    """Every path this CPU can run, weakest first (the conformance gate runs them all)."""
    return [PATH_OF_ISA[name] for name in cpu_isa.supported()] if library() is not None else []


def _tile_order(a: np.ndarray, n: int, k: int, fill: int = 0) -> np.ndarray:
    """[N, K] -> flat tile order [P, T, 16 pairs, 16 outputs, 2], padded with ``fill``."""
    p, t = -(-n // TILE_N), -(-k // TILE_K)
    padded = np.full((p * TILE_N, t * TILE_K), fill, a.dtype)
    padded[:n, :k] = a
    return np.ascontiguousarray(padded.reshape(p, TILE_N, t, TILE_K // 2, 2).transpose(0, 2, 3, 1, 4)).reshape(-1)


@dataclass
class TileWeight:
    """A weight [out_features, in_features] in tile order: ``plain`` words, or the compressed arrays."""

    out_features: int
    in_features: int
    plain: torch.Tensor | None = None  # int16 [P * T * 512] (bf16 bits)
    sm: torch.Tensor | None = None  # uint8 [P * T * 512]
    idx: torch.Tensor | None = None  # uint8 [P * T * 256]
    palette: torch.Tensor | None = None  # uint8 [16]
    pstart: torch.Tensor | None = None  # int64 [P * T + 1]: patches of tile i are pstart[i]:pstart[i+1]
    pword: torch.Tensor | None = None  # int16 [patches]: the word in its tile
    pexp: torch.Tensor | None = None  # uint8 [patches]: its exponent

    @property
    def panels(self) -> int:
        return -(-self.out_features // TILE_N)

    @property
    def steps(self) -> int:
        return -(-self.in_features // TILE_K)

    @property
    def compressed(self) -> bool:
        return self.plain is None

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> TileWeight:
        if weight.dim() != 2 or weight.dtype != torch.bfloat16:
            raise KernelInputError(f"TileWeight: expected a bf16 [out, in] weight, got {weight.dtype} "
                                   f"{tuple(weight.shape)}")
        n, k = weight.shape
        bits = weight.detach().cpu().contiguous().view(torch.int16).numpy()
        return cls(n, k, plain=torch.from_numpy(_tile_order(bits, n, k)))

    @classmethod
    def from_palette(cls, form: object) -> TileWeight:
        """From a ``fast.codec.forms.PaletteForm`` (on the CPU), verbatim chunks turned into patches."""
        form.check()
        if len(form.shape) != 2:
            raise KernelInputError(f"TileWeight: the weight must be 2-D, got shape {form.shape}")
        n, k = form.shape
        layout = form.layout
        idx = form.idx.cpu().numpy()
        nib = np.empty((n, idx.shape[1] * 2), np.uint8)
        nib[:, 0::2], nib[:, 1::2] = idx & 0x0F, idx >> 4
        palette = form.palette.cpu().numpy()
        zero = np.flatnonzero(palette == 0)  # a slot whose exponent is 0 decodes padding to +0.0
        tiles = _tile_order(nib[:, :k], n, k, fill=int(zero[0]) if zero.size else 0)
        sm = _tile_order(form.sm.cpu().numpy(), n, k)
        # verbatim chunks: every weight of them becomes a patch (its word in tile order, its exponent)
        vchunks = form.vchunks.cpu().numpy().astype(np.int64)
        cs, cpr = layout.chunk_size, layout.chunks_per_row
        rows, cols = vchunks // cpr, (vchunks % cpr) * cs
        col = cols[:, None] + np.arange(cs)
        valid = col < k
        row = np.broadcast_to(rows[:, None], col.shape)[valid]
        col = col[valid]
        exps = form.vexp.cpu().numpy()[valid]
        t_count = -(-k // TILE_K)
        if not zero.size:  # every slot is a real exponent: the padding words become patches to 0
            pad = np.ones((-(-n // TILE_N) * TILE_N, t_count * TILE_K), bool)
            pad[:n, :k] = False
            prow, pcol = np.nonzero(pad)
            row, col = np.concatenate([row, prow]), np.concatenate([col, pcol])
            exps = np.concatenate([exps, np.zeros(prow.size, np.uint8)])
        tile = (row // TILE_N) * t_count + col // TILE_K
        word = ((col % TILE_K) // 2) * 32 + (row % TILE_N) * 2 + col % 2
        order = np.lexsort((word, tile))
        tile, word, exps = tile[order], word[order], exps[order]
        n_tiles = -(-n // TILE_N) * t_count
        pstart = np.searchsorted(tile, np.arange(n_tiles + 1)).astype(np.int64)
        packed = tiles[0::2] | (tiles[1::2] << 4)
        return cls(n, k, sm=torch.from_numpy(sm), idx=torch.from_numpy(np.ascontiguousarray(packed)),
                   palette=form.palette.cpu().contiguous(), pstart=torch.from_numpy(pstart),
                   pword=torch.from_numpy(word.astype(np.int16)), pexp=torch.from_numpy(exps.astype(np.uint8)))

    def nbytes(self) -> int:
        parts = (self.plain, self.sm, self.idx, self.palette, self.pstart, self.pword, self.pexp)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    # ---- use ----
    def decoded_tiles(self, vector: bool | None = None) -> torch.Tensor:
        """Every tile's bf16 words (int16 [P * T * 512]): what the products read (tests, checks). ``vector``:
        the AVX-512 VBMI decoder (None: where ``UNFIRE_CPU_ISA`` allows avx512), else the scalar one."""
        if self.plain is not None:
            return self.plain.clone()
        vector = cpu_isa.allows("avx512") if vector is None else vector
        lib = _need_library()
        count = self.panels * self.steps
        out = torch.empty(count * TILE_WORDS, dtype=torch.int16)
        rc = lib.tm_decode_tiles(*self._compressed_pointers(), 0, count, out.data_ptr(), int(vector))
        if rc:
            raise KernelInputError("tile decode: this CPU lacks AVX-512 VBMI (use vector=False)")
        return out

    def dense(self, out: torch.Tensor | None = None, vector: bool | None = None, threads: int | None = None
              ) -> torch.Tensor:
        """The weight as bf16 [out, in], written into ``out`` (a reusable buffer) if given (``vector`` as in
        ``decoded_tiles``)."""
        shape = (self.out_features, self.in_features)
        if out is None:
            out = torch.empty(shape, dtype=torch.bfloat16)
        elif out.shape != shape or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise KernelInputError(f"TileWeight.dense: out must be a contiguous bf16 {shape}")
        if self.plain is not None:
            words = self.plain.numpy().reshape(self.panels, self.steps, TILE_K // 2, TILE_N, 2)
            full = words.transpose(0, 3, 1, 2, 4).reshape(self.panels * TILE_N, self.steps * TILE_K)
            out.view(torch.int16).copy_(torch.from_numpy(full[: shape[0], : shape[1]]))
            return out
        vector = cpu_isa.allows("avx512") if vector is None else vector
        rc = _need_library().tm_unpack(*self._compressed_pointers(), *shape, out.data_ptr(), int(vector),
                                       threads or torch.get_num_threads())
        if rc:
            raise KernelInputError("tile unpack: this CPU lacks AVX-512 VBMI (use vector=False)")
        return out

    def _compressed_pointers(self) -> tuple[int, ...]:
        got = self.__dict__.get("_pointers")  # the arrays never move: worked out once
        if got is None:
            got = self.__dict__["_pointers"] = (self.sm.data_ptr(), self.idx.data_ptr(), self.palette.data_ptr(),
                                                self.pstart.data_ptr(), self.pword.data_ptr(), self.pexp.data_ptr())
        return got

    def matmul(self, x: torch.Tensor, path: int | None = None, threads: int | None = None) -> torch.Tensor:
        """x [..., in_features] bf16 -> [..., out_features] bf16. ``path``: None = by rows (see module)."""
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise KernelInputError(f"TileWeight.matmul: expected a bf16 CPU tensor, got {getattr(x, 'dtype', x)}")
        if x.shape[-1:] != (self.in_features,):
            raise KernelInputError(f"TileWeight.matmul: expected input [..., {self.in_features}], "
                                   f"got {tuple(x.shape)}")
        lead = x.shape[:-1]
        m = x.numel() // self.in_features if self.in_features else 0
        if m == 0:
            return x.new_empty((*lead, self.out_features))
        lib = _lib() or _need_library()
        if path is None:
            path = _default_path(m)
        kp = self.steps * TILE_K
        if path == AMX:  # the C code packs (and pads) x itself
            mp, xp = -(-m // 16) * 16, x.reshape(m, self.in_features)
            if xp.stride(-1) != 1 or (m > 1 and xp.stride(0) < self.in_features):
                xp = xp.contiguous()
            ldx = xp.stride(0) if m > 1 else self.in_features
        else:
            mp, ldx = m, kp
            if kp == self.in_features and x.is_contiguous():
                xp = x  # already the padded layout the C code reads
            else:
                xp = torch.zeros((mp, kp), dtype=torch.bfloat16)
                xp[:m, : self.in_features] = x.reshape(m, self.in_features)
        y = torch.empty((m, self.out_features), dtype=torch.bfloat16)
        plain = self.plain.data_ptr() if self.plain is not None else None
        compressed = _NO_POINTERS if self.plain is not None else self._compressed_pointers()
        rc = lib.tm_matmul(xp.data_ptr(), m, mp, kp, self.out_features, plain, *compressed, y.data_ptr(), path,
                           threads or torch.get_num_threads(), ldx, self.in_features)
        if rc:
            what = f"path {path} ({ISA_OF_PATH.get(path, 'unknown')}) cannot run on this CPU ({cpu_isa.describe_cpu()})"
            raise KernelInputError({1: "tile matmul: out of memory", 2: f"tile matmul: {what}",
                                    3: "tile matmul: bad sizes"}.get(rc, f"tile matmul: error {rc}"))
        return y.reshape(*lead, self.out_features)


_NO_POINTERS = (None,) * 6


def _lib() -> ctypes.CDLL | None:
    """The built library once it is loaded (a dict lookup: every product asks)."""
    return _state.get("lib")


def _default_path(m: int) -> int:  # noqa: ARG001 (one path serves every row count: batch-invariant)
    """The path of the instruction set in force (``fast.cpu_isa.selected()``)."""
    return PATH_OF_ISA[cpu_isa.selected()]


def _need_library() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise KernelInputError("the tile matmul needs a C compiler (set CC) and UNFIRE_NATIVE unset")
    return lib
