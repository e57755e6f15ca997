"""Writing the Huffman bit stream (FORMAT.md section 3.4).

The stream is a uint32 array; bit i is bit ``31 - i % 32`` of word ``i // 32`` (MSB first), and
each code is written most significant bit first. Reading it: ``decoder.peek`` (the plain decoder)
and ``lockstep.read_groups`` (all groups at once).
"""

from __future__ import annotations

import numpy as np


def pack_codes(acc: np.ndarray, codes: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> None:
    """OR codes (uint64 values of ``lengths`` bits) into a uint64 word accumulator at bit
    ``starts``.

    ``acc`` holds one 32-bit word per entry. A code of <= 16 bits starting at bit ``s`` lies in the
    64-bit window made of words ``s >> 5`` and ``(s >> 5) + 1``: shift it into place in that window,
    then add the high half to the first word and the low half to the second. Codes never overlap,
    so adding is the same as OR-ing (and ``np.add.at`` is much faster than ``np.bitwise_or.at``).
    """
    word = starts >> 5
    shift = (64 - lengths - (starts & 31)).astype(np.uint64)
    piece = codes.astype(np.uint64) << shift
    np.add.at(acc, word, piece >> np.uint64(32))
    np.add.at(acc, word + 1, piece & np.uint64(0xFFFFFFFF))
