"""The codec kernels against the reference codec, bit for bit, on every input family.

For each family of conformance/inputs.py (random, adversarial, real MiniLM):

* ``codec.encode.F``, ``codec.encode_torch.F``, ``codec.encode_c.F``: ``encode()`` (its own choice), the
  torch encoder and the C encoder vs ``reference.codec.encode``: every array and header number.
  What is shared with the reference, and so compared with itself (checked only by the reference's
  own tests, tests/test_codec_huffman.py): the torch encoder's fast path (``encode_words.py``, when
  chunk_size % 4 == 0, cols % chunk_size == 0, P <= 16) has its own code lengths
  (``fast_code_lengths``) but takes the canonical code assignment from the reference's
  ``canonical_codes``; its general path (other geometries: the ``odd_1d``, ``odd_chunks`` and ``full_alphabet``
  families, for example) takes both ``code_lengths`` and ``canonical_codes`` from the reference, so
  there only the histogram, palette, verbatim choice and bit packing are the fast path's own. The C
  encoder computes both itself, except that for few or many symbols it falls back to
  ``fast_code_lengths``.
* ``codec.huffman_decode.F``: the Triton Huffman decoder on the reference's Huffman form, vs the
  reference decoder and vs the original tensor;
* ``codec.transcode.F`` / ``codec.transcode_torch.F``: Huffman -> palette form (Triton / plain torch)
  vs ``reference.codec.to_palette``, every array;
* ``codec.palette_decode.F`` / ``codec.palette_decode_torch.F``: the reference's palette form -> bf16,
  vs ``reference.codec.palette_to_bf16`` and vs the original tensor.
"""

from __future__ import annotations

from typing import Any

from conformance.inputs import FAMILIES, LARGE_ONLY, Family, encoded, minilm_missing
from conformance.poison import GUARD, GUARD_UINT8, PoisonedOutput, embed_form, expected_guards
from conformance.registry import Case, Gen, Level, register


def _inputs(family: Family):
    def make(gen: Gen) -> dict[str, Any]:
        return {"enc": encoded(family, gen.large, gen.seed), "device": gen.device}

    return make


def _requires(family: Family):
    return minilm_missing if family.needs_minilm else None


def _both(decoded: Any, out: Any) -> dict[str, Any]:
    return {"vs reference decoder": decoded, "vs original": decoded, GUARD: out.guards()}


# ---- reference sides ----

def _ref_encode(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.codec.convert import huffman_arrays

    return huffman_arrays(inputs["enc"].ct)


def _ref_decode(inputs: dict[str, Any]) -> dict[str, Any]:
    import reference.codec as rc

    return {"vs reference decoder": rc.decode(inputs["enc"].ct), "vs original": inputs["enc"].bits,
            GUARD: expected_guards()}


def _ref_palette_decode(inputs: dict[str, Any]) -> dict[str, Any]:
    import reference.codec as rc

    return {"vs reference decoder": rc.palette_to_bf16(inputs["enc"].pt), "vs original": inputs["enc"].bits,
            GUARD: expected_guards()}


def _ref_transcode(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.codec.convert import reference_palette_arrays

    return reference_palette_arrays(inputs["enc"].pt)


def _ref_transcode_guarded(inputs: dict[str, Any]) -> dict[str, Any]:
    return {**_ref_transcode(inputs), GUARD_UINT8: expected_guards(kind="uint8")}


# ---- fast sides (looked up at call time, so tests can swap a kernel for a broken one) ----

def _encoder(native: bool | None):
    def fast_encode(inputs: dict[str, Any]) -> dict[str, Any]:
        from fast.bf16 import from_numpy_bits
        from fast.codec import encode as enc
        from fast.codec.convert import huffman_arrays

        e = inputs["enc"]
        x = from_numpy_bits(e.bits, inputs["device"])
        usable = x.device.type == "cpu" and e.bits.size and enc.encode_c.library() is not None
        return huffman_arrays(enc.encode(x, **e.params, native=native if usable or not native else None))

    return fast_encode


_fast_encode = _encoder(None)  # what encode() picks: the C encoder on a CPU where it builds, else torch


def _fast_huffman_decode(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.codec import decode_triton
    from fast.codec.convert import huffman_from_reference

    form = embed_form(huffman_from_reference(inputs["enc"].ct, inputs["device"]))  # inputs amid poison
    out = PoisonedOutput(form.shape, inputs["device"])  # the output amid NaNs
    return _both(decode_triton.decode_huffman(form, out=out.view), out)


def _fast_transcode(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.codec import decode_triton
    from fast.codec.convert import huffman_from_reference, palette_arrays

    form = embed_form(huffman_from_reference(inputs["enc"].ct, inputs["device"]))
    out = PoisonedOutput(tuple(form.shape), form.device, kind="uint8")  # the kernel's palette indices
    return {**palette_arrays(decode_triton.transcode(form, symbols_out=out.view)), GUARD_UINT8: out.guards()}


def _fast_transcode_torch(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.codec import decode_torch
    from fast.codec.convert import huffman_from_reference, palette_arrays

    return palette_arrays(decode_torch.transcode_torch(huffman_from_reference(inputs["enc"].ct, inputs["device"])))


def _fast_palette_decode(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.codec import palette_triton
    from fast.codec.convert import palette_from_reference

    form = embed_form(palette_from_reference(inputs["enc"].pt, inputs["device"]))
    out = PoisonedOutput(form.shape, inputs["device"])
    return _both(palette_triton.decode_palette(form, out=out.view), out)


def _fast_palette_decode_torch(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.codec import decode_torch
    from fast.codec.convert import palette_from_reference

    decoded = decode_torch.decode_palette_torch(palette_from_reference(inputs["enc"].pt, inputs["device"]))
    return {"vs reference decoder": decoded, "vs original": decoded}


def _ref_palette_decode_plain(inputs: dict[str, Any]) -> dict[str, Any]:
    out = _ref_palette_decode(inputs)
    del out[GUARD]
    return out


KERNELS = [  # (name, reference, fast, needs a palette form, what it checks)
    ("encode", _ref_encode, _fast_encode, False, "encode() (C on a CPU that builds it, else torch) vs "
     "reference.codec.encode, every array"),
    ("encode_torch", _ref_encode, _encoder(False), False, "the torch encoder vs reference.codec.encode, every array "
     "(canonical codes, and on its general path also code lengths, come from the reference: not checked here)"),
    ("encode_c", _ref_encode, _encoder(True), False, "the C encoder (fast/codec/native) vs reference.codec.encode, "
     "every array (on a GPU, or with no C compiler: encode()'s choice)"),
    ("huffman_decode", _ref_decode, _fast_huffman_decode, False,
     "Triton Huffman -> bf16 (inputs and output amid poison)"),
    ("transcode", _ref_transcode_guarded, _fast_transcode, True,
     "Triton Huffman -> palette form, every array (inputs amid poison, the kernel's output amid guard cells)"),
    ("transcode_torch", _ref_transcode, _fast_transcode_torch, True, "torch Huffman -> palette form"),
    ("palette_decode", _ref_palette_decode, _fast_palette_decode, True,
     "Triton palette form -> bf16 (inputs and output amid poison)"),
    ("palette_decode_torch", _ref_palette_decode_plain, _fast_palette_decode_torch, True,
     "torch palette form -> bf16"),
]


def register_family(family: Family, large_only: bool = False) -> None:
    """Register one case per kernel for this family (palette-form kernels only if P <= 16)."""
    for kernel, ref, fast_fn, needs_palette, what in KERNELS:
        if needs_palette and not family.palette_form:
            continue
        register(Case(f"codec.{kernel}.{family.name}", Level.BIT_EXACT, _inputs(family), ref, fast_fn,
                      about=f"{what}; {family.about}", requires=_requires(family), large_only=large_only))


for _family in FAMILIES:
    register_family(_family)
for _family in LARGE_ONLY:
    register_family(_family, large_only=True)
