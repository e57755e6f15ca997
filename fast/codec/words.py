"""The Huffman stream's words in torch (FORMAT.md 3.4): the one place that turns 64-bit words into the
format's 32-bit words, and 32-bit words into 64-bit reading windows.

The format's stream is uint32 words, each MSB first. Writers in torch pack bits into int64 words (MSB
first, 64 bits at a time); on a little-endian machine an int64 is its low half then its high half, so
the halves of every int64 are swapped to give the format's word order. Readers peek any L <= 32 bits
at bit ``pos`` from one 64-bit window: words ``pos >> 5`` and ``(pos >> 5) + 1`` side by side.
"""

from __future__ import annotations

import torch


def stream_from_words64(words: torch.Tensor, stream_bits: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """int64 words, MSB first -> the format's int32 stream (``ceil(B / 32) + 1`` words). Changes ``words``.

    Each int64 becomes [high half, low half] in memory: ``w = w << 32 | (w >>> 32)``; ``scratch`` (an
    int64 tensor as long as ``words``) saves an allocation on repeated calls.
    """
    high_half = torch.bitwise_right_shift(words, 32, out=scratch) if scratch is not None else words >> 32
    high_half &= 0xFFFFFFFF  # >> is arithmetic on int64: drop the copies of the sign bit
    words <<= 32
    words |= high_half
    return words.view(torch.int32)[: (stream_bits + 31) // 32 + 1].clone()


def stream_windows(stream: torch.Tensor) -> torch.Tensor:
    """int64 [len - 1]: element i holds stream words i (high half) and i + 1 (low half), the bits of a uint64."""
    w = stream.to(torch.int64) & 0xFFFFFFFF
    return (w[:-1] << 32) | w[1:]
