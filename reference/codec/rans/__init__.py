"""The rANS mode (FORMAT.md section 9): our own form, smaller than every peer, decoded by
interleaved lanes.

    t = encode_rans(bits)                 # bits: uint16 bf16 patterns, any shape -> RansTensor
    assert (decode_rans(t) == bits).all()

Files, in reading order: ``coder.py`` (the interleaved rANS coder: frequency quantization, decoding
tables, lockstep encoder and decoder), ``model.py`` (what is coded: joint values and raw bits, field
packing, the alphabet, clustered tables), ``format.py`` (``RansTensor``: header, arrays, every
check),
``codec.py`` (``encode_rans``, ``decode_rans`` and their many-tensor forms).

The container (``reference/codec/container_read.py``, ``container_write.py``) uses only what this
file exports: ``FORM`` (the header's ``form`` value), ``ARRAY_DTYPES``, ``stored_arrays`` (the
arrays a tensor's header says are stored), ``RansTensor``, ``encode_rans_many``,
``decode_rans_many`` and ``ENCODE_BATCH``.
"""

from reference.codec.rans.codec import (
    BLOCK_SIZE,
    ENCODE_BATCH,
    LANES,
    MANTISSA_BITS,
    PROB_BITS,
    TABLES,
    decode_rans,
    decode_rans_many,
    encode_rans,
    encode_rans_many,
    tensor_block_size,
)
from reference.codec.rans.format import ARRAY_DTYPES, FORM, RansTensor, stored_arrays
from reference.codec.rans.model import DECODE_BITS_PER_NS

__all__ = [
    "ARRAY_DTYPES", "BLOCK_SIZE", "DECODE_BITS_PER_NS", "ENCODE_BATCH", "FORM", "LANES",
    "MANTISSA_BITS", "PROB_BITS", "TABLES", "RansTensor", "decode_rans", "decode_rans_many",
    "encode_rans", "encode_rans_many", "stored_arrays", "tensor_block_size",
]
