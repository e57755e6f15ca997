"""Rotary position embeddings (RoPE), Hugging Face layout, with linear and llama3 frequency scaling.

Each head vector of size d is split into two halves (x1, x2); pair i = (x1[i], x2[i]) is rotated by
the angle ``position * inv_freq[i]`` with ``inv_freq[i] = theta ** (-2i / d)``. (llama.cpp pairs
adjacent dimensions instead; the loader undoes the GGUF converter's row permutation so that this
layout applies to every checkpoint.)

Scaling stretches the low frequencies for long contexts: ``linear`` divides every frequency by a
factor; ``llama3`` (Llama 3.1) divides only the low ones and blends the middle band smoothly.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                        freq_factors: np.ndarray | None = None) -> np.ndarray:
    """``inv_freq`` of shape [head_dim // 2] as float32, after scaling (and GGUF ``rope_freqs``)."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    inv = inv.astype(np.float32).astype(np.float64)  # as Hugging Face holds it: float32
    if scaling is not None and scaling["type"] == "linear":
        inv = inv / scaling["factor"]
    elif scaling is not None and scaling["type"] == "llama3":
        inv = _llama3(inv, scaling)
    if freq_factors is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
        inv = inv / np.asarray(freq_factors, dtype=np.float64)
    return inv.astype(np.float32)


def _llama3(inv: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, interpolate in between."""
    factor, low, high, old_len = (
        s["factor"],
        s["low_freq_factor"],
        s["high_freq_factor"],
        s["original_max_position"],
    )
    wavelen = 2 * math.pi / inv
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    out = np.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, out)


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of shape [len(positions), head_dim] (each half repeated), float32."""
    angles = np.asarray(positions, dtype=np.float32)[:, None] * inv_freq[None, :]  # float32, as HF
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate ``x`` of shape [tokens, heads, head_dim] by per-token tables [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
