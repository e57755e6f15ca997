"""What the rANS mode codes, and with which tables (FORMAT.md section 9.2). The encoder's choices.

* **Symbols.** Each weight is split into a *value* (its 8 exponent bits and the top ``m`` mantissa
  bits, ``8 + m`` bits) that is entropy coded, and *raw bits* (sign and the other ``7 - m`` mantissa
  bits) that are stored as they are. In trained weights the top mantissa bits depend on the exponent
  (within a binade the density of a bell-shaped distribution falls off), so coding them jointly
  with the exponent saves bits; the low bits are noise.
* **Alphabet.** The values common enough to deserve their own slot in the tables, most frequent
  first; every other value is coded as the escape symbol followed by the value itself.
* **Tables.** A few frequency tables per tensor, each block of weights naming the one it uses:
blocks
  are clustered by their value statistics, so the tables follow local statistics (rows of different
  scale) at the cost of a few tables rather than one per block.

All choices are deterministic functions of the counts; the decoder does not depend on how they
were made (any alphabet and any tables that code the data are valid).
"""

from __future__ import annotations

from math import gcd

import numpy as np

from reference.codec.errors import CodecError
from reference.codec.rans.coder import quantize

TABLE_ENTRY_BITS = 16  # a frequency is stored as a uint16
CLUSTER_ROUNDS = 8
CLASS_ROUNDS = 4
MAX_CLASSES = 256  # second-stage tables: a class is stored in a uint8
# What decoding a form costs, in nanoseconds, charged to it in the encoder's choices at
# DECODE_BITS_PER_NS bits a nanosecond (FORMAT.md 9.5): a form, a context or a second-stage class is
# kept only where it saves more bits than its decoding time is worth. Fitted to the one-thread
# decode time of SmolLM2's tensors, each coded in 20 forms (and with 1 to 13 classes), on the
# project's Intel Xeon (AVX-512 lanes). Most of it is the decoding tables' bytes (4096 slots of 4
# bytes per table; a first-stage table twice that where the lanes cannot hold the values in
# registers, more than 256 symbols, 64 with two stages): the more of them the lanes look up in,
# the fewer stay in the core's caches. Besides: values not held in registers cost a lookup per
# weight; two stages a second rANS step per weight and their tables' building per tensor; a
# context a table chosen per weight, rows more than columns (a step's lanes span two rows: a
# blend). Blocks decode four at a time: by block, at most four tables are in use.
TABLE_BYTES = 4096 * 4
TABLE_NS_PER_WEIGHT_PER_BYTE = 0.2 / (256 * 1024)
VALUE_LOOKUP_NS_PER_WEIGHT = 0.1
TWO_STAGE_NS_PER_WEIGHT = 0.08
TWO_STAGE_NS_PER_TENSOR = 15_000.0
CONTEXT_NS_PER_WEIGHT = {"block": 0.0, "column": 0.05, "row": 0.1}
# The exchange rate: at 0.25 bit a nanosecond a second stage with 13 classes (~0.25 ns a weight)
# must save ~0.06 bit a weight, ~0.6% of a weight's coded size. On SmolLM2, one core of the Intel
# Xeon, against the smallest form (0): 0.2% of its size for 1.3x its decoding speed, the point where
# it passes ZipNN's; every cost's trade is measured by experiments/unweight/codec_decode_cost.py.
DECODE_BITS_PER_NS = 0.25


def decode_charge(n: int, bits_per_ns: float, *, context: str = "block", tables: int = 0,
                  alphabet_size: int = 0, low_bits: int = 0, low_tables: int = 0) -> float:
    """The bits charged to a form of an n-weight tensor for its decoding time (FORMAT.md 9.5):
    ``bits_per_ns`` times its modelled nanoseconds: ``tables`` first-stage tables chosen by
    ``context`` over an alphabet of ``alphabet_size`` values, ``low_tables`` second-stage tables,
    two stages if ``low_bits`` > 0."""
    live = tables if context != "block" else min(tables, 4)
    values_too = alphabet_size + 1 > (64 if low_bits else 256)  # (and the escape)
    table_bytes = TABLE_BYTES * (live * (2 if values_too else 1) + low_tables)
    ns = n * (TABLE_NS_PER_WEIGHT_PER_BYTE * table_bytes + CONTEXT_NS_PER_WEIGHT[context]
              + (VALUE_LOOKUP_NS_PER_WEIGHT if values_too and tables else 0.0))
    if low_bits:
        ns += TWO_STAGE_NS_PER_WEIGHT * n + TWO_STAGE_NS_PER_TENSOR
    return bits_per_ns * ns


def split_weights(bits: np.ndarray, mantissa_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, raw) of bf16 bit patterns (uint16 each): value = exponent << m | top m mantissa
    bits; raw = sign << (7 - m) | the low 7 - m mantissa bits."""
    bits = np.asarray(bits, np.uint16)
    low = 7 - mantissa_bits
    values = (bits >> low) & ((1 << (8 + mantissa_bits)) - 1)
    raw = (bits >> 15) << low | (bits & ((1 << low) - 1))
    return values.astype(np.uint16), raw.astype(np.uint16)


def join_weights(values: np.ndarray, raw: np.ndarray, mantissa_bits: int) -> np.ndarray:
    """Inverse of ``split_weights``: the bf16 bit patterns (uint16). Works in uint16 throughout."""
    low = 7 - mantissa_bits
    bits = raw >> low  # the sign
    bits <<= 15
    bits |= values.astype(np.uint16) << low  # exponent and top mantissa bits: < 2^15
    bits |= raw & ((1 << low) - 1)
    return bits


def split_low(raw: np.ndarray, mantissa_bits: int, low_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(lows, rest) of raw fields (sign << (7 - m) | 7 - m mantissa bits, from ``split_weights``):
    low = the
    top k = ``low_bits`` of those mantissa bits (coded in the second stage, FORMAT.md 9.1); rest =
    sign << r
    | the last r = 7 - m - k mantissa bits (stored raw)."""
    raw = np.asarray(raw, np.uint16)
    r = 7 - mantissa_bits - low_bits
    lows = (raw >> r) & ((1 << low_bits) - 1)
    rest = (raw >> (7 - mantissa_bits)) << r | (raw & ((1 << r) - 1))
    return lows.astype(np.uint16), rest.astype(np.uint16)


def join_low(lows: np.ndarray, rest: np.ndarray, mantissa_bits: int, low_bits: int) -> np.ndarray:
    """Inverse of ``split_low``: the raw fields of ``split_weights`` (uint16)."""
    r = 7 - mantissa_bits - low_bits
    raw = rest >> r  # the sign
    raw <<= 7 - mantissa_bits
    raw |= lows.astype(np.uint16) << r
    raw |= rest & ((1 << r) - 1)
    return raw


def field_group(width: int) -> tuple[int, int]:
    """(fields, bytes) of one packing group: the fewest whole bytes that hold whole ``width``-bit
    fields."""
    common = width * 8 // gcd(width, 8)
    return common // width, common // 8


def packed_length(n: int, width: int) -> int:
    fields, nbytes = field_group(width)
    return -(-n // fields) * nbytes


def pack_fields(fields: np.ndarray, width: int) -> np.ndarray:
    """Pack ``width``-bit fields (1 <= width <= 16) into bytes, LSB first: field i is bits
    [width * i, width * (i + 1)) of the packed bit string, and bit j of the string is bit j mod 8 of
    byte j // 8. The last group (``field_group``) is padded with zero fields."""
    per_group, nbytes = field_group(width)
    padded = np.zeros(-(-len(fields) // per_group) * per_group, np.uint16)
    padded[: len(fields)] = fields
    if nbytes <= 7:  # a group fits an int64: shift the fields into place, then cut it into bytes
        groups = padded.reshape(-1, per_group)
        dtype = np.uint32 if nbytes <= 4 else np.uint64
        value = np.zeros(len(groups), dtype)
        for i in range(per_group):
            value |= groups[:, i].astype(dtype) << dtype(width * i)
        out = np.empty((len(groups), nbytes), np.uint8)
        for j in range(nbytes):
            out[:, j] = value >> dtype(8 * j)  # (the cast to uint8 keeps the low byte)
        return out.reshape(-1)
    # wide fields (escapes): single bits
    bits = (padded[:, None].astype(np.int64) >> np.arange(width)) & 1
    return np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little")


def unpack_fields(packed: np.ndarray, width: int, n: int) -> tuple[np.ndarray, bool]:
    """Inverse of ``pack_fields``: (the first n fields as uint16, whether every padding field is
    zero)."""
    per_group, nbytes = field_group(width)
    # assemble each group's integer byte by byte, then cut out its fields one by one
    if nbytes <= 7:
        group_bytes = packed.reshape(-1, nbytes)
        dtype = np.uint32 if nbytes <= 4 else np.uint64
        value = np.zeros(len(group_bytes), dtype)
        for j in range(nbytes):
            value |= group_bytes[:, j].astype(dtype) << dtype(8 * j)
        fields = np.empty((len(group_bytes), per_group), np.uint16)
        for i in range(per_group):
            fields[:, i] = (value >> dtype(width * i)) & dtype((1 << width) - 1)
        fields = fields.reshape(-1)
    else:
        bits = np.unpackbits(packed, bitorder="little").reshape(-1, width).astype(np.int64)
        fields = (bits << np.arange(width)).sum(axis=1).astype(np.uint16)
    return fields[:n], not fields[n:].any()


def choose_alphabet(counts: np.ndarray, prob_bits: int, escape_bits: int,
                    escapes: bool = True) -> list[int]:
    """The values to code directly: the most frequent ones (ties: smaller value first), as many as
    minimise an estimate of the coded size; the others are escaped. Without ``escapes``: every value
    that occurs (and no escape symbol is ever needed).

    The estimate, for the first a values: each costs count * log2(1 / p) with p its share of the
    weights but at least 1 / M (the smallest frequency), plus the mass such a rounded-up symbol
    takes from the others; the escaped weights cost (log2(1 / p_escape) + escape_bits) each; every
    symbol costs one table entry.
    """
    counts = np.asarray(counts, np.int64)
    order = np.lexsort((np.arange(len(counts)), -counts))
    order = order[counts[order] > 0]
    m = 1 << prob_bits
    if not escapes:
        if len(order) > m - 1:
            raise CodecError(f"{len(order)} distinct values, but 2^prob_bits slots hold at most "
                             f"{m - 1} symbols "
                             "(one is kept for the escape)")
        return [int(v) for v in order]
    n = float(counts.sum())
    if n == 0:
        return []
    c = counts[order].astype(np.float64)

    def cost(count: np.ndarray) -> np.ndarray:
        share = np.maximum(count / n, 1 / m)
        return np.where(
            count > 0, count * np.log2(1 / share) + np.maximum(0, n / m - count) / np.log(2), 0
        )

    direct = np.concatenate([[0.0], np.cumsum(cost(c))])
    escaped = n - np.concatenate([[0.0], np.cumsum(c)])
    total = (
        direct
        + cost(escaped)
        + escaped * escape_bits
        + TABLE_ENTRY_BITS * (np.arange(len(c) + 1) + 1)
    )
    best = int(np.argmin(total[: min(len(c), m - 1) + 1]))
    return [int(v) for v in order[:best]]


def coded_bits(counts: np.ndarray, freqs: np.ndarray, prob_bits: int) -> float:
    """What coding ``counts`` with ``freqs`` costs in bits (infinite if a counted symbol has
    frequency 0)."""
    used = counts > 0
    if np.any(used & (freqs == 0)):
        return float("inf")
    return float((counts[used] * (prob_bits - np.log2(freqs[used]))).sum())


def choose_tables(
    block_counts: np.ndarray, order_key: np.ndarray, prob_bits: int, max_tables: int,
    own_tables: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(freqs [K, S], block_table [B]): the tables, and the one each block uses.

    Tries K = 1, 2, 4, ... up to ``max_tables`` clusters of blocks (see ``cluster``) and keeps the K
    whose coded size plus table storage is smallest. With ``own_tables`` every block gets its own
    table (K = B; the ablation's "per-block tables").
    """
    n_blocks = len(block_counts)
    if n_blocks == 0:
        return np.zeros((0, block_counts.shape[1]), np.int64), np.zeros(0, np.int64)
    candidates = [np.arange(n_blocks)] if own_tables else []
    k = 1
    while k <= min(max_tables, n_blocks) and not own_tables:
        candidates.append(cluster(block_counts, order_key, k))
        k *= 2
    best = None
    for assign in candidates:
        totals = cluster_totals(block_counts, assign, int(assign.max()) + 1).astype(np.int64)
        freqs = np.stack([quantize(row, prob_bits) for row in totals])
        size = sum(coded_bits(row, f, prob_bits) for row, f in zip(totals, freqs, strict=True))
        size += freqs.size * TABLE_ENTRY_BITS
        if best is None or size < best[0]:
            best = (size, freqs, assign)
    return best[1], best[2]


def cluster(block_counts: np.ndarray, order_key: np.ndarray, k: int) -> np.ndarray:
    """Assign blocks to at most k clusters of similar statistics (k-means under cross-entropy).

    Start: blocks sorted by their mean ``order_key`` (the exponent of each symbol: blocks differ
    mostly in scale), cut into k runs of equal size. Then up to CLUSTER_ROUNDS rounds of: each
    cluster's distribution (its counts, lightly smoothed toward the pooled one); each block to the
    cluster that codes it in the fewest bits. Empty clusters are dropped; labels are 0 .. k' - 1.
    """
    n_blocks = len(block_counts)
    counts = block_counts.astype(np.float64)
    weight = np.maximum(counts.sum(axis=1), 1)
    mean_key = (counts * order_key).sum(axis=1) / weight
    assign = np.empty(n_blocks, np.int64)
    assign[np.lexsort((np.arange(n_blocks), mean_key))] = np.arange(n_blocks) * k // n_blocks
    pooled = counts.sum(axis=0) + 1e-9
    pooled /= pooled.sum()
    for _ in range(CLUSTER_ROUNDS):
        totals = cluster_totals(counts, assign, k)
        p = (totals + pooled) / (totals.sum(axis=1, keepdims=True) + 1)
        new = np.argmin(-counts @ np.log2(p).T, axis=1)
        if np.array_equal(new, assign):
            break
        assign = new
    return np.unique(assign, return_inverse=True)[1].reshape(-1)


def cluster_totals(counts: np.ndarray, assign: np.ndarray, k: int) -> np.ndarray:
    """The summed counts of each of k clusters ([k, S], float64; exact: the counts are integers
    below 2^53): one matrix product with the clusters' indicator."""
    member = np.zeros((k, len(assign)), np.float64)
    member[assign, np.arange(len(assign))] = 1.0
    return member @ np.asarray(counts, np.float64)


def ideal_bits(counts: np.ndarray) -> float:
    """The empirical entropy of ``counts`` in bits (sum of count * log2(total / count)): what an
    ideal coder
    with one table fitted to them spends."""
    c = np.asarray(counts, np.float64)
    c = c[c > 0]
    return float((c * np.log2(c.sum() / c)).sum()) if c.size else 0.0


def choose_classes(joint: np.ndarray, unit: np.ndarray, low_bits: int,
                   class_charge: float = 0.0) -> tuple[np.ndarray, float]:
    """(symbol_class [S], estimated bits): which second-stage table each first-stage symbol uses.

    ``joint`` [S, 2^k]: how often first-stage symbol s comes with low bits l. Symbols are grouped
    into units
    (``unit`` [S]: the exponent of each symbol's value, the escape a unit of its own); class 0
    pools the units
    that do not pay for a table of their own, and each unit whose low bits differ enough from the
    pool's gets its
    own class: when coding them with its own distribution saves more than its table costs (2^k
    entries of 16
    bits), ideal code lengths throughout. A few rounds, since the pool changes with what leaves it.
    At most
    MAX_CLASSES classes; a symbol that never occurs goes to class 0. The estimate counts the tables.
    ``class_charge``: bits more a class must save (what its table costs in decoding time).
    """
    units, unit_of = np.unique(unit, return_inverse=True)
    per_unit = np.zeros((len(units), joint.shape[1]), np.float64)
    np.add.at(per_unit, unit_of.reshape(-1), joint)
    totals = per_unit.sum(axis=1)
    own_bits = np.array([ideal_bits(row) for row in per_unit])
    table_bits = TABLE_ENTRY_BITS * (1 << low_bits)
    cost = table_bits + class_charge
    own = np.zeros(len(units), bool)
    for _ in range(CLASS_ROUNDS):
        pool = per_unit[~own].sum(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):  # inf where the pool lacks a symbol
            pool_cost = np.log2(pool.sum() / pool) if pool.sum() else np.full(len(pool), np.inf)
            in_pool = np.where(per_unit > 0, per_unit * pool_cost, 0).sum(axis=1)
        gain = np.where(totals > 0, in_pool - own_bits - cost, -np.inf)
        best = np.argsort(-gain, kind="stable")[: MAX_CLASSES - 1]
        new = np.zeros(len(units), bool)
        new[best[gain[best] > 0]] = True
        if np.array_equal(new, own):
            break
        own = new
    pooled = per_unit[~own].sum(axis=0)
    has_pool = pooled.sum() > 0 or not own.any()
    class_of_unit = np.where(own, np.cumsum(own) - 1 + has_pool, 0)
    bits = ideal_bits(pooled) + sum(own_bits[own]) + table_bits * (int(own.sum()) + has_pool)
    return class_of_unit[unit_of.reshape(-1)].astype(np.int64), bits


def class_tables(joint: np.ndarray, symbol_class: np.ndarray, prob_bits: int) -> np.ndarray:
    """The second-stage frequency tables [C, 2^k]: each class's quantized low-bit counts
    (``quantize``); a class
    no weight uses gets all its mass on low bits 0."""
    n_classes = int(symbol_class.max()) + 1 if symbol_class.size else 0
    out = np.zeros((n_classes, joint.shape[1]), np.int64)
    for c in range(n_classes):
        counts = joint[symbol_class == c].sum(axis=0)
        if counts.sum():
            out[c] = quantize(counts, prob_bits)
        else:
            out[c, 0] = 1 << prob_bits
    return out


def estimate_bits(hist: np.ndarray, mantissa_bits: int, low_bits: int, prob_bits: int,
                  escapes: bool = True, bits_per_ns: float = 0.0) -> float:
    """An estimate of a tensor's coded size in bits with m = ``mantissa_bits`` and k =
    ``low_bits``, from ``hist`` (how often each of the 65536 bf16 patterns occurs): ideal code
    lengths with one first-stage table (an upper bound for the clustered tables), the alphabet, the
    escapes, the second-stage tables (``choose_classes``) and the raw bits; plus, at
    ``bits_per_ns`` > 0, what decoding it is worth (``decode_charge``, tables by block). Infinite
    where the parameters cannot code the tensor."""
    patterns = np.arange(1 << 16, dtype=np.int64)
    hist = np.asarray(hist, np.int64)
    n = int(hist.sum())
    values = (patterns >> (7 - mantissa_bits)) & ((1 << (8 + mantissa_bits)) - 1)
    counts = np.bincount(values, hist, minlength=1 << (8 + mantissa_bits))
    try:
        alphabet = np.asarray(choose_alphabet(counts, prob_bits, 8 + mantissa_bits, escapes),
                              np.int64)
    except CodecError:
        return float("inf")
    symbol_of = np.full(len(counts), len(alphabet), np.int64)
    symbol_of[alphabet] = np.arange(len(alphabet))
    symbols = symbol_of[values]
    escaped = int(counts.sum() - counts[alphabet].sum())
    bits = ideal_bits(np.bincount(symbols, hist, minlength=len(alphabet) + 1))
    bits += escaped * (8 + mantissa_bits) + TABLE_ENTRY_BITS * (2 * len(alphabet) + 1)
    bits += n * (8 - mantissa_bits - low_bits)
    if low_bits:
        if 1 << low_bits > 1 << prob_bits and n:
            return float("inf")  # (possibly) more low values than slots
        lows = (patterns >> (7 - mantissa_bits - low_bits)) & ((1 << low_bits) - 1)
        joint = np.bincount(symbols << low_bits | lows, hist,
                            minlength=(len(alphabet) + 1) << low_bits)
        unit = np.append(alphabet >> mantissa_bits, 1 << 8)
        symbol_class, class_bits = choose_classes(joint.reshape(-1, 1 << low_bits), unit, low_bits,
                                                  decode_charge(n, bits_per_ns, low_tables=1))
        bits += class_bits + 8 * (len(alphabet) + 1)  # (8: symbol_class)
        low_tables = int(symbol_class.max()) + 1
    else:
        low_tables = 0
    return bits + decode_charge(n, bits_per_ns, tables=1, alphabet_size=len(alphabet),
                                low_bits=low_bits, low_tables=low_tables)


def choose_coding(hist: np.ndarray, prob_bits: int, escapes: bool = True,
                  mantissa_bits: int | None = None,
                  low_bits: int | None = None,
                  bits_per_ns: float = DECODE_BITS_PER_NS) -> list[tuple[float, int, int]]:
    """The candidates (score, m, k) for a tensor whose bf16 patterns occur ``hist`` times, best
    first
    (FORMAT.md 9.5). Candidates: m = 0 ... 7 with k = 0 (one stage: m mantissa bits coded with the
    exponent, the rest raw), and m = 0 ... 6 with k = 7 - m (two stages: every mantissa bit coded,
    the last 7 - m with a table chosen by the first symbol). The score is ``estimate_bits`` with
    what the form's decoding time is worth at ``bits_per_ns``. A given m or k restricts the
    candidates; ties go to the earlier candidate (k = 0, small m first)."""
    ms = range(8) if mantissa_bits is None else [mantissa_bits]
    ks = [0, None] if low_bits is None else [low_bits]  # None: 7 - m
    out = []
    for k_choice in ks:
        for m in ms:
            k = 7 - m if k_choice is None else k_choice
            if m + k > 7 or (k_choice is None and k == 0):
                continue
            out.append((estimate_bits(hist, m, k, prob_bits, escapes, bits_per_ns), m, k))
    return sorted(out, key=lambda c: c[0])  # (stable: ties keep the order above)


CONTEXTS = ("block", "column", "row")  # what chooses a weight's first-stage table (FORMAT.md 9.2)


def context_of(shape: tuple[int, ...], context: str) -> tuple[int, int] | None:
    """(D, P) of a context for a tensor of ``shape`` (weight i's table: context_table[(i // D) %
    P]): the column (D = 1, P = the last dimension) or the row (D = the last dimension, P = the
    rows), or None where it does not apply (fewer than two dimensions, columns or rows)."""
    if context == "block" or len(shape) < 2:
        return None
    n = int(np.prod(shape, dtype=np.int64))
    cols = int(shape[-1])
    if cols < 2 or n // cols < 2:
        return None
    d, p = (1, cols) if context == "column" else (cols, n // cols)
    return (d, p) if p <= MAX_CONTEXT_PERIOD else None


# the encoder's own bound on P (the format's is 2^24): beyond it (an embedding's rows, one per
# token) clustering the groups costs most of the encoding time and has never won
MAX_CONTEXT_PERIOD = 1 << 14


def choose_context(
    symbols: np.ndarray, shape: tuple[int, ...], n_symbols: int, block_size: int,
    order_key: np.ndarray, prob_bits: int, max_tables: int, own_tables: bool = False,
    context: str | None = None, bits_per_ns: float = DECODE_BITS_PER_NS, low_bits: int = 0,
) -> dict[str, object]:
    """The first-stage tables and what chooses among them, by measured size (FORMAT.md 9.5).

    Candidates: tables clustered over blocks (``block_table``), over the columns of the tensor
    (``context_table`` per column: D = 1, P = columns) and over its rows (D = columns, P = rows);
    each costs its coded size (quantized tables), 16 bits per table entry and 8 bits per entry of
    its block or context table, and what its decoding time is worth (``decode_charge`` at
    ``bits_per_ns``, two stages if ``low_bits`` > 0: a context looks a table up per weight).
    ``context`` forces one (``"block"``, ``"column"``, ``"row"``); None takes the smallest (ties:
    the earlier). Returns freqs [K, S],
    block_table, stride D, period P (0: by block), the context's name, context_table and the size
    in bits (without the charge)."""
    n = len(symbols)
    n_blocks = -(-n // block_size)
    choices = [context] if context is not None else list(CONTEXTS)
    best: dict[str, object] | None = None
    for c in choices:
        width = n_symbols
        if c == "block":  # block i // block_size; past the end, an extra symbol (dropped below)
            d, p, n_groups, width = 1, 0, n_blocks, n_symbols + 1
            padded = np.full(n_blocks * block_size, n_symbols, np.int64)
            padded[:n] = symbols
            first = np.arange(n_blocks, dtype=np.int64) * width
            keys = padded.reshape(n_blocks, block_size) + first[:, None]
        else:
            dp = context_of(shape, c)
            if dp is None:
                if context is not None:
                    raise CodecError(f"the {c} context does not apply to shape {list(shape)}")
                continue
            d, p = dp
            n_groups = p
            if d == 1:  # the column: i mod p
                keys = symbols.reshape(-1, p) + (np.arange(p, dtype=np.int64) * n_symbols)[None, :]
            else:  # the row: i // d
                keys = symbols.reshape(p, d) + (np.arange(p, dtype=np.int64) * n_symbols)[:, None]
        counts = np.bincount(keys.reshape(-1), minlength=n_groups * width).reshape(n_groups, width)
        counts = counts[:, :n_symbols]
        freqs, assign = choose_tables(counts, order_key, prob_bits, max_tables,
                                      own_tables and c == "block")
        size = sum(coded_bits(counts[assign == j].sum(axis=0), freqs[j], prob_bits)
                   for j in range(len(freqs)))
        size += TABLE_ENTRY_BITS * freqs.size + 8 * n_groups
        score = size + decode_charge(n, bits_per_ns, context=c, tables=len(freqs),
                                     alphabet_size=n_symbols - 1, low_bits=low_bits)
        if best is None or score < best["score"]:
            best = {"bits": size, "score": score, "freqs": freqs, "stride": d, "period": p,
                    "context": c, "charge": score - size,
                    "block_table": assign if p == 0 else np.zeros(0, np.int64),
                    "context_table": assign if p else np.zeros(0, np.int64)}
    assert best is not None
    return best
