"""The fast CPU decoders against the plain reference decoder, bit for bit, on every input family.

For each family of conformance/inputs.py (random, adversarial, real MiniLM), the reference side is
``reference.codec.decode`` (the plain decoder: FORMAT.md 3.5 line by line) and the original tensor:

* ``codec.cpu_decode_c.F``: ``fast.codec.decode_c.decode_cpu`` (the C decoder of
  fast/codec/native/decode.c), in two threads with ranges as small as the tensor allows;
* ``codec.cpu_decode_numpy.F``: ``reference.codec.decode_many`` (the lockstep NumPy decoder, the
  fallback when there is no C compiler).

* ``codec.cpu_decode_rans_c.F``: ``fast.codec.decode_rans_c.decode_rans_cpu`` (the C decoder of the
  rANS mode, fast/codec/native/rans_decode.c) in two threads, on the family's tensor encoded with
  ``encode_rans`` (blocks of 4096 weights, so that even small tensors have several), against the
  reference rANS decoder (``reference.codec.decode_rans``, FORMAT.md 9.4) and the original tensor;
  ``codec.cpu_decode_rans2_c.F`` the same with the second stage forced (m = 2, k = 5);
  ``codec.cpu_decode_rans_column_c.F`` with the first-stage tables chosen by column (FORMAT.md 9.2: D = 1,
  P = the last dimension) and ``codec.cpu_decode_rans_row_c.F`` by row with two stages (the tensor's own
  choice where its shape has no columns or rows).

Both modes of the format's Huffman form (palettes of 16 and the full 256-entry alphabet) are among
the families, and the rANS form is the other mode. Without a C compiler the C cases are skipped.
"""

from __future__ import annotations

import functools
from typing import Any

from conformance import isa
from conformance.inputs import FAMILIES, LARGE_ONLY, Family, encoded, minilm_missing
from conformance.registry import Case, Gen, Level, register


def _inputs(family: Family):
    def make(gen: Gen) -> dict[str, Any]:
        return {"enc": encoded(family, gen.large, gen.seed), "key": (family, gen.large, gen.seed)}

    return make


@functools.lru_cache(maxsize=2)
def _plain_decode(key: tuple[Family, bool, int]) -> Any:
    """The plain decoder's output (about a microsecond per weight), once for the family's two cases."""
    import reference.codec as rc

    return rc.decode(encoded(*key).ct)


def _requires_c(family: Family, module: str = "decode_c"):
    """The case needs the C decoder of fast.codec.<module> built (and MiniLM, for MiniLM families)."""

    def requires() -> str | None:
        import importlib

        if importlib.import_module(f"fast.codec.{module}").library() is None:
            return f"no C compiler: the C decoder of fast.codec.{module} is not built"
        return minilm_missing() if family.needs_minilm else None

    return requires


def _reference(inputs: dict[str, Any]) -> dict[str, Any]:
    return {"vs plain reference decoder": _plain_decode(inputs["key"]), "vs original": inputs["enc"].bits}


def _both(decoded: Any) -> dict[str, Any]:
    return {"vs plain reference decoder": decoded, "vs original": decoded}


def _fast_c(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.codec import decode_c  # looked up at call time: tests swap in a broken build

    saved = decode_c.MIN_WEIGHTS_PER_THREAD, decode_c.BLOCK_WEIGHTS
    # even small tensors are cut into many blocks of groups, which the two threads take in turn
    decode_c.MIN_WEIGHTS_PER_THREAD, decode_c.BLOCK_WEIGHTS = 1, 4096
    try:
        return _both(decode_c.decode_cpu(inputs["enc"].ct, threads=2, native=True))
    finally:
        decode_c.MIN_WEIGHTS_PER_THREAD, decode_c.BLOCK_WEIGHTS = saved


def _fast_numpy(inputs: dict[str, Any]) -> dict[str, Any]:
    import reference.codec as rc

    return _both(rc.decode_many([inputs["enc"].ct])[0])


RANS_BLOCK = 4096  # weights per rANS block in these cases: several blocks, so both threads have work


TWO_STAGES = {"mantissa_bits": 2, "low_bits": 5}  # the second stage forced, whatever the encoder would choose
# the variants: the encoder's choice, two stages forced, tables by column, tables by row with two stages
VARIANTS = {"": {}, "2": TWO_STAGES, "_column": {"context": "column"}, "_row": {**TWO_STAGES, "context": "row"}}


@functools.lru_cache(maxsize=8)
def _rans_encoded(key: tuple[Family, bool, int], variant: str = "") -> Any:
    import reference.codec as rc
    from reference.codec.rans.model import context_of

    bits = encoded(*key).bits
    params = dict(VARIANTS[variant])
    if "context" in params and context_of(bits.shape, params["context"]) is None:
        del params["context"]  # a shape without columns or rows: the tensor's own choice
    return rc.encode_rans(bits, block_size=RANS_BLOCK, **params)


def _rans_inputs(family: Family, variant: str = ""):
    def make(gen: Gen) -> dict[str, Any]:
        key = (family, gen.large, gen.seed)
        return {"rans": _rans_encoded(key, variant), "bits": encoded(*key).bits}

    return make


def _rans_reference(inputs: dict[str, Any]) -> dict[str, Any]:
    import reference.codec as rc

    return {"vs reference rANS decoder": rc.decode_rans(inputs["rans"]), "vs original": inputs["bits"]}


def _rans_fast_c(inputs: dict[str, Any]) -> dict[str, Any]:
    from fast.codec import decode_rans_c  # looked up at call time, as for the Huffman decoder

    saved = decode_rans_c.MIN_WEIGHTS_PER_THREAD
    decode_rans_c.MIN_WEIGHTS_PER_THREAD = 1  # even small tensors go to two threads
    try:
        decoded = decode_rans_c.decode_rans_cpu(inputs["rans"], threads=2, native=True)
    finally:
        decode_rans_c.MIN_WEIGHTS_PER_THREAD = saved
    return {"vs reference rANS decoder": decoded, "vs original": decoded}


def register_family(family: Family, large_only: bool = False) -> None:
    for name in isa.isas():  # the C decoders under every instruction set of this architecture
        register(Case(f"codec.cpu_decode_c.{family.name}.{name}", Level.BIT_EXACT, _inputs(family), _reference,
                      isa.under(name, _fast_c), about=f"C decoder (fast/codec/native/decode.c), 2 threads, "
                      f"UNFIRE_CPU_ISA={name}, vs the plain decoder; {family.about}",
                      requires=isa.requires(name, _requires_c(family)), large_only=large_only))
        register(Case(f"codec.cpu_decode_rans_c.{family.name}.{name}", Level.BIT_EXACT, _rans_inputs(family),
                      _rans_reference, isa.under(name, _rans_fast_c), about=f"C rANS decoder "
                      f"(fast/codec/native/rans_decode.c), 2 threads, UNFIRE_CPU_ISA={name}, vs the reference rANS "
                      f"decoder; {family.about}", requires=isa.requires(name, _requires_c(family, "decode_rans_c")),
                      large_only=large_only))
        register(Case(f"codec.cpu_decode_rans2_c.{family.name}.{name}", Level.BIT_EXACT, _rans_inputs(family, "2"),
                      _rans_reference, isa.under(name, _rans_fast_c), about=f"C rANS decoder, two stages (m = 2, "
                      f"k = 5: FORMAT.md 9.4), 2 threads, UNFIRE_CPU_ISA={name}, vs the reference rANS decoder; "
                      f"{family.about}", requires=isa.requires(name, _requires_c(family, "decode_rans_c")),
                      large_only=large_only))
        for variant, what in (("_column", "tables by column"), ("_row", "tables by row, two stages")):
            register(Case(f"codec.cpu_decode_rans{variant}_c.{family.name}.{name}", Level.BIT_EXACT,
                          _rans_inputs(family, variant), _rans_reference, isa.under(name, _rans_fast_c),
                          about=f"C rANS decoder, {what} (FORMAT.md 9.2), 2 threads, UNFIRE_CPU_ISA={name}, vs the "
                          f"reference rANS decoder; {family.about}",
                          requires=isa.requires(name, _requires_c(family, "decode_rans_c")), large_only=large_only))
    register(Case(f"codec.cpu_decode_numpy.{family.name}", Level.BIT_EXACT, _inputs(family), _reference, _fast_numpy,
                  about=f"lockstep NumPy decoder vs the plain decoder; {family.about}",
                  requires=minilm_missing if family.needs_minilm else None, large_only=large_only))


for _family in FAMILIES:
    register_family(_family)
for _family in LARGE_ONLY:
    register_family(_family, large_only=True)
