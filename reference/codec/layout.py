"""Where the chunks and groups of a tensor are (FORMAT.md section 1).

A tensor of shape (d0, ..., dk) is a matrix of ``rows = d0 * ... * d(k-1)`` and ``cols = dk``.
Each row is cut into chunks of ``chunk_size`` weights (the last one of a row may be short); chunk
``k = r * chunks_per_row + j``. Groups are runs of ``chunks_per_group`` consecutive chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    shape: tuple[int, ...]
    chunk_size: int = 64
    chunks_per_group: int = 32

    @property
    def n(self) -> int:
        """Number of weights."""
        return math.prod(self.shape)

    @property
    def cols(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1]) if self.shape else 1

    @property
    def chunks_per_row(self) -> int:
        return -(-self.cols // self.chunk_size)

    @property
    def n_chunks(self) -> int:
        return self.rows * self.chunks_per_row

    @property
    def n_groups(self) -> int:
        return -(-self.n_chunks // self.chunks_per_group)

    @property
    def aligned(self) -> bool:
        """True when every chunk is full (chunk_size divides cols): chunks are then a plain
        reshape."""
        return self.cols % self.chunk_size == 0

    def chunk_start(self, k: np.ndarray) -> np.ndarray:
        """Flat index of the first weight of each chunk in ``k`` (int64 array of chunk ids)."""
        k = np.asarray(k, np.int64)
        return (k // self.chunks_per_row) * self.cols + (k % self.chunks_per_row) * self.chunk_size

    def chunk_length(self, k: np.ndarray) -> np.ndarray:
        """Number of weights in each chunk of ``k`` (chunk_size, or less for a row's last chunk)."""
        k = np.asarray(k, np.int64)
        return np.minimum(self.chunk_size, self.cols - (k % self.chunks_per_row) * self.chunk_size)

    def flat_range(self, k0: int, k1: int) -> tuple[int, int]:
        """The flat weights [begin, end) that chunks k0 .. k1-1 cover (chunks tile the tensor in
        order)."""
        begin = int(self.chunk_start(k0)) if k0 < self.n_chunks else self.n
        end = int(self.chunk_start(k1)) if k1 < self.n_chunks else self.n
        return begin, end

    def chunk_matrix(self, flat: np.ndarray, k0: int, k1: int, fill: int = 0) -> np.ndarray:
        """Chunks k0 .. k1-1 of a flat per-weight array as a (k1 - k0, chunk_size) matrix.

        A short chunk's missing tail is ``fill``. When the layout is aligned this is a reshape.
        """
        if self.aligned:
            begin, end = self.flat_range(k0, k1)
            return flat[begin:end].reshape(k1 - k0, self.chunk_size)
        if k1 <= k0:
            return np.full((0, self.chunk_size), fill, flat.dtype)
        index = self.chunk_start(np.arange(k0, k1, dtype=np.int64))[:, None] + np.arange(
            self.chunk_size
        )
        valid = self.column_mask(k0, k1)
        return np.where(valid, flat[np.where(valid, index, 0)], fill).astype(flat.dtype, copy=False)

    def column_mask(self, k0: int, k1: int) -> np.ndarray:
        """(k1 - k0, chunk_size) booleans: which slots of chunks k0 .. k1-1 hold a real weight."""
        lengths = self.chunk_length(np.arange(k0, k1, dtype=np.int64))
        return np.arange(self.chunk_size) < lengths[:, None]

    def unchunk(self, matrix: np.ndarray, k0: int, k1: int) -> np.ndarray:
        """Inverse of ``chunk_matrix``: the flat weights of chunks k0 .. k1-1 from their matrix."""
        if self.aligned:
            return matrix.reshape(-1)
        return matrix[self.column_mask(k0, k1)]
