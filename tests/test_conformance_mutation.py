"""Mutation checks: a deliberately broken kernel must make the suite fail, with a readable message.

Each test swaps a correct kernel for a broken copy (a wrong bit shift, a wrong mask) and runs the
real conformance CLI in-process; it must exit 1 and print the first differing element in hex.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

import fast  # noqa: F401  (switches the Triton interpreter on when there is no GPU)
from conformance.__main__ import main
from fast import bf16


@triton.jit
def _broken_round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.uint32, bitcast=True)
    lsb = (bits >> 15) & 1  # the mutation: the lowest kept bit is bit 16, not 15 (only ties notice)
    rounded = (bits + 0x7FFF + lsb) >> 16
    tl.store(out_ptr + offs, rounded.to(tl.int16), mask=mask)


def _broken_float32_to_bf16(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.int16, device=x.device) if out is None else out.view(torch.int16)
    _broken_round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out.view(torch.bfloat16)


def test_wrong_shift_in_rounding_fails_the_suite(monkeypatch, capsys):
    monkeypatch.setattr(bf16, "float32_to_bf16", _broken_float32_to_bf16)
    assert main(["--device", "cpu", "-k", "bf16.round_rne"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: bf16.round_rne.special (bit-exact)" in out
    assert "first difference at index" in out and "fast 0x" in out and "vs reference 0x" in out


def _mutant(module, old: str, new: str, tmp_path, monkeypatch):
    """Import a copy of ``module`` with one textual change to its source (a mutation of its kernel)."""
    import importlib.util
    import inspect

    source = inspect.getsource(module)
    assert source.count(old) == 1, f"the mutation target {old!r} must occur once in {module.__name__}"
    path = tmp_path / f"mutant_{module.__name__.replace('.', '_')}.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mutant = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, mutant)  # dataclasses look their module up while defined
    spec.loader.exec_module(mutant)
    return mutant


def test_wrong_exponent_shift_in_palette_decode_fails(monkeypatch, capsys, tmp_path):
    from fast.codec import matmul_triton, palette_triton

    mutant = _mutant(palette_triton, "((s & 0x80) << 8) | (e << 7) | (s & 0x7F), vptr",
                     "((s & 0x80) << 8) | (e << 6) | (s & 0x7F), vptr", tmp_path, monkeypatch)
    monkeypatch.setattr(palette_triton, "decode_palette", mutant.decode_palette)
    monkeypatch.setattr(matmul_triton, "palette_tile", mutant.palette_tile)  # the fused kernel's tile loader
    code = main(["--device", "cpu", "-k", "codec.palette_decode.random", "-k", "fused_vs_plain.many_exponents"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: codec.palette_decode.random (bit-exact)" in out
    assert "FAIL: matmul.fused_vs_plain.many_exponents.b2 (same-kernel exact)" not in out  # both sides share it
    assert "output vs reference decoder: first difference at index [0, 0]" in out


def test_verbatim_patch_off_by_one_fails_the_fused_matmul(monkeypatch, capsys, tmp_path):
    from fast.codec import matmul_triton, palette_triton

    mutant = _mutant(palette_triton, "(cols[None, :] < start[:, None] + CS)",
                     "(cols[None, :] < start[:, None] + CS - 1)", tmp_path, monkeypatch)
    monkeypatch.setattr(matmul_triton, "palette_tile", mutant.palette_tile)  # only the fused kernel is broken
    code = main(["--device", "cpu", "-k", "matmul.fused_vs_*.verbatim_rows*"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: matmul.fused_vs_plain.verbatim_rows.b3 (same-kernel exact)" in out
    assert "FAIL: matmul.fused_vs_float64.verbatim_rows.b3 (bounded)" in out
    assert "outside the bound at index" in out


def test_wrong_window_in_huffman_decoder_fails(monkeypatch, capsys, tmp_path):
    from fast.codec import decode_triton

    mutant = _mutant(decode_triton, "(pos & 31).to(tl.uint64)", "(pos & 15).to(tl.uint64)", tmp_path, monkeypatch)
    monkeypatch.setattr(decode_triton, "decode_huffman", mutant.decode_huffman)
    code = main(["--device", "cpu", "-k", "codec.huffman_decode.specials"])
    out = capsys.readouterr().out
    assert code == 1
    assert "error: codec.huffman_decode.specials" in out and "CodecError: corrupt Huffman stream" in out


def test_write_past_the_end_is_caught_by_the_nan_guard(monkeypatch, capsys, tmp_path):
    from fast.codec import palette_triton

    mutant = _mutant(palette_triton, "bits.to(tl.int16), mask=mask)",
                     "bits.to(tl.int16), mask=row_ok[:, None] & (cols < c_end + 1)[None, :])", tmp_path, monkeypatch)
    monkeypatch.setattr(palette_triton, "decode_palette", mutant.decode_palette)
    code = main(["--device", "cpu", "-k", "codec.palette_decode.specials"])
    out = capsys.readouterr().out
    assert code == 1
    assert "output guard cells around the output (must stay NaN 0x7fc1): first difference at index" in out


def test_truncating_epilogue_shared_by_both_kernels_fails_the_tight_matmul_cases(monkeypatch, capsys, tmp_path):
    """A bug in what the fused and plain kernels share (here the epilogue truncates instead of rounding
    to nearest even) is invisible to the same-kernel cases; the fused_vs_decoded cases catch it."""
    from fast.codec import matmul_triton

    mutant = _mutant(matmul_triton, "bf16_bits_rne(acc).to(tl.int16), mask=out_mask)",
                     "(acc.to(tl.uint32, bitcast=True) >> 16).to(tl.int16), mask=out_mask)", tmp_path, monkeypatch)
    monkeypatch.setattr(matmul_triton, "matmul", mutant.matmul)
    monkeypatch.setattr(matmul_triton, "fused_matmul", mutant.fused_matmul)
    code = main(["--device", "cpu", "-k", "matmul.fused_vs_*.synthetic_70x200*",
                 "-k", "matmul.fused_vs_*.synthetic_96x320.b1"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: matmul.fused_vs_plain" not in out  # the blind spot: both sides truncate alike
    assert "FAIL: matmul.fused_vs_decoded.synthetic_70x200.b33 (bounded)" in out
    assert "FAIL: matmul.fused_vs_decoded.synthetic_96x320.b1 (bounded)" in out
    assert "outside the bound at index" in out


def test_rounding_kernel_writing_past_the_end_is_caught_by_its_guard(monkeypatch, capsys, tmp_path):
    # one lane too many: it reads the float32 input's poison and writes past the output's end
    mutant = _mutant(bf16, "    mask = offs < n\n", "    mask = offs < n + 1\n", tmp_path, monkeypatch)
    monkeypatch.setattr(bf16, "float32_to_bf16", mutant.float32_to_bf16)
    assert main(["--device", "cpu", "-k", "bf16.round_rne.random"]) == 1
    out = capsys.readouterr().out
    # the cell past the end gets the input's poison, rounded (the float32 NaN 0x7fa5a5a5 -> bf16 0x7fe5)
    assert "output guard cells around the output (must stay NaN 0x7fc1): first difference at index [67]" in out
    assert "fast 0x7fe5" in out


def test_transcode_kernel_writing_past_the_end_is_caught_by_its_guard(monkeypatch, tmp_path):
    """The transcode case hands the kernel a uint8 output amid guard cells (codec.transcode.*): the
    correct kernel leaves them alone, a kernel that writes one cell late changes the first one after."""
    import numpy as np

    import reference.codec as rc
    from conformance.poison import PoisonedOutput, expected_guards
    from fast.codec import decode_triton
    from fast.codec.convert import huffman_from_reference
    from reference.synthetic import synthetic_weights

    mutant = _mutant(decode_triton, "tl.store(out_row + w, tl.where(is_v", "tl.store(out_row + w + 1, tl.where(is_v",
                     tmp_path, monkeypatch)  # every index one cell late: the last lands past the end
    form = huffman_from_reference(rc.encode(synthetic_weights((4, 128), np.random.default_rng(0))), "cpu")
    for module, intact in [(decode_triton, True), (mutant, False)]:
        out = PoisonedOutput((4, 128), "cpu", kind="uint8")
        module.transcode(form, symbols_out=out.view)
        assert np.array_equal(out.guards().numpy(), expected_guards(kind="uint8")) == intact
