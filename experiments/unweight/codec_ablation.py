"""U3's ablation of the rANS mode: what each idea gains, in bits per weight, on real tensors.

Measured by encoding (sizes with every overhead counted: arrays and header), never assumed:

* **where the bits go** in both modes, next to the per-tensor bound 8 + H (H: exponent entropy);
* **leave one out**: the final design with one idea switched off, re-encoded: ``gain_bpw`` is how
  many bits per weight the design would lose without it;
* **dropped ideas**: variants we built and measured but did not keep (``delta_bpw``: what they cost
  over the final design; positive = worse), and two context models we estimated from entropies
  (marked ``estimate``: ideal codes, with the side information at its packed size and a 16-bit
  table entry per symbol and context counted);
* **coders** on the same symbols: ideal entropy, Huffman, Huffman over symbol pairs, rANS;
* **sweeps** of block size (the parallelism / index trade-off), probability precision, mantissa bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.registry import Context
from reference.bf16 import field_stats
from reference.codec import CompressedTensor, RansTensor, encode, encode_rans_many
from reference.codec.errors import CodecError
from reference.codec.huffman import code_lengths
from reference.codec.rans.model import split_weights

FINAL = {"mantissa_bits": 2, "max_tables": 16, "escapes": True, "block_size": 65536, "prob_bits": 12}
LEAVE_ONE_OUT = {  # idea -> the parameters that switch it off
    "exponent + top 2 mantissa bits coded jointly (off: exponent only)": {"mantissa_bits": 0},
    "clustered tables, up to 16 per tensor (off: one table)": {"max_tables": 1},
    "escapes for rare values (off: every value gets a slot)": {"escapes": False},
    "tables by context, a weight's column or row, where they pay (off: by block)": {"context": "block"},
}
DROPPED = {"one table per block (instead of clustered tables)": {"own_tables": True},
           "exponent + top 3 mantissa bits": {"mantissa_bits": 3}}
SWEEPS = {"block_size": ((8192, 65536, 262144), (4096, 8192, 16384, 32768, 65536, 131072, 262144)),
          "prob_bits": ((10, 14), (10, 11, 12, 13, 14)), "mantissa_bits": ((0, 1, 3), (0, 1, 3, 4))}


def bits_per_weight(cts: list[Any], n: int) -> float:
    return 8 * sum(c.nbytes for c in cts) / n


def run_ablation(tensors: list[np.ndarray], ctx: Context) -> dict[str, Any]:
    """Everything above, on ``tensors`` (bf16 bit patterns)."""
    n = sum(t.size for t in tensors)
    final = encode_rans_many(tensors, **FINAL)
    unweight = [encode(t) for t in tensors]
    final_bpw = bits_per_weight(final, n)
    encoded: dict[str, float] = {}

    def size(**params: Any) -> float:
        key = repr(sorted(params.items()))
        if key not in encoded:
            try:
                encoded[key] = bits_per_weight(encode_rans_many(tensors, **(FINAL | params)), n)
            except CodecError:  # without escapes, a tensor with more values than slots: give it 2^15 slots
                encoded[key] = bits_per_weight(encode_rans_many(tensors, **(FINAL | params | {"prob_bits": 15})), n)
        return encoded[key]

    ideas = list(LEAVE_ONE_OUT.items()) + list(DROPPED.items())
    for _, params in ctx.track(ideas, "U3 ablation: leave one out, dropped ideas"):
        size(**params)
    exponent_only = encode_rans_many(tensors, **(FINAL | {"mantissa_bits": 0}))
    sweeps = {}
    for key, (quick, full) in SWEEPS.items():
        values = sorted({*(full if ctx.full else quick), FINAL[key]})
        sweeps[key] = [{key: v, "bpw": final_bpw if v == FINAL[key] else size(**{key: v})}
                       for v in ctx.track(values, f"U3 ablation: {key} sweep")]
    for row in sweeps["block_size"]:
        row["weights_per_lane"] = row["block_size"] // 32
        row["index_bpw"] = (32 * (32 + 2) + 8) / row["block_size"]  # states, 2 offsets, table id per block
    bound = sum(t.size * (8 + field_stats(t).exponent_entropy) for t in tensors) / n
    return {
        "weights": n, "bound_bpw": bound, "final_bpw": final_bpw, "unweight_bpw": bits_per_weight(unweight, n),
        "final_params": FINAL,
        "where_the_bits_go": {"rans": rans_parts(final, tensors, n), "unweight": unweight_parts(unweight, n)},
        "leave_one_out": [{"idea": idea, "params": p, "bpw": size(**p), "gain_bpw": size(**p) - final_bpw}
                          for idea, p in LEAVE_ONE_OUT.items()],
        "dropped": [{"idea": idea, "params": p, "bpw": size(**p), "delta_bpw": size(**p) - final_bpw}
                    for idea, p in DROPPED.items()] + context_estimates(tensors, final, n, final_bpw),
        "coders": {"exponent only (m=0)": coder_costs(exponent_only, tensors, n, pairs=True),
                   "final (m=2)": coder_costs(final, tensors, n, pairs=False)},
        "sweeps": sweeps,
    }


def weight_tables(t: RansTensor) -> np.ndarray:
    """The first-stage table of each weight (FORMAT.md 9.2: its block's, or its context's)."""
    index = np.arange(t.n)
    if t.context_period:
        return t.context_table.astype(np.int64)[index // t.context_stride % t.context_period]
    return t.block_table.astype(np.int64)[index // t.block_size]


def symbol_counts(t: RansTensor, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(counts [tables, A + 1] of the symbols each table codes, the symbols in weight order, each weight's table)
    of an encoded tensor."""
    values, _ = split_weights(bits.reshape(-1), t.mantissa_bits)
    symbol_of = np.full(1 << t.escape_bits, t.alphabet_size, np.int64)
    symbol_of[t.alphabet.astype(np.int64)] = np.arange(t.alphabet_size)
    symbols = symbol_of[values]
    table = weight_tables(t)
    width = t.alphabet_size + 1
    counts = np.bincount(table * width + symbols, minlength=t.n_tables * width).reshape(t.n_tables, width)
    return counts, symbols, table


def rans_parts(cts: list[RansTensor], tensors: list[np.ndarray], n: int) -> dict[str, float]:
    """Bits per weight of each part of the rANS mode. 'model' is the ideal cost of the symbols under
    their quantized tables; 'coder_loss' what rANS adds to it: stream words and lanes' states,
    minus the model; 'index' the per-block offsets and table ids."""
    parts = dict.fromkeys(["raw_bits", "model", "coder_loss", "escapes", "index", "tables", "header"], 0.0)
    for t, bits in zip(cts, tensors, strict=True):
        counts, _, _ = symbol_counts(t, bits)
        freq = t.tables.astype(np.float64)
        model = float((counts * (t.prob_bits - np.log2(np.where(counts > 0, freq, 1)))).sum())
        parts["raw_bits"] += 8 * t.raw.nbytes
        parts["model"] += model
        parts["coder_loss"] += 16 * t.stream_words + 32 * t.states.size - model
        parts["escapes"] += 8 * t.escapes.nbytes
        parts["index"] += 8 * (t.block_words.nbytes + t.block_escapes.nbytes + t.block_table.nbytes
                               + t.context_table.nbytes)
        parts["tables"] += 8 * (t.tables.nbytes + t.alphabet.nbytes)
        parts["header"] += 8 * len(t.header_json().encode())
    return {k: v / n for k, v in parts.items()}


def unweight_parts(cts: list[CompressedTensor], n: int) -> dict[str, float]:
    parts = dict.fromkeys(["sign_mantissa", "huffman_stream", "verbatim_exponents", "verbatim_ids",
                           "group_offsets", "header_and_padding"], 0.0)
    for c in cts:
        parts["sign_mantissa"] += 8 * c.sm.nbytes
        parts["huffman_stream"] += c.stream_bits
        parts["verbatim_exponents"] += 8 * c.vexp.nbytes
        parts["verbatim_ids"] += 8 * c.vchunks.nbytes
        parts["group_offsets"] += 8 * c.offsets.nbytes
        parts["header_and_padding"] += 8 * len(c.header_json().encode()) + 32 * len(c.stream) - c.stream_bits
    return {k: v / n for k, v in parts.items()}


def coder_costs(cts: list[RansTensor], tensors: list[np.ndarray], n: int, pairs: bool) -> dict[str, float]:
    """Bits per weight of the coded symbols (escape payloads, tables and index not counted) under
    each coder, with the same symbols and the same per-block table choice: the empirical entropy
    of each table's symbols, Huffman codes (max length 16), Huffman over pairs of consecutive
    symbols of a block (pair tables not counted), and rANS: its stream and the lanes' states."""
    cost = dict.fromkeys(["entropy", "huffman", *(["huffman_pairs"] if pairs else []), "rans"], 0.0)
    for t, bits in zip(cts, tensors, strict=True):
        counts, symbols, table = symbol_counts(t, bits)
        width = t.alphabet_size + 1
        index = np.arange(t.n)
        block_end = np.minimum(t.n, (index // t.block_size + 1) * t.block_size)
        pair_start = (index % t.block_size % 2 == 0) & (index + 1 < block_end)
        pair_start[:-1] &= table[:-1] == table[1:]  # (tables by context: a pair takes one table)
        for k in range(t.n_tables):
            c = counts[k]
            used = c > 0
            cost["entropy"] += float((c[used] * np.log2(c.sum() / c[used])).sum())
            cost["huffman"] += float((c * np.array(code_lengths(c, 16))).sum())
            if pairs:  # consecutive weights (2i, 2i + 1) of a block; a block's odd last weight is coded alone
                starts = np.flatnonzero(pair_start & (table == k))
                pair_counts = np.bincount(symbols[starts] * width + symbols[starts + 1], minlength=width * width)
                alone = c - np.bincount(symbols[starts], minlength=width) - np.bincount(symbols[starts + 1],
                                                                                       minlength=width)
                cost["huffman_pairs"] += float((pair_counts * np.array(code_lengths(pair_counts, 16))).sum())
                cost["huffman_pairs"] += float((alone * np.array(code_lengths(c, 16))).sum())
        cost["rans"] += 16 * t.stream_words + 32 * t.states.size  # the lanes' final states hold the rest
    return {k: v / n for k, v in cost.items()}


def context_estimates(tensors: list[np.ndarray], final: list[RansTensor], n: int,
                      final_bpw: float) -> list[dict[str, Any]]:
    """Two context models in place of the clustered tables, estimated: ideal codes for the symbols,
    plus side information (a packed class id per row) and one 16-bit entry per symbol and context."""
    base = prev = rows = 0.0
    for t, bits in zip(final, tensors, strict=True):
        counts, symbols, _ = symbol_counts(t, bits)
        freq = t.tables.astype(np.float64)
        base += float((counts * (t.prob_bits - np.log2(np.where(counts > 0, freq, 1)))).sum())
        base += 16 * t.tables.size
        exponent = (bits.reshape(-1).astype(np.int64) >> 7) & 0xFF
        previous = np.concatenate([np.zeros(t.lanes, np.int64), exponent[: -t.lanes]])  # same lane, one step back
        prev += conditional_entropy(symbols, previous) + 16 * (t.alphabet_size + 1) * len(np.unique(previous))
        cols = bits.shape[-1] if bits.ndim else 1
        row_scale = np.round(2 * exponent.reshape(-1, cols).mean(axis=1)).astype(np.int64)  # per row, in half-binades
        classes = np.unique(row_scale, return_counts=True)[1]
        rows += conditional_entropy(symbols, np.repeat(row_scale, cols)) + 16 * (t.alphabet_size + 1) * len(classes)
        rows += len(row_scale) * max(1, int(np.ceil(np.log2(len(classes)))))  # each row's class id, packed
    return [{"idea": f"{idea} (estimate)", "bpw": final_bpw + (bits - base) / n, "delta_bpw": (bits - base) / n}
            for idea, bits in [("the previous weight of the lane (its exponent) as context", prev),
                               ("a table per class of rows of similar scale (mean exponent)", rows)]]


def entropy(counts: np.ndarray) -> float:
    c = counts[counts > 0].astype(np.float64)
    return float(-(c / c.sum() * np.log2(c / c.sum())).sum())


def conditional_entropy(symbols: np.ndarray, context: np.ndarray) -> float:
    """Total bits of coding ``symbols`` with one ideal table per value of ``context``."""
    joint = np.unique(context * (int(symbols.max()) + 1) + symbols, return_counts=True)[1]
    ctx = np.unique(context, return_counts=True)[1]
    return len(symbols) * (entropy(joint) - entropy(ctx))
