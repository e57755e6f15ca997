"""Canonical, length-limited Huffman codes: code lengths by package-merge, codes, decoding table.

Three steps, each a small function:

1. ``code_lengths(counts, max_length)``: how many bits each symbol gets. Plain Huffman gives the
   optimal lengths but they can be arbitrarily long; a decoder that looks codes up in a table of
   2^max_length entries needs a bound. Package-merge (Larmore and Hirschberg, 1990) finds the
   optimal lengths *under* that bound.
2. ``canonical_codes(lengths)``: the bit patterns. A canonical code is fully determined by its
   lengths (symbols sorted by (length, symbol) get consecutive codes), so only the lengths are
   stored.
3. ``decode_table(lengths, max_length)``: a lookup table indexed by the next ``max_length`` bits of
   the stream that gives the symbol those bits start with and its length, in one step.

See FORMAT.md section 3.3 for the rules a stored set of lengths must follow.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from reference.codec.errors import CodecError

MAX_SUPPORTED_LENGTH = 16


def code_lengths(counts: Sequence[int] | np.ndarray, max_length: int) -> list[int]:
    """Optimal code lengths (<= max_length) for symbols with these counts; 0 for unused symbols.

    Package-merge, the "coin collector" view: every used symbol s is a coin of each denomination
    2^-1, 2^-2, ..., 2^-max_length, with numismatic value count[s]. Pick the cheapest set of coins
    whose denominations sum to n - 1 (n = number of used symbols); the number of coins of symbol s
    picked is its code length. The algorithm builds the cheapest picks level by level:

    * start at the smallest denomination with the list of symbols sorted by count;
    * going up one level, pair up neighbours of the current list into "packages" (a package is
      worth the sum of its two parts and stands for one coin of the next denomination up) and
      merge the packages with a fresh copy of the symbols, sorted by value;
    * at the top level keep the 2n - 2 cheapest entries and count how often each symbol occurs.

    Ties are broken deterministically: symbols by (count, symbol index); when merging, on equal
    value a single symbol comes before a package. One used symbol gets length 1.
    """
    counts = [int(c) for c in counts]
    if not 1 <= max_length <= MAX_SUPPORTED_LENGTH:
        raise CodecError(f"max code length must be 1..{MAX_SUPPORTED_LENGTH}, got {max_length}")
    if any(c < 0 for c in counts):
        raise CodecError("symbol counts must be non-negative")
    lengths = [0] * len(counts)
    used = [s for s, c in enumerate(counts) if c > 0]
    if len(used) == 1:
        lengths[used[0]] = 1
    if len(used) <= 1:
        return lengths
    if len(used) > 2**max_length:
        raise CodecError(f"{len(used)} symbols cannot have codes of at most {max_length} bits")

    # an entry is (value, symbols it contains); symbols sorted by count, then by index
    singles = sorted(([counts[s], [s]] for s in used), key=lambda e: (e[0], e[1][0]))
    current = list(singles)
    for _ in range(max_length - 1):
        packages = [
            [a[0] + b[0], a[1] + b[1]] for a, b in zip(current[0::2], current[1::2], strict=False)
        ]
        current = _merge(singles, packages)
    for entry in current[: 2 * len(used) - 2]:
        for s in entry[1]:
            lengths[s] += 1
    return lengths


def _merge(singles: list[list], packages: list[list]) -> list[list]:
    """Merge two lists sorted by value into one; on a tie the single symbol goes first."""
    merged, i, j = [], 0, 0
    while i < len(singles) or j < len(packages):
        if j == len(packages) or (i < len(singles) and singles[i][0] <= packages[j][0]):
            merged.append(singles[i])
            i += 1
        else:
            merged.append(packages[j])
            j += 1
    return merged


def check_lengths(lengths: Sequence[int], max_length: int) -> None:
    """Raise CodecError unless these lengths form a valid code under FORMAT.md section 3.3."""
    _check_lengths(tuple(lengths), max_length)


@functools.lru_cache(maxsize=256)
def _check_lengths(lengths: tuple[int, ...], max_length: int) -> None:
    """check_lengths, remembered for the codes that passed (an error is raised again each time): a
    decoder checks every tensor's header, and a checkpoint's tensors share few codes."""
    lengths, max_length = tuple(map(int, lengths)), int(max_length)  # 2 ** (L - l) must not wrap
    if not 1 <= max_length <= MAX_SUPPORTED_LENGTH:
        raise CodecError(f"max code length must be 1..{MAX_SUPPORTED_LENGTH}, got {max_length}")
    if any(not 0 <= length <= max_length for length in lengths):
        raise CodecError(f"code lengths must be 0..{max_length}, got {list(lengths)}")
    used = [length for length in lengths if length > 0]
    if len(used) == 1 and used[0] != 1:
        raise CodecError(f"a single used symbol must have length 1, got {used[0]}")
    if len(used) >= 2:
        kraft = sum(2 ** (max_length - length) for length in used)  # sum of 2^-l, scaled by 2^L
        if kraft != 2**max_length:
            state = "over-subscribed" if kraft > 2**max_length else "incomplete"
            raise CodecError(f"code lengths {list(lengths)} do not form a complete prefix code "
                             f"({state})")


def canonical_codes(lengths: Sequence[int]) -> list[int]:
    """The canonical code of each symbol (an integer whose low ``lengths[s]`` bits are the code).

    As in DEFLATE: count the symbols of each length, give the first code of each length, then hand
    out consecutive codes to the symbols in index order. Unused symbols (length 0) get code 0.
    """
    max_length = max(lengths, default=0)
    bl_count = [0] * (max_length + 1)
    for length in lengths:
        if length:
            bl_count[length] += 1
    next_code = [0] * (max_length + 1)
    code = 0
    for length in range(1, max_length + 1):
        code = (code + bl_count[length - 1]) << 1
        next_code[length] = code
    codes = [0] * len(lengths)
    for s, length in enumerate(lengths):
        if length:
            codes[s] = next_code[length]
            next_code[length] += 1
    return codes


def decode_table(lengths: Sequence[int], max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """The decoding table: ``(symbol, length)``, two uint8 arrays of 2^max_length entries.

    Entry ``w`` is the symbol whose code is a prefix of the max_length-bit window ``w`` (MSB first)
    and that code's length. Entries no code is a prefix of have length 0: reading one means the
    stream is corrupt. Call ``check_lengths`` first.
    """
    size = 1 << max_length
    symbols = np.zeros(size, np.uint8)
    table_lengths = np.zeros(size, np.uint8)
    for s, (code, length) in enumerate(zip(canonical_codes(lengths), lengths, strict=True)):
        if length:
            first = code << (max_length - length)  # every window that starts with this code
            last = first + (1 << (max_length - length))
            symbols[first:last] = s
            table_lengths[first:last] = length
    return symbols, table_lengths
