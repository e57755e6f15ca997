"""The fast CPU decoder (fast/codec/native/decode.c via decode_cpu): bit-exact to the plain reference
decoder, every check of FORMAT.md 3.6 kept (damaged input: CodecError or the exact original), its
CRC-32 equal to zlib's, and the NumPy fallback when there is no compiler."""

from __future__ import annotations

import contextlib
import copy
import zlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fast.codec import decode_c
from fast.codec.decode_c import decode_cpu
from reference.codec import CompressedTensor, decode, encode
from reference.codec.errors import CodecError
from reference.codec.format import crc32
from tests.codec_strategies import JUNK, bf16_tensors, codec_params, tampered_header

HAS_C = decode_c.library() is not None
needs_c = pytest.mark.skipif(not HAS_C, reason="no C compiler: the C decoder is not built")

rng = np.random.default_rng(11)
TRAINED = (rng.standard_normal((96, 200)) * 0.02).astype(np.float32).view(np.uint32) >> 16
TRAINED = TRAINED.astype(np.uint16)
TRAINED[3, 5] = 0x0001  # a subnormal: an out-of-palette exponent, so there is a verbatim chunk
BASE = encode(TRAINED, chunks_per_group=4)


@contextlib.contextmanager
def many_threads() -> Iterator[None]:
    """Let even tiny tensors be split into blocks of one or a few groups, more blocks than threads (the
    threads' taking of blocks and the CRC join are what is tested)."""
    saved = decode_c.MIN_WEIGHTS_PER_THREAD, decode_c.BLOCK_WEIGHTS
    decode_c.MIN_WEIGHTS_PER_THREAD, decode_c.BLOCK_WEIGHTS = 1, 300
    try:
        yield
    finally:
        decode_c.MIN_WEIGHTS_PER_THREAD, decode_c.BLOCK_WEIGHTS = saved


@contextlib.contextmanager
def build(use: Callable[[int], int], wide: bool) -> Iterator[None]:
    """Run a C decoder's portable build (wide=False) or its AVX2 + BMI2 one (where the CPU has it)."""
    use(int(wide))
    try:
        yield
    finally:
        use(1)


@needs_c
@settings(max_examples=150, deadline=None)
@given(bits=bf16_tensors(), params=codec_params(), threads=st.sampled_from([1, 2, 3, 7]), wide=st.booleans(),
       wide_assembly=st.booleans())
def test_c_decoder_equals_plain_reference_decoder(bits: np.ndarray, params: dict, threads: int, wide: bool,
                                                  wide_assembly: bool) -> None:
    """Both builds of the decoding loop (portable, and AVX2 + BMI2 where the CPU has it: its rounds in
    assembly), with and without the AVX-512BW assembly of bf16 (where the CPU has it)."""
    ct = encode(bits, **params)
    lib = decode_c.library()
    with build(lib.unw_decode_use, wide), build(lib.unw_assemble_use, wide_assembly), many_threads():
        got = decode_cpu(ct, threads=threads, native=True)
    assert got.dtype == np.uint16 and got.shape == bits.shape
    assert np.array_equal(got, decode(ct)) and np.array_equal(got, bits)


@needs_c
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("wide_assembly", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_c_decoder_many_groups_every_path(wide: bool, wide_assembly: bool, seed: int) -> None:
    """Trained-like tensors of many groups at L = 12 (the four-group rounds, in assembly in the AVX2 + BMI2
    build), odd shapes (short chunks, runs of any length), verbatim chunks: every path gives the original."""
    r = np.random.default_rng(seed)
    rows, cols = int(r.integers(20, 90)), int(r.integers(100, 3000))
    bits = ((r.standard_normal((rows, cols)) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    bits.reshape(-1)[r.integers(0, bits.size, 5)] = 0x0001  # subnormals: verbatim chunks
    ct = encode(bits)
    assert ct.max_code_length == 12
    lib = decode_c.library()
    with build(lib.unw_decode_use, wide), build(lib.unw_assemble_use, wide_assembly):
        assert np.array_equal(decode_cpu(ct, native=True), bits)


@needs_c
@pytest.mark.parametrize("skip", [0, 1, 7, 31])
def test_c_decoder_output_on_or_off_a_line(skip: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_cpu's output starts on a 64-byte line (most runs then start and end on whole lines); a buffer
    that does not (the C decoder takes any) gives the same bits, every run's head and tail CRCed apart."""
    r = np.random.default_rng(skip)
    bits = ((r.standard_normal((37, 1000)) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    bits.reshape(-1)[r.integers(0, bits.size, 9)] = 0x0001  # verbatim chunks: runs of any length
    ct = encode(bits, chunks_per_group=4)
    assert decode_cpu(ct, native=True).__array_interface__["data"][0] % 64 == 0
    aligned = decode_c._line_aligned

    def off_the_line(n: int) -> np.ndarray:
        buf = aligned(n + 32)
        return buf[skip:skip + n]

    monkeypatch.setattr(decode_c, "_line_aligned", off_the_line)
    for threads in (1, 3):
        with many_threads():
            out = decode_cpu(ct, threads=threads, native=True)
        assert out.__array_interface__["data"][0] % 64 == 2 * skip % 64
        assert np.array_equal(out, bits)


def multi_table_by_definition(single: np.ndarray, length: int) -> np.ndarray:
    """decode.c's multi-symbol table, entry by entry: the up to 5 whole codes at the start of each window."""
    mask, out = (1 << length) - 1, np.zeros(1 << length, np.uint64)
    for w in range(1 << length):
        used = count = exps = 0
        while count < 5:
            e = int(single[(w << used) & mask])
            if e >> 8 == 0 or used + (e >> 8) > length:
                break
            exps |= (e & 0xFF) << (8 * count)
            used += e >> 8
            count += 1
        out[w] = used | exps << 8 | count << 56 if count else 1 << 48 | 1 << 56
    return out


@needs_c
@settings(max_examples=40, deadline=None)
@given(bits=bf16_tensors(), params=codec_params())
def test_c_tables_equal_the_reference_table(bits: np.ndarray, params: dict) -> None:
    """unw_tables: the one-symbol table is FORMAT.md 3.3's (reference.codec.huffman.decode_table), the
    multi-symbol table as defined in decode.c (the tables are built from the code in C, not entry by entry)."""
    from reference.codec.huffman import decode_table

    ct = encode(bits, **params)
    single, multi, *_ = decode_c.tables.__wrapped__(tuple(ct.palette), tuple(ct.code_lengths), ct.max_code_length)
    symbols, lengths = decode_table(ct.code_lengths, ct.max_code_length)
    expected = np.asarray(ct.palette or (0,), np.uint16)[symbols] | lengths.astype(np.uint16) << 8
    expected[lengths == 0] = 0  # no code starts there: length 0 (its exponent byte is never used)
    assert np.array_equal(single, expected)
    assert np.array_equal(multi, multi_table_by_definition(single, ct.max_code_length))


def decodes_exactly_or_raises(header: object, arrays: dict[str, np.ndarray], original: np.ndarray,
                              threads: int = 1) -> None:
    try:
        out = decode_cpu(CompressedTensor.from_parts(header, arrays, check_arrays=False), threads=threads,
                         native=True)
    except CodecError:
        return
    assert out.shape == original.shape and np.array_equal(out, original)


@needs_c
@given(st.sampled_from(list(BASE.arrays())), st.integers(0, 2**40), st.integers(0, 7), st.booleans(),
       st.sampled_from([1, 3]))
def test_damaged_arrays_are_caught_by_the_c_decoder(key: str, where: int, bit: int, fix_crc: bool,
                                                    threads: int) -> None:
    """A flipped bit anywhere; with ``fix_crc`` the array's CRC is recomputed so the decoder's own checks
    (offsets, verbatim ids and chunks, codes, group ends, data CRC) must catch it."""
    arrays = {k: np.array(v) for k, v in BASE.arrays().items()}
    raw = arrays[key].view(np.uint8).reshape(-1)
    if raw.size == 0:
        return
    raw[where % raw.size] ^= 1 << bit
    header = copy.deepcopy(BASE.header())
    with many_threads():
        if fix_crc:
            header["crc32"][key] = crc32(arrays[key])
        else:
            with pytest.raises(CodecError, match="CRC|corrupt|must|holds"):
                decode_cpu(CompressedTensor.from_parts(header, arrays, check_arrays=False), threads=threads,
                           native=True)
        decodes_exactly_or_raises(header, arrays, TRAINED, threads)


@needs_c
@given(st.sampled_from([*BASE.header(), "crc32.sm", "crc32.data"]), JUNK)
def test_tampered_header_field_c_decoder(key: str, value: object) -> None:
    decodes_exactly_or_raises(tampered_header(BASE.header(), key, value), BASE.arrays(), TRAINED)


@needs_c
@given(st.sampled_from(["offsets", "vchunks"]), st.integers(0, 100), st.integers(0, 2**32 - 1))
def test_out_of_range_entries_c_decoder(key: str, index: int, value: int) -> None:
    """Offsets and verbatim ids far out of range (CRC fixed): read nothing out of bounds, raise CodecError."""
    header, arrays = copy.deepcopy(BASE.header()), {k: np.array(v) for k, v in BASE.arrays().items()}
    if arrays[key].size == 0:
        return
    arrays[key][index % arrays[key].size] = value
    header["crc32"][key] = crc32(arrays[key])
    decodes_exactly_or_raises(header, arrays, TRAINED)


@needs_c
def test_errors_name_the_problem() -> None:
    arrays = {k: np.array(v) for k, v in BASE.arrays().items()}
    arrays["stream"][0] ^= np.uint32(0xFFFF0000)
    header = copy.deepcopy(BASE.header())
    header["crc32"]["stream"] = crc32(arrays["stream"])
    with pytest.raises(CodecError, match="group 0"):
        decode_cpu(CompressedTensor.from_parts(header, arrays, check_arrays=False), native=True)
    arrays = {k: np.array(v) for k, v in BASE.arrays().items()}
    arrays["sm"][7] ^= 1
    with pytest.raises(CodecError, match="array sm fails its CRC-32"):
        decode_cpu(CompressedTensor.from_parts(BASE.header(), arrays, check_arrays=False), native=True)


@needs_c
@given(st.integers(0, 5000), st.integers(0, 15), st.integers(1, 9), st.integers(0, 2**32 - 1),
       st.sampled_from([0, 1, 2]))
def test_crc32_equals_zlib(n: int, skip: int, threads: int, seed: int, path: int) -> None:
    """Every CRC path the CPU has (0 tables, 1 PCLMULQDQ, 2 VPCLMULQDQ), any length and alignment."""
    data = np.random.default_rng(seed).integers(0, 256, n + skip, dtype=np.uint8)[skip:]
    lib = decode_c.library()
    try:
        lib.unw_crc_use(path)
        assert decode_c.crc32(data, threads) == zlib.crc32(data.tobytes())
    finally:
        lib.unw_crc_use(-1)


def test_numpy_fallback_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    assert np.array_equal(decode_cpu(BASE, native=False), TRAINED)
    monkeypatch.setattr(decode_c, "_state", {})
    monkeypatch.setenv("UNFIRE_NATIVE", "0")
    assert decode_c.library() is None
    assert np.array_equal(decode_cpu(BASE), TRAINED)
    with pytest.raises(CodecError, match="not available"):
        decode_cpu(BASE, native=True)


@needs_c
def test_a_broken_c_decoder_fails_the_conformance_suite_readably(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """Mutation: the exponent shifted by 6 instead of 7 in decode.c's assembly (the portable and the AVX-512BW
    one). The decoder's own data CRC catches it before the comparison would: the case errors, naming the case
    and the failed check."""
    from conformance.__main__ import main
    from fast import build_c

    source = decode_c.SOURCE.read_text()
    old = "(uint16_t)(((q[t] & 0x80) << 8) | (e[t] << 7) | (q[t] & 0x7F))"
    old_512 = "_mm512_slli_epi16(ex, 7)"  # the AVX-512BW assembly's (where the CPU has it; the fused CRC one too)
    assert source.count(old) == 1 and source.count(old_512) == 1
    mutant = tmp_path / "decode.c"
    mutant.write_text(source.replace(old, old.replace("<< 7", "<< 6")).replace(old_512, old_512.replace("7", "6")))
    for header in decode_c.SOURCE.parent.glob("*.h"):
        (tmp_path / header.name).write_bytes(header.read_bytes())
    monkeypatch.setenv("UNFIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(decode_c, "_state", {"lib": build_c.build(mutant, decode_c._SIGNATURES)})
    assert main(["--device", "cpu", "-k", "codec.cpu_decode_c.random"]) == 1
    out = capsys.readouterr().out
    from fast import cpu_isa

    # the case runs once per instruction set of the architecture (conformance/isa.py): each run errors
    ran = [name for name in cpu_isa.chain() if name in cpu_isa.supported()]
    assert all(f"codec.cpu_decode_c.random.{name}" in out for name in ran), out
    assert f"{len(ran)} errors" in out
    assert "decoded data fails its CRC-32 check" in " ".join(out.split())


@needs_c
def test_the_decoder_builds_where_the_compiler_keeps_frame_pointers(tmp_path, monkeypatch) -> None:
    """A compiler that keeps frame pointers by default (Apple's clang; a GCC built so) leaves the rounds'
    assembly, which keeps 15 values in registers, one short: build_c says -fomit-frame-pointer, so the
    decoder builds there too and decodes the same bits (a real build through a compiler that puts
    -fno-omit-frame-pointer before the flags, as such a default does)."""
    import shutil
    import stat

    from fast import build_c

    cc = tmp_path / "cc-frame-pointers"
    cc.write_text(f'#!/bin/sh\nexec {shutil.which("cc")} -fno-omit-frame-pointer "$@"\n')
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("UNFIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(decode_c, "_state", {"lib": build_c.build(decode_c.SOURCE, decode_c._SIGNATURES)})
    bits = np.random.default_rng(3).normal(0, 0.02, (96, 256)).astype(np.float32).view(np.uint32) >> 16
    bits = bits.astype(np.uint16)
    assert np.array_equal(decode_cpu(encode(bits), native=True), bits)
