"""fast/codec: the torch encoder and transcode against the reference (property tests), the Triton
kernels on random geometries, input validation, corrupt streams, and UnweightLinear."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.codec as rc
from fast.bf16 import from_numpy_bits, to_numpy_bits
from fast.codec import encode_c
from fast.codec.convert import (
    huffman_arrays,
    huffman_from_reference,
    palette_arrays,
    palette_from_reference,
    reference_palette_arrays,
)
from fast.codec.decode_torch import decode_palette_torch, transcode_torch
from fast.codec.decode_triton import decode_huffman, transcode
from fast.codec.encode import encode
from fast.codec.linear import UnweightLinear
from fast.codec.matmul_triton import MatmulConfig, fused_matmul, matmul
from fast.codec.palette_triton import decode_palette
from fast.errors import KernelInputError
from reference.bf16 import float32_to_bf16
from tests.codec_strategies import bf16_tensors, codec_params


def same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and np.array_equal(a[k], b[k]) for k in a)


@given(bits=bf16_tensors(), params=codec_params(), block=st.sampled_from([1, 5000, 1 << 18]))
def test_torch_encoder_equals_reference(bits: np.ndarray, params: dict[str, int], block: int) -> None:
    import fast.codec.encode as enc

    ct = rc.encode(bits, **params)
    saved, enc.BLOCK_WEIGHTS = enc.BLOCK_WEIGHTS, block  # 1: one group per block, many blocks
    try:
        assert same_arrays(huffman_arrays(encode(from_numpy_bits(bits), **params, native=False)), huffman_arrays(ct))
    finally:
        enc.BLOCK_WEIGHTS = saved


@pytest.mark.skipif(encode_c.library() is None, reason="no C compiler: the C encoder is not built")
@given(bits=bf16_tensors(), params=codec_params())
def test_c_encoder_equals_reference(bits: np.ndarray, params: dict[str, int]) -> None:
    ct = rc.encode(bits, **params)
    if bits.size == 0:  # the C encoder takes no empty tensor; encode() gives those to torch
        return
    assert same_arrays(huffman_arrays(encode(from_numpy_bits(bits), **params, native=True)), huffman_arrays(ct))


@given(bits=bf16_tensors(), params=codec_params())
def test_torch_transcode_and_palette_decode_equal_reference(bits: np.ndarray, params: dict[str, int]) -> None:
    params["palette_size"] = min(params["palette_size"], 16)
    params["max_code_length"] = max(params["max_code_length"], 4)
    ct = rc.encode(bits, **params)
    pt = rc.to_palette(ct)
    assert same_arrays(palette_arrays(transcode_torch(huffman_from_reference(ct))), reference_palette_arrays(pt))
    assert np.array_equal(to_numpy_bits(decode_palette_torch(palette_from_reference(pt))), bits)
    _, pf = encode(from_numpy_bits(bits), **params, with_palette_form=True)  # the encoder's own palette form
    assert same_arrays(palette_arrays(pf), reference_palette_arrays(pt))


small_geometry = st.fixed_dictionaries({"chunk_size": st.sampled_from([1, 3, 8, 16]),
                                        "chunks_per_group": st.sampled_from([1, 2, 5]),
                                        "palette_size": st.sampled_from([1, 4, 16])})


@settings(max_examples=12)
@given(bits=bf16_tensors(max_elements=800), params=small_geometry)
def test_triton_kernels_equal_reference_on_random_geometries(bits: np.ndarray, params: dict[str, int]) -> None:
    ct = rc.encode(bits, **params)
    pt = rc.to_palette(ct)
    hf = huffman_from_reference(ct)
    assert np.array_equal(to_numpy_bits(decode_huffman(hf)), bits)
    assert same_arrays(palette_arrays(transcode(hf)), reference_palette_arrays(pt))
    assert np.array_equal(to_numpy_bits(decode_palette(palette_from_reference(pt), block_cols=16)), bits)


def _encoded(shape=(40, 200), seed=0, chunks_per_group=2):
    rng = np.random.default_rng(seed)
    bits = float32_to_bf16((rng.standard_normal(shape) * np.exp2(rng.integers(-20, 2, shape))).astype(np.float32))
    ct = rc.encode(bits, chunks_per_group=chunks_per_group)  # small groups: few interpreter steps
    return bits, ct, rc.to_palette(ct)


def test_corrupt_stream_raises_codec_error_in_every_decoder() -> None:
    """Kernels check what they can cheaply (every group ends at its offset, no invalid code); the CRCs
    are checked by the reference parser when a tensor is loaded from a file, before any kernel runs."""
    _, ct, _ = _encoded()
    hf = huffman_from_reference(ct)
    hf.stream[0] ^= -1  # the first 32 bits inverted: the first group no longer ends at its offset
    for decode in (decode_huffman, transcode, transcode_torch):
        with pytest.raises(rc.CodecError, match="corrupt"):
            decode(hf)


def test_offsets_past_the_stream_are_rejected_before_any_kernel_runs() -> None:
    _, ct, _ = _encoded()
    hf = huffman_from_reference(ct)
    hf.offsets[1] = hf.stream_bits + 1000
    with pytest.raises(rc.CodecError, match="offsets"):
        decode_huffman(hf)


def test_wrapper_inputs_are_validated() -> None:
    _, ct, pt = _encoded((64, 128))
    form = palette_from_reference(pt)
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.raises(KernelInputError, match="dtype torch.bfloat16, got torch.float32"):
        fused_matmul(x.float(), form)
    with pytest.raises(KernelInputError, match="last dimension 128"):
        fused_matmul(torch.zeros(2, 100, dtype=torch.bfloat16), form)
    with pytest.raises(KernelInputError, match="contiguous"):
        fused_matmul(torch.zeros(128, 2, dtype=torch.bfloat16).t(), form)
    with pytest.raises(KernelInputError, match="bias"):
        fused_matmul(x, form, bias=torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(KernelInputError, match="is on meta"):
        matmul(x.to("meta"), torch.zeros(64, 128, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(KernelInputError, match="w: expected dtype"):
        matmul(x, torch.zeros(64, 128, dtype=torch.int16))
    bad = palette_from_reference(pt)
    bad.sm = bad.sm[:, :-1]
    with pytest.raises(KernelInputError, match="palette form: sm must be"):
        decode_palette(bad)
    hf = huffman_from_reference(ct)
    hf.stream = hf.stream.to(torch.int64)
    with pytest.raises(KernelInputError, match="Huffman form: stream must be"):
        decode_huffman(hf)
    with pytest.raises(KernelInputError, match="expected a torch.bfloat16"):
        encode(torch.zeros(4))


def test_cpu_tensor_without_interpreter_gets_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from fast.bf16 import float32_to_bf16 as round_kernel

    with pytest.raises(KernelInputError, match="need a CUDA tensor, or TRITON_INTERPRET=1"):
        round_kernel(torch.zeros(4))


def test_unweight_linear_matches_nn_linear_and_picks_its_path(monkeypatch) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(200, 70).to(torch.bfloat16)
    layer = UnweightLinear.from_linear(lin, fused_max_rows=4)
    assert torch.equal(layer.decoded_weight().view(torch.int16), lin.weight.view(torch.int16))
    calls = []
    import fast.codec.matmul_triton as mm

    monkeypatch.setattr(mm, "fused_matmul", lambda *a, **k: calls.append("fused") or mm._launch(
        a[0], None, a[1], 70, 200, a[2], a[3]))
    for rows in (1, 4, 9):
        x = torch.randn(rows, 200).to(torch.bfloat16)
        y = layer(x)
        ref = x.double() @ lin.weight.double().T + lin.bias.double()
        assert y.shape == (rows, 70) and torch.allclose(y.double(), ref, rtol=2**-7, atol=1e-2)
    assert calls == ["fused", "fused"]  # 1 and 4 rows fused; 9 rows decode + F.linear
    with pytest.raises(KernelInputError, match="bf16 input"):
        layer(torch.zeros(2, 200))


def test_unweight_linear_from_container(tmp_path: Path) -> None:
    from reference.model.safetensors_io import write_safetensors

    rng = np.random.default_rng(1)
    w = float32_to_bf16((rng.standard_normal((96, 192)) * 0.02).astype(np.float32))
    b = rng.standard_normal(96).astype(np.float32)
    write_safetensors(tmp_path / "m.safetensors", {"up.weight": w, "up.bias": b}, dtypes={"up.weight": "BF16"})
    rc.compress_checkpoint(tmp_path / "m.safetensors", tmp_path / "c.safetensors")
    layer = UnweightLinear.from_container(tmp_path / "c.safetensors", "up.weight", "up.bias")
    assert np.array_equal(to_numpy_bits(layer.decoded_weight()), w)
    x = torch.randn(3, 192).to(torch.bfloat16)
    y = layer(x)
    ref = x.double() @ torch.from_numpy((w.astype(np.uint32) << 16).view(np.float32)).double().T
    assert torch.allclose(y.double(), ref + torch.from_numpy(float32_to_bf16(b).astype(np.uint32) << 16).view(
        torch.float32).double(), rtol=2**-7, atol=1e-2)


def test_split_k_is_deterministic_and_matches_no_split() -> None:
    _, _, pt = _encoded((48, 300))
    form = palette_from_reference(pt)
    x = torch.randn(5, 300).to(torch.bfloat16)
    a = fused_matmul(x, form, config=MatmulConfig(16, 16, 64, split_k=3))
    b = fused_matmul(x, form, config=MatmulConfig(16, 16, 64, split_k=3))
    c = fused_matmul(x, form, config=MatmulConfig(16, 16, 64, split_k=1))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert (a.double() - c.double()).abs().max() <= 2**-6 * c.double().abs().max() + 1e-6
    assert math.isfinite(float(a.double().abs().max()))


def test_stored_minilm_exponent_histogram_matches_the_weights() -> None:
    from conformance.inputs import minilm_exponent_counts_from_weights, minilm_missing
    from reference.synthetic import minilm_exponent_counts

    if minilm_missing():
        pytest.skip(minilm_missing())
    assert np.array_equal(minilm_exponent_counts(), minilm_exponent_counts_from_weights())
