"""Command line: ``python -m fast.codec compress IN OUT [--mode rans] | decompress IN OUT | inspect FILE``.

The same command, arguments and files as ``python -m reference.codec`` (byte for byte: a test
compares them), with the C encoder and decoder of ``fast/codec/native/`` doing the Huffman-form
work: ``fast.codec.encode.encode`` to compress, ``decode_c.decode_cpu`` (every check of
FORMAT.md 3.6 kept) to decompress and inspect, in ``cli_threads()`` threads; the rANS mode
is encoded by the reference coder and decoded by ``decode_rans_c.decode_rans_cpu`` (C, every check of
FORMAT.md 9.6 kept). The argument parsing, the safe writes (atomic
output, refusing an output that is an input) and the signal handling are the reference CLI's own:
``reference.codec.__main__.main`` is called with these two functions.

Without a C compiler both fall back (torch encoder, NumPy lockstep decoder) to the same bytes.

``decompress`` and ``inspect`` import neither torch nor Triton (``fast.codec`` loads its names on first use):
of the 2.7 s the command took on SmolLM2 before (issue 45), ~2 s were those imports. The decompressed file is
written by ``reference.codec.container_write.decompress_checkpoint``: header first, then each tensor straight
from its decoded buffer.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from reference.codec.__main__ import main as reference_main
from reference.codec.codec import CHUNK_SIZE, CHUNKS_PER_GROUP, MAX_CODE_LENGTH, PALETTE_SIZE, as_bf16, check_parameters
from reference.codec.format import CompressedTensor, crc32
from reference.codec.layout import Layout
from reference.codec.rans import RansTensor


def encode_to_reference(bits: np.ndarray, *, name: str = "", palette_size: int = PALETTE_SIZE,
                        chunk_size: int = CHUNK_SIZE, chunks_per_group: int = CHUNKS_PER_GROUP,
                        max_code_length: int = MAX_CODE_LENGTH) -> CompressedTensor:
    """``reference.codec.encode``'s result (the same bytes), computed by the fast encoder."""
    from fast.bf16 import from_numpy_bits
    from fast.codec.convert import huffman_to_reference
    from fast.codec.encode import encode

    bits = as_bf16(bits, name)
    check_parameters(Layout(bits.shape, chunk_size, chunks_per_group), palette_size, max_code_length)
    form = encode(from_numpy_bits(bits), chunk_size=chunk_size, chunks_per_group=chunks_per_group,
                  palette_size=palette_size, max_code_length=max_code_length)
    return huffman_to_reference(form, data_crc=crc32(bits), name=name)


def cli_threads() -> int:
    """The decoders' thread count: ``torch.get_num_threads()`` where torch is loaded already, else what it
    would say without loading it (~1 s): ``OMP_NUM_THREADS`` when set, else the cores this process may use."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return int(torch.get_num_threads())
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        pass
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def decode_batch(tensors: list[CompressedTensor]) -> list[np.ndarray]:
    """Decode Huffman-form tensors (headers checked, arrays not: the C decoder checks them)."""
    from fast.codec.decode_c import decode_cpu

    threads = cli_threads()
    return [decode_cpu(ct, threads=threads) for ct in tensors]


def decode_rans_batch(tensors: list[RansTensor]) -> list[np.ndarray]:
    """Decode rANS-form tensors (headers checked, arrays not: the C decoder checks them)."""
    from fast.codec.decode_rans_c import decode_rans_many

    return decode_rans_many(tensors, threads=cli_threads())


def main(argv: list[str] | None = None, **kwargs: Any) -> int:
    return reference_main(argv, prog="python -m fast.codec", encoder=encode_to_reference, decoder=decode_batch,
                          rans_decoder=decode_rans_batch, description=__doc__, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
