"""Unweight in NumPy: lossless compression of bf16 weights (the format is FORMAT.md, beside this
file).

Public API (bf16 tensors are uint16 arrays of bit patterns, see reference/bf16.py):

    encode(bits, *, palette_size=16, chunk_size=64, chunks_per_group=32, max_code_length=12)
        -> CompressedTensor            the Huffman form (header fields + arrays sm, stream,
                                       offsets, vchunks, vexp; .header(), .nbytes, .check())
    decode(ct) -> bits                 the plain decoder (decoder.py: FORMAT.md 3.5 line by line,
    slow);
                                       bit-exact; verifies every check and CRC, raises CodecError
    decode_many([ct, ...]) -> [bits]   the same, one lockstep NumPy pass over all their groups
    (lockstep.py)
    CompressedTensor.from_parts(header, arrays, name)   rebuild from stored parts, fully checked
    to_palette(ct) -> PaletteTensor    transcode to the palette form (palette[16], idx[R,
    ceil(C/2)],
                                       sm[R, C], vchunks, vexp, row_vstart[R+1])
    from_palette(pt) -> CompressedTensor   back to the Huffman form (byte-identical)
    palette_to_bf16(pt) -> bits        decode the palette form
    decode_table(code_lengths, max_code_length) -> (symbols, lengths)   the 2^L decoding LUT
    canonical_codes(code_lengths), code_lengths(counts, max_length)     the Huffman pieces
    compress_checkpoint(source, out, to_bf16=False, mode="unweight"|"rans"),
    decompress_checkpoint(path, out),
    Container(path)                    (a container may hold tensors of both forms)
    CodecError                         the one exception for corrupt / malformed / unsupported input

The rANS mode (our own, FORMAT.md section 9; smaller than every peer, decoded by interleaved lanes):

    encode_rans(bits, *, block_size=None, lanes=32, prob_bits=12, mantissa_bits=None, max_tables=16,
                decode_cost=0.25)
        -> RansTensor                  header fields + arrays raw, alphabet, tables, stream,
        block_words,
                                       states, block_table, escapes, block_escapes; .header(),
                                       .nbytes, .check()
    decode_rans(t) -> bits             bit-exact; verifies every check and CRC, raises CodecError
    encode_rans_many([bits, ...]), decode_rans_many([t, ...])   many tensors per lockstep pass
    RansTensor.from_parts(header, arrays, name)

Command line:
``python -m reference.codec compress IN OUT [--to-bf16] [--mode rans]``, ``... decompress IN OUT``,
``... inspect FILE``.
"""

from reference.codec.codec import decode, encode
from reference.codec.container_read import Container
from reference.codec.container_write import compress_checkpoint, decompress_checkpoint
from reference.codec.errors import CodecError
from reference.codec.format import CompressedTensor
from reference.codec.huffman import canonical_codes, code_lengths, decode_table
from reference.codec.layout import Layout
from reference.codec.lockstep import decode_many, decode_symbols
from reference.codec.paletteform import PaletteTensor, from_palette, palette_to_bf16, to_palette
from reference.codec.rans import (
    RansTensor,
    decode_rans,
    decode_rans_many,
    encode_rans,
    encode_rans_many,
)

__all__ = [
    "CodecError", "CompressedTensor", "Container", "Layout", "PaletteTensor", "RansTensor",
    "canonical_codes",
    "code_lengths", "compress_checkpoint", "decode", "decode_many", "decode_rans",
    "decode_rans_many",
    "decode_symbols", "decode_table", "decompress_checkpoint", "encode", "encode_rans",
    "encode_rans_many", "from_palette", "palette_to_bf16", "to_palette",
]
