"""The plain Huffman decoder: FORMAT.md section 3.5, one line of code per line of the spec.

Read it beside FORMAT.md. It decodes one group at a time, one weight at a time, in plain Python:

    for each group g:                      pos = offsets[g]
        for each chunk k of the group:
            verbatim? (the next entry of vchunks is k)  -> its exponents are the row of vexp
            else, for each weight of the chunk:         (i, l) = LUT[peek(pos)]; l == 0 is
            corruption
                                                        exponent = palette[i]; pos += l
        after the group's last chunk:      pos must equal offsets[g + 1]
    finally, every weight:                 b = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)

It is slow (about a microsecond per weight) and obviously right: it is what every faster decoder
is checked against (``reference.codec.lockstep`` runs all groups at once in NumPy; ``fast/codec``
has a C decoder and a Triton one). ``decode`` calls ``ct.check()`` first, so the arrays have the
lengths the header implies and their CRCs hold; this file checks what only decoding can find.
"""

from __future__ import annotations

import numpy as np

from reference.bf16 import join_sign_mantissa
from reference.codec.errors import CodecError
from reference.codec.format import CompressedTensor, crc32
from reference.codec.huffman import decode_table


def peek(stream: list[int], pos: int, n_bits: int) -> int:
    """The ``n_bits`` bits of the stream that start at bit ``pos``, as an integer (FORMAT.md 3.4).

    Two neighbouring 32-bit words make a 64-bit window; shift the wanted bits to its top, keep
    n_bits.
    """
    window = (stream[pos >> 5] << 32) | stream[(pos >> 5) + 1]
    return ((window << (pos & 31)) % 2**64) >> (64 - n_bits)


def decode_exponents(ct: CompressedTensor) -> np.ndarray:
    """The exponent of every weight (uint8, flat, C order), decoded group by group.

    Raises CodecError on an invalid code, a group that runs off the stream or that does not end
    exactly where the next one starts.
    """
    layout = ct.layout
    table_symbols, table_lengths = (
        t.tolist() for t in decode_table(ct.code_lengths, ct.max_code_length)
    )
    stream, offsets, vchunks = ct.stream.tolist(), ct.offsets.tolist(), ct.vchunks.tolist()
    exponent = [0] * layout.n
    v = 0  # the next verbatim chunk: vchunks is sorted, so one pointer walks it
    for g in range(layout.n_groups):
        pos = offsets[g]
        first_chunk = g * layout.chunks_per_group
        for k in range(first_chunk, min(first_chunk + layout.chunks_per_group, layout.n_chunks)):
            row, j = divmod(k, layout.chunks_per_row)
            # flat index of the chunk's first weight
            start = row * layout.cols + j * layout.chunk_size
            length = min(layout.chunk_size, layout.cols - j * layout.chunk_size)
            # a verbatim chunk: exponents stored as they are
            if v < len(vchunks) and vchunks[v] == k:
                exponent[start : start + length] = ct.vexp[v, :length].tolist()
                v += 1
                continue
            for w in range(length):
                try:
                    window = peek(stream, pos, ct.max_code_length)
                except IndexError:
                    raise CodecError(f"tensor {ct.name!r}: group {g} runs past the end of the "
                                     "stream") from None
                if table_lengths[window] == 0:
                    raise CodecError(f"tensor {ct.name!r}: group {g}: invalid code at bit {pos} "
                                     "(corrupt stream)")
                exponent[start + w] = ct.palette[table_symbols[window]]
                pos += table_lengths[window]
        if pos != offsets[g + 1]:
            raise CodecError(f"tensor {ct.name!r}: group {g} ended at bit {pos} instead of "
                             f"{offsets[g + 1]} "
                             "(corrupt stream)")
    return np.array(exponent, np.uint8)


def decode_plain(ct: CompressedTensor) -> np.ndarray:
    """Decompress one tensor with the plain decoder: its bf16 bits (uint16, original shape),
    verified."""
    ct.check()
    exponent = decode_exponents(ct).astype(np.uint16)
    bits = join_sign_mantissa(ct.sm, exponent)
    if crc32(bits) != ct.crc["data"]:
        raise CodecError(f"tensor {ct.name!r}: decoded data fails its CRC-32 check (corrupt header "
                         "or stream)")
    return bits.reshape(ct.shape)
