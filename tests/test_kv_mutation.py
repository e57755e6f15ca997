"""Mutation checks for the KV kernels: a broken copy of a kernel must make the conformance suite fail.

Each test imports a copy of a ``fast.kv`` module with one textual change, swaps it in, and runs the
real conformance CLI in-process on the KV cases.
"""

from __future__ import annotations

import pytest
from test_conformance_mutation import _mutant

import fast  # noqa: F401  (switches the Triton interpreter on when there is no GPU)
from conformance.__main__ import main


def test_skipped_rescale_fails_the_fp8_write_case(monkeypatch, capsys, tmp_path):
    """Forgetting rule 3 (re-encode a block whose scale grew) changes cache bytes."""
    from fast.kv import write_triton

    mutant = _mutant(write_triton, "if fresh | (new > old):", "if fresh:", tmp_path, monkeypatch)
    monkeypatch.setattr(write_triton, "write", mutant.write)
    code = main(["--device", "cpu", "-k", "kv.fp8_write.triton"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: kv.fp8_write.triton (bit-exact)" in out and "first difference at index" in out


def test_read_one_slot_past_the_end_is_caught_by_the_nan_poison(monkeypatch, capsys, tmp_path):
    """A decode kernel that attends to one position too many reads a poisoned slot."""
    from fast.kv import attention_triton

    mutant = _mutant(attention_triton, "valid = (s < BLOCK_SIZE) & (pos < seq_len)",
                     "valid = (s < BLOCK_SIZE) & (pos <= seq_len)", tmp_path, monkeypatch)
    monkeypatch.setattr(attention_triton, "decode_attention", mutant.decode_attention)
    code = main(["--device", "cpu", "-k", "kv.decode_attention.fp8.triton", "-k", "kv.decode_attention.float32.triton"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: kv.decode_attention.fp8.triton (bounded)" in out
    assert "FAIL: kv.decode_attention.float32.triton (bounded)" in out
    assert "outside the bound at index" in out and "nan" in out


def test_causal_mask_off_by_one_fails_the_prefill_case(monkeypatch, capsys, tmp_path):
    """A prefill tile that lets a token see the next one is far outside the bound (no NaN involved)."""
    from fast.kv import attention_triton

    mutant = _mutant(attention_triton, "(key_pos[None, :] <= query_pos[:, None])",
                     "(key_pos[None, :] <= query_pos[:, None] + 1)", tmp_path, monkeypatch)
    monkeypatch.setattr(attention_triton, "prefill_attention", mutant.prefill_attention)
    code = main(["--device", "cpu", "-k", "kv.prefill_attention.bfloat16.triton"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: kv.prefill_attention.bfloat16.triton (bounded)" in out and "outside the bound at index" in out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the cast's own overflows, in the interpreter
def test_a_float_to_fp8_cast_slipping_in_fails_the_codes_case(monkeypatch, capsys, tmp_path):
    """Encoding by ``x.to(tl.float8e4nv)`` instead of integer operations is caught (its rounding differs)."""
    from fast.kv import fp8_triton, write_triton

    mutant = _mutant(fp8_triton, "    return code | (sign << 7)\n",
                     "    return (x * pow2(-e)).to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)\n",
                     tmp_path, monkeypatch)
    monkeypatch.setattr(write_triton, "encode_e4m3", mutant.encode_e4m3)
    code = main(["--device", "cpu", "-k", "kv.fp8_encode.bit_classes"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: kv.fp8_encode.bit_classes (bit-exact)" in out and "output triton: first difference" in out
