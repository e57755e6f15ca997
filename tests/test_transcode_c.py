"""The C decoder's transcode (``fast/codec/transcode_c.py``) gives the same palette form, byte for
byte, as the torch transcode (``decode_torch.transcode_torch``), and refuses damaged tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from fast.codec.convert import huffman_from_reference, palette_arrays
from fast.codec.decode_c import library
from fast.codec.decode_torch import decode_palette_torch, transcode_torch
from fast.codec.transcode_c import transcode_cpu
from fast.errors import KernelInputError
from reference.codec import encode
from reference.codec.errors import CodecError
from tests.codec_strategies import bf16_tensors, codec_params

needs_c = pytest.mark.skipif(library() is None, reason="no C compiler")


def assert_same_form(ct) -> None:
    got = palette_arrays(transcode_cpu(ct))
    want = palette_arrays(transcode_torch(huffman_from_reference(ct)))
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k


@needs_c
@settings(max_examples=120, deadline=None)
@given(bits=bf16_tensors(), params=codec_params())
def test_same_bytes_as_the_torch_transcode(bits: np.ndarray, params: dict) -> None:
    params["palette_size"] = min(params["palette_size"], 16)
    ct = encode(bits, **params)
    assert_same_form(ct)
    decoded = decode_palette_torch(transcode_cpu(ct)).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(decoded.reshape(bits.shape), bits)


@needs_c
def test_verbatim_heavy_and_odd_shapes() -> None:
    rng = np.random.default_rng(7)
    for shape in [(3, 1000), (129, 67), (1, 1), (64, 64)]:
        bits = rng.integers(0, 65536, shape).astype(np.uint16)  # most chunks verbatim
        bits[0, : shape[1] // 2] = 0x3F80
        assert_same_form(encode(bits, palette_size=4, chunk_size=16))


@needs_c
def test_damaged_tensor_and_long_palette_are_refused() -> None:
    bits = np.random.default_rng(1).integers(0x3A00, 0x3F00, (32, 256)).astype(np.uint16)
    ct = encode(bits)
    stream = ct.stream.copy()
    stream[len(stream) // 2] ^= 1 << 7
    ct.stream = stream
    with pytest.raises(CodecError):
        transcode_cpu(ct)
    with pytest.raises(KernelInputError, match="at most 16"):
        transcode_cpu(encode(np.arange(8192, dtype=np.uint16).reshape(32, 256) * 8, palette_size=32))
