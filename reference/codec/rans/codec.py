"""Encode a bf16 tensor in the rANS mode and decode it back, bit for bit (FORMAT.md section 9).

    t = encode_rans(bits)            # bits: uint16 array of bf16 patterns, any shape
    assert (decode_rans(t) == bits).all()

``encode_rans_many`` / ``decode_rans_many`` run the lanes of many tensors in one lockstep pass
(much faster for many small tensors, as in a checkpoint).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby
from typing import Any

import numpy as np

from reference.codec.codec import as_bf16
from reference.codec.errors import CodecError
from reference.codec.format import UINT32_LIMIT, crc32
from reference.codec.rans.coder import MAX_PROB_BITS, decode_lanes, encode_lanes, slot_tables
from reference.codec.rans.format import (
    MAX_BLOCK_SIZE,
    MAX_LANE_STEPS,
    MAX_LANES,
    MAX_TABLES,
    MIN_PROB_BITS,
    RansTensor,
)
from reference.codec.rans.model import (
    CONTEXTS,
    DECODE_BITS_PER_NS,
    TABLE_ENTRY_BITS,
    choose_alphabet,
    choose_classes,
    choose_coding,
    choose_context,
    class_tables,
    coded_bits,
    decode_charge,
    join_low,
    join_weights,
    pack_fields,
    split_low,
    split_weights,
    unpack_fields,
)

BLOCK_SIZE, LANES, PROB_BITS, MANTISSA_BITS, TABLES = 65536, 32, 12, 2, 16
ESCAPE_VALUE = 0xFFFF  # what the decoding tables give for the escape symbol (values are < 2^15)
ENCODE_BATCH = 1 << 24  # weights whose blocks are encoded in one lockstep pass
CONFIRM = 2  # candidates (m, k) modelled exactly per tensor, the best by estimate
# the escape symbol's unit in choose_classes (values' units are their exponents)
ESCAPE_UNIT = 1 << 8


def encode_rans(bits: np.ndarray, *, name: str = "", **params: Any) -> RansTensor:
    """Compress a bf16 tensor (uint16 bit patterns, any shape) into the rANS form.

    Parameters (keywords): ``block_size`` (None: per tensor, ``tensor_block_size``: blocks of at
    most 65536 weights, their count a multiple of four), ``lanes`` (32), ``prob_bits`` (12),
    ``mantissa_bits`` and ``low_bits`` (None: chosen per tensor, ``choose_coding``; a given
    ``mantissa_bits`` alone means ``low_bits=0``), ``max_tables`` (16); for the ablation:
    ``escapes``
    (True) and ``own_tables`` (False: blocks share clustered tables; True: one table per block);
    ``context`` (None: chosen per tensor by measured size; ``"block"``, ``"column"`` or ``"row"``:
    what chooses each weight's first-stage table, FORMAT.md 9.2); ``decode_cost`` (bits a
    nanosecond of decoding is worth in the choice of the form, FORMAT.md 9.5: 0.25; 0 keeps the
    smallest form whatever its decoding speed).
    """
    return encode_rans_many([bits], names=[name], **params)[0]


def encode_rans_many(
    tensors: Sequence[np.ndarray], *, names: Sequence[str] | None = None,
    block_size: int | None = None,
    lanes: int = LANES, prob_bits: int = PROB_BITS, mantissa_bits: int | None = None,
    low_bits: int | None = None, max_tables: int = TABLES, escapes: bool = True,
    own_tables: bool = False, context: str | None = None,
    decode_cost: float = DECODE_BITS_PER_NS,
) -> list[RansTensor]:
    """Compress several tensors with the same parameters; the blocks of about ENCODE_BATCH weights
    at a time are encoded in one lockstep pass."""
    if mantissa_bits is not None and low_bits is None:
        low_bits = 0  # the one-stage form with the given m
    _check_parameters(BLOCK_SIZE if block_size is None else block_size, lanes, prob_bits,
                      mantissa_bits, low_bits, max_tables)
    if not (isinstance(decode_cost, (int, float)) and 0 <= decode_cost < float("inf")):
        raise CodecError(f"decode_cost must be a finite number >= 0 (bits per ns), got "
                         f"{decode_cost!r}")
    if context is not None and context not in CONTEXTS:
        raise CodecError(f"context must be one of {CONTEXTS} or None, got {context!r}")
    if own_tables:
        context = "block"
    names = list(names) if names is not None else [""] * len(tensors)
    tensors = [as_bf16(b, nm) for b, nm in zip(tensors, names, strict=True)]
    out, batch = [], []
    for i, bits in enumerate(tensors):
        size = tensor_block_size(bits.size, lanes) if block_size is None else block_size
        # the best two candidates by estimate, confirmed by their models' exact sizes
        candidates = choose_coding(np.bincount(bits.reshape(-1), minlength=1 << 16), prob_bits,
                                   escapes, mantissa_bits, low_bits, decode_cost)[:CONFIRM]
        models = [_model(bits, names[i], size, prob_bits, m, k, max_tables, escapes,
                         own_tables, context, decode_cost) for _, m, k in candidates]
        batch.append(min(  # two stages and tables by context charged what they cost in decoding
            models, key=lambda md: md["bits"] + md["charge"]
        ))
        if i + 1 == len(tensors) or sum(m["n"] for m in batch) >= ENCODE_BATCH:
            out += _encode_batch(batch, lanes, prob_bits)
            batch = []
    return out


def tensor_block_size(n: int, lanes: int = LANES, largest: int = BLOCK_SIZE) -> int:
    """The block size the encoder gives a tensor of ``n`` weights (FORMAT.md 9.5): the fewest
    blocks of at most ``largest`` weights whose count is a multiple of four, each a whole number of
    the lanes' steps. Why: the CPU decoder runs four blocks side by side; SmolLM2's projections
    (13.5 blocks of 65536 weights) left a block and a half to decode alone, at about twice the
    time per weight."""
    blocks = -(-max(n, 1) // largest)
    blocks = -(-blocks // 4) * 4
    per_block = -(-n // blocks)
    steps = -(-per_block // lanes)
    return min(largest, max(1, steps) * lanes)


def _model(bits: np.ndarray, name: str, block_size: int, prob_bits: int, mantissa_bits: int,
           low_bits: int,
           max_tables: int, escapes: bool, own_tables: bool,
           context: str | None = None,
           decode_cost: float = DECODE_BITS_PER_NS) -> dict[str, Any]:
    """Everything about one tensor but the rANS coding itself: symbols, alphabet, tables, escapes,
    second-stage symbols and tables, raw bits."""
    flat = bits.reshape(-1)
    values, raw = split_weights(flat, mantissa_bits)
    lows, raw = split_low(raw, mantissa_bits, low_bits)
    alphabet = choose_alphabet(np.bincount(values, minlength=1 << (8 + mantissa_bits)), prob_bits,
                               8 + mantissa_bits, escapes)
    escape = len(alphabet)
    symbol_of = np.full(1 << (8 + mantissa_bits), escape, np.int64)
    symbol_of[np.asarray(alphabet, np.int64)] = np.arange(escape)
    symbols = symbol_of[values]  # (values are uint16 < 2^15)
    n_blocks = -(-len(flat) // block_size)
    if own_tables and n_blocks > MAX_TABLES:
        raise CodecError(f"tensor {name!r}: {n_blocks} blocks cannot each have a table (at most "
                         f"{MAX_TABLES})")
    block_counts = np.bincount(np.arange(len(flat)) // block_size * (escape + 1) + symbols,
                               minlength=n_blocks * (escape + 1)).reshape(n_blocks, escape + 1)
    # the exponent of each symbol
    order_key = np.append(np.asarray(alphabet, np.float64) / (1 << mantissa_bits), 0.0)
    chosen = choose_context(symbols, tuple(bits.shape), escape + 1, block_size, order_key,
                            prob_bits, max_tables, own_tables, context, decode_cost, low_bits)
    freqs = chosen["freqs"]
    symbol_class, low_freqs = np.zeros(0, np.int64), np.zeros((0, 1), np.int64)
    if low_bits:
        joint = np.bincount(symbols << low_bits | lows, minlength=(escape + 1) << low_bits)
        joint = joint.reshape(escape + 1, -1)
        unit = np.append(np.asarray(alphabet, np.int64) >> mantissa_bits, ESCAPE_UNIT)
        symbol_class = choose_classes(joint, unit, low_bits,
                                      decode_charge(len(flat), decode_cost, low_tables=1))[0]
        low_freqs = class_tables(joint, symbol_class, prob_bits)
    escaped = symbols == escape
    # the coded size in bits (ideal rANS, without the lanes' states): stream, tables, raw bits,
    # escapes
    size = chosen["bits"]  # first-stage stream and tables, block or context table
    if low_bits:
        size += sum(coded_bits(joint[symbol_class == c].sum(axis=0), low_freqs[c], prob_bits)
                    for c in range(len(low_freqs)))
    size += TABLE_ENTRY_BITS * (low_freqs.size + len(alphabet)) + 8 * symbol_class.size
    size += len(flat) * (8 - mantissa_bits - low_bits) + int(escaped.sum()) * (8 + mantissa_bits)
    return {
        "bits": size,
        "name": name,
        "shape": tuple(int(d) for d in bits.shape),
        "n": len(flat),
        "m": mantissa_bits,
        "k": low_bits,
        "symbols": symbols,
        "lows": lows,
        "alphabet": np.asarray(alphabet, np.uint16),
        "freqs": freqs,
        "n_blocks": n_blocks,
        "block_table": chosen["block_table"],
        "stride": chosen["stride"],
        "period": chosen["period"],
        "context": chosen["context"],
        # what its decoding time is worth in bits: the first stage's tables and context, the
        # second stage (choose_context), and the second stage's tables
        "charge": chosen["charge"] + decode_charge(len(flat), decode_cost,
                                                   low_tables=len(low_freqs) if low_bits else 0),
        "block_size": block_size,
        "context_table": chosen["context_table"],
        "symbol_class": symbol_class,
        "low_freqs": low_freqs,
        "raw": pack_fields(raw, 8 - mantissa_bits - low_bits),
        "escapes": pack_fields(values[escaped], 8 + mantissa_bits),
        "block_escapes": np.concatenate([[0], np.cumsum(block_counts[:, escape])]).astype(
            np.uint32
        ),
        "crc": crc32(flat),
    }


def _encode_batch(models: list[dict[str, Any]], lanes: int, prob_bits: int) -> list[RansTensor]:
    """The rANS coding of several modelled tensors, in one lockstep pass per block size for those
    with one stage and one for those with two, and their RansTensors (in the order of
    ``models``)."""
    out: list[RansTensor | None] = [None] * len(models)
    kinds = sorted({(m["block_size"], m["k"] > 0) for m in models})
    for block_size, two in kinds:
        which = [i for i, m in enumerate(models)
                 if (m["block_size"], m["k"] > 0) == (block_size, two)]
        coded = _encode_stage_batch([models[i] for i in which], block_size, lanes, prob_bits)
        for i, t in zip(which, coded, strict=True):
            out[i] = t
    return out  # type: ignore[return-value]


def _encode_stage_batch(models: list[dict[str, Any]], block_size: int, lanes: int,
                        prob_bits: int) -> list[RansTensor]:
    """The rANS coding of several modelled tensors, all with one stage or all with two, in one
    pass."""
    n_blocks = [m["n_blocks"] for m in models]
    by_context = any(m["period"] for m in models)  # then each weight names its table (rows)
    two = models[0]["k"] > 0
    longest = max((min(block_size, m["n"]) for m in models), default=0)
    steps = -(-longest // lanes)  # a tensor smaller than a block needs fewer steps
    width = max(m["freqs"].shape[1] for m in models)
    symbols = np.zeros((sum(n_blocks), max(steps * lanes, block_size)), np.int64)
    freqs = np.zeros((sum(n_blocks), width), np.int64)
    rows = np.zeros(symbols.shape, np.int32) if by_context else None
    if by_context:  # every model's tables, one after another
        freqs = np.concatenate([np.pad(m["freqs"], ((0, 0), (0, width - m["freqs"].shape[1])))
                                for m in models])
    lengths = np.zeros(sum(n_blocks), np.int64)
    lows = np.zeros(symbols.shape, np.uint8) if two else None
    # the second-stage table of each block's symbols
    low_rows = np.zeros((sum(n_blocks), width), np.int64)
    b0 = row0 = table0 = 0
    for m, nb in zip(models, n_blocks, strict=True):
        padded = np.zeros(nb * block_size, np.int64)
        padded[: m["n"]] = m["symbols"]
        symbols[b0 : b0 + nb, :block_size] = padded.reshape(nb, block_size)
        if not by_context:
            freqs[b0 : b0 + nb, : m["freqs"].shape[1]] = m["freqs"][m["block_table"]]
        elif m["period"]:  # weight i: table context_table[(i // D) % P]
            i = np.arange(nb * block_size, dtype=np.int64)
            table = m["context_table"][(i // m["stride"]) % m["period"]]
            rows[b0 : b0 + nb, :block_size] = (table0 + table).reshape(nb, block_size)
        else:
            rows[b0 : b0 + nb, :block_size] = (table0 + m["block_table"])[:, None]
        table0 += len(m["freqs"])
        lengths[b0 : b0 + nb] = np.minimum(block_size, m["n"] - block_size * np.arange(nb))
        if two:
            padded[: m["n"]] = m["lows"]
            lows[b0 : b0 + nb, :block_size] = padded.reshape(nb, block_size)
            low_rows[b0 : b0 + nb, : len(m["symbol_class"])] = row0 + m["symbol_class"]
            row0 += len(m["low_freqs"])
        b0 += nb
    low_freqs = None
    if two:
        low_width = max(m["low_freqs"].shape[1] for m in models)
        low_freqs = np.concatenate([
            np.pad(m["low_freqs"], ((0, 0), (0, low_width - m["low_freqs"].shape[1])))
            for m in models
        ])
    shape = (len(symbols), steps, lanes)
    words, per_block, states = encode_lanes(
        symbols[:, : steps * lanes].reshape(shape), lengths, freqs, prob_bits,
        None if lows is None else lows[:, : steps * lanes].reshape(shape), low_rows, low_freqs,
        None if rows is None else rows[:, : steps * lanes].reshape(shape),
    )
    out, b0, w0 = [], 0, 0
    for m, nb in zip(models, n_blocks, strict=True):
        count = int(per_block[b0 : b0 + nb].sum())
        if count >= UINT32_LIMIT:
            raise CodecError(f"tensor {m['name']!r}: the rANS stream would be {count} words, "
                             "beyond 2^32 - 1")
        t = RansTensor(
            shape=m["shape"], block_size=block_size, lanes=lanes, prob_bits=prob_bits,
            mantissa_bits=m["m"], low_bits=m["k"], low_tables=len(m["low_freqs"]),
            alphabet_size=len(m["alphabet"]), n_tables=len(m["freqs"]), stream_words=count,
            n_escapes=int(m["block_escapes"][-1]), crc={}, raw=m["raw"], alphabet=m["alphabet"],
            tables=m["freqs"].astype(np.uint16), stream=words[w0 : w0 + count],
            block_words=np.concatenate([[0], np.cumsum(per_block[b0 : b0 + nb])]).astype(np.uint32),
            states=states[b0 : b0 + nb], block_table=m["block_table"].astype(np.uint8),
            context_stride=m["stride"], context_period=m["period"],
            context_table=m["context_table"].astype(np.uint8),
            escapes=m["escapes"], block_escapes=m["block_escapes"],
            symbol_class=m["symbol_class"].astype(np.uint8),
            low_freqs=m["low_freqs"].astype(np.uint16),
            name=m["name"])
        t.crc = {key: crc32(a) for key, a in t.arrays().items()} | {"data": m["crc"]}
        out.append(t)
        b0, w0 = b0 + nb, w0 + count
    return out


def decode_rans(t: RansTensor) -> np.ndarray:
    """Decompress one tensor: its bf16 bit patterns (uint16, original shape). Raises CodecError."""
    return decode_rans_many([t])[0]


def decode_rans_many(tensors: Sequence[RansTensor]) -> list[np.ndarray]:
    """Decompress several tensors; those with the same lanes and prob_bits, and one stage or two,
    share one
    lockstep pass."""
    for t in tensors:
        t.check()
    out: list[np.ndarray | None] = [None] * len(tensors)
    key = lambda i: (tensors[i].lanes, tensors[i].prob_bits, tensors[i].low_bits > 0)  # noqa: E731
    for _, batch in groupby(sorted(range(len(tensors)), key=key), key=key):
        batch = list(batch)
        decoded = _decode_values([tensors[i] for i in batch])
        for i, (values, lows) in zip(batch, decoded, strict=True):
            out[i] = _assemble(tensors[i], values, lows)
    return out  # type: ignore[return-value]


def _decode_values(tensors: list[RansTensor]) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """The decoded symbols' values (exponent and top mantissa bits; ESCAPE_VALUE for an escape) of
    each tensor, and with two stages their low bits."""
    prob_bits = tensors[0].prob_bits
    two = tensors[0].low_bits > 0
    tables, table_base, starts, ends, lengths, tables2, next_base = [], [], [], [], [], [], []
    by_context = any(t.context_period for t in tensors)
    context: list[list[np.ndarray]] = [[], [], [], [], []]  # first, stride, period, offset, bases
    word_base = table_count = table2_count = base_count = 0
    for t in tensors:
        values = np.append(t.alphabet, ESCAPE_VALUE).astype(np.int64)
        tables.append(slot_tables(t.tables, np.broadcast_to(values, t.tables.shape), prob_bits))
        period = t.context_period
        which = t.context_table if period else t.block_table
        bases = (table_count + which.astype(np.int64)) << prob_bits
        table_base.append(np.zeros(t.n_blocks, np.int64) if period else bases)
        if by_context:  # by block: each block its own context of period 1
            nb = t.n_blocks
            context[0].append(np.arange(nb, dtype=np.int64) * t.block_size)
            context[1].append(np.full(nb, t.context_stride if period else 1, np.int64))
            context[2].append(np.full(nb, max(period, 1), np.int64))
            context[3].append(base_count + (np.zeros(nb, np.int64) if period
                                            else np.arange(nb, dtype=np.int64)))
            context[4].append(bases)
            base_count += len(bases)
        if two:  # each first-stage slot names the second-stage table of its symbol
            lows = np.arange(1 << t.low_bits, dtype=np.int64)
            tables2.append(slot_tables(t.low_freqs, np.broadcast_to(lows, t.low_freqs.shape),
                                       prob_bits))
            symbol = np.repeat(np.tile(np.arange(t.alphabet_size + 1), t.n_tables),
                               t.tables.astype(np.int64).reshape(-1))
            next_base.append((table2_count + t.symbol_class.astype(np.int64)[symbol]) << prob_bits)
            table2_count += t.low_tables
        offsets = t.block_words.astype(np.int64) + word_base
        starts.append(offsets[:-1])
        ends.append(offsets[1:])
        lengths.append(t.block_lengths())
        word_base += t.stream_words
        table_count += t.n_tables
    try:
        decoded, lows = decode_lanes(
            np.concatenate([t.stream for t in tensors]), np.concatenate(starts),
            np.concatenate(ends),
            np.concatenate([t.states for t in tensors]), np.concatenate(lengths),
            np.concatenate(table_base), np.concatenate(tables), prob_bits,
            np.concatenate(tables2) if two else None, np.concatenate(next_base) if two else None,
            tuple(np.concatenate(c) for c in context) if by_context else None)
    except CodecError as e:
        names = ", ".join(repr(t.name) for t in tensors[:4]) + (" ..." if len(tensors) > 4 else "")
        raise CodecError(f"tensor(s) {names}: {e}") from None
    cuts = np.cumsum([t.n for t in tensors])[:-1]
    low_parts = np.split(lows, cuts) if two else [None] * len(tensors)
    return list(zip(np.split(decoded, cuts), low_parts, strict=True))


def _assemble(t: RansTensor, values: np.ndarray, lows: np.ndarray | None) -> np.ndarray:
    """Put the escaped values in place, join values, low bits and raw bits into bf16, check the
    CRC."""
    escaped = np.flatnonzero(values == ESCAPE_VALUE)
    per_block = np.bincount(escaped // t.block_size, minlength=t.n_blocks)
    if not np.array_equal(per_block, np.diff(t.block_escapes.astype(np.int64))):
        raise CodecError(f"tensor {t.name!r}: the stream's escapes do not match block_escapes "
                         "(corrupt)")
    escape_values, escapes_ok = unpack_fields(t.escapes, t.escape_bits, t.n_escapes)
    raw, raw_ok = unpack_fields(t.raw, t.raw_bits, t.n)
    if not (escapes_ok and raw_ok):
        raise CodecError(f"tensor {t.name!r}: the padding of the raw bits or of the escapes must "
                         "be 0")
    values[escaped] = escape_values
    if t.low_bits:
        raw = join_low(lows, raw, t.mantissa_bits, t.low_bits)
    bits = join_weights(values, raw, t.mantissa_bits)
    if crc32(bits) != t.crc["data"]:
        raise CodecError(f"tensor {t.name!r}: decoded data fails its CRC-32 check (corrupt header "
                         "or stream)")
    return bits.reshape(t.shape)


def _check_parameters(block_size: int, lanes: int, prob_bits: int, mantissa_bits: int | None,
                      low_bits: int | None, max_tables: int) -> None:
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise CodecError(f"block_size must be 1..{MAX_BLOCK_SIZE}, got {block_size}")
    if not 1 <= lanes <= MAX_LANES:
        raise CodecError(f"lanes must be 1..{MAX_LANES}, got {lanes}")
    if -(-block_size // lanes) > MAX_LANE_STEPS:
        raise CodecError(f"ceil(block_size / lanes) must be <= {MAX_LANE_STEPS} (one lane's "
                         "sequential work)")
    if not MIN_PROB_BITS <= prob_bits <= MAX_PROB_BITS:
        raise CodecError(f"prob_bits must be {MIN_PROB_BITS}..{MAX_PROB_BITS}, got {prob_bits}")
    if mantissa_bits is not None and not 0 <= mantissa_bits <= 7:
        raise CodecError(f"mantissa_bits must be 0..7, got {mantissa_bits}")
    if low_bits is not None and not 0 <= low_bits <= 7 - (mantissa_bits or 0):
        raise CodecError(f"low_bits must be 0..7 - mantissa_bits, got {low_bits}")
    if not 1 <= max_tables <= MAX_TABLES:
        raise CodecError(f"max_tables must be 1..{MAX_TABLES}, got {max_tables}")
