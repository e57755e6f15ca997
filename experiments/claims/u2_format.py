"""U2: the Unweight format as described is implemented, and it is lossless on real weights.

The format (reference/codec/FORMAT.md): per tensor, a palette of the 16 most frequent exponents,
canonical Huffman codes (at most 12 bits) for them, rows of 64 weights ("chunks") holding any other
exponent stored verbatim, the sign/mantissa byte stored as is; a fixed-length palette form
(4-bit index + sign/mantissa byte) for inference. For every floating-point tensor of MiniLM and
SmolLM2 (flagged: dequantized 4-bit) cast to bf16, this checks that encode -> decode, the header
round trip, Huffman -> palette form -> bf16, and palette -> Huffman (byte-identical) are exact, then
compresses the whole checkpoint into a container file and reads it back. It reports how much of
each tensor the palette covers and how many chunks are verbatim.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from experiments.claims.u1_entropy import to_bf16_bits
from experiments.registry import Context, Experiment, Result, pyplot, save_figure
from reference.bf16 import shannon_entropy
from reference.codec import (
    CompressedTensor,
    Container,
    compress_checkpoint,
    decode_many,
    decode_symbols,
    encode,
    from_palette,
    palette_to_bf16,
    to_palette,
)
from reference.codec.palette import exponent_field
from reference.model.names import tensor_kind
from reference.model.weights import open_weights

FORMAT_DOC = "reference/codec/FORMAT.md"


def check_tensor(name: str, bits: np.ndarray, encoded: dict[str, CompressedTensor] | None = None) -> dict[str, Any]:
    """Every round trip of one tensor, and what the palette and verbatim rule did to it (its encoding is
    kept in ``encoded``, by name, when given)."""
    ct = encode(bits, name=name)
    if encoded is not None:
        encoded[name] = ct
    same = lambda a: a.shape == bits.shape and np.array_equal(a, bits)  # noqa: E731
    rebuilt = CompressedTensor.from_parts(json.loads(ct.header_json()), ct.arrays(), name=name)
    pt = to_palette(ct)
    back = from_palette(pt)
    exps = exponent_field(bits.reshape(-1))
    counts = np.bincount(exps, minlength=256)
    in_palette = counts[list(ct.palette)].sum() / max(bits.size, 1)
    symbol_counts = np.bincount(decode_symbols([ct])[0], minlength=len(ct.palette)) if ct.palette else np.zeros(0)
    coded = int(symbol_counts.sum())
    chunk_weights = ct.layout.chunk_length(ct.vchunks.astype(np.int64)).sum()
    return {
        "name": name, "kind": tensor_kind(name), "shape": list(bits.shape), "n": int(bits.size),
        "decode_exact": bool(same(decode_many([ct])[0])),
        "header_round_trip_exact": bool(same(decode_many([rebuilt])[0])),
        "palette_form_exact": bool(same(palette_to_bf16(pt))),
        "transcode_byte_identical": back.header() == ct.header() and all(
            np.array_equal(back.arrays()[k], a) for k, a in ct.arrays().items()),
        "distinct_exponents": int((counts > 0).sum()), "palette_size": len(ct.palette),
        "palette_coverage": float(in_palette), "verbatim_chunks": ct.n_verbatim,
        "verbatim_chunk_share": ct.n_verbatim / max(ct.layout.n_chunks, 1),
        "verbatim_weight_share": float(chunk_weights / max(bits.size, 1)),
        "max_code_length_used": max(ct.code_lengths, default=0),
        "mean_code_bits": ct.stream_bits / coded if coded else 0.0,
        "coded_symbol_entropy": shannon_entropy(symbol_counts),
        "ratio": 2 * bits.size / ct.nbytes,
    }


def check_model(label: str, ctx: Context) -> dict[str, Any]:
    source = open_weights(label)
    tensors, cast, encoded = [], {}, {}
    for name in ctx.track(source.names(), f"{label}: round trips per tensor"):
        bits = to_bf16_bits(source.get(name), source.dtype(name))
        if bits is not None:
            cast[name] = bits
            tensors.append(check_tensor(name, bits, encoded))

    def encoded_above(bits: np.ndarray, *, name: str, **params: Any) -> CompressedTensor:
        """The container's encoder: the tensor encoded above (the same encoder, same bits, default parameters),
        so the whole checkpoint is not encoded twice; anything else is encoded here."""
        if not params and name in encoded and np.array_equal(cast[name], bits):
            return encoded[name]
        return encode(bits, name=name, **params)

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{label}.unweight.safetensors"
        counts = compress_checkpoint(label, path, to_bf16=True, encoder=encoded_above)
        file_bytes = path.stat().st_size
        exact = True
        with Container(path) as c:
            for name, array, _ in c.items():
                want = cast[name] if name in cast else to_bf16_bits(source.get(name), source.dtype(name))
                exact &= bool(np.array_equal(array, source.get(name) if want is None else want))
    n = sum(t["n"] for t in tensors)
    checks = ["decode_exact", "header_round_trip_exact", "palette_form_exact", "transcode_byte_identical"]
    return {
        "weights": label, "description": source.description, "representative": source.representative,
        "note": source.note, "tensors_checked": len(tensors), "weights_checked": n,
        "all_exact": all(t[k] for t in tensors for k in checks) and exact,
        "failures": [(t["name"], k) for t in tensors for k in checks if not t[k]],
        "container": {"round_trip_exact": exact, "file_bytes": file_bytes, **counts},
        "palette_coverage": sum(t["palette_coverage"] * t["n"] for t in tensors) / n,
        "verbatim_weight_share": sum(t["verbatim_weight_share"] * t["n"] for t in tensors) / n,
        "max_code_length_used": max(t["max_code_length_used"] for t in tensors),
        "tensors": tensors,
    }


def run(ctx: Context) -> Result:
    models = [check_model(label, ctx) for label in ["minilm", "smollm2", *ctx.weights]]
    figure = plot(models, ctx)
    main, smol = models[0], models[1]
    ok = all(m["all_exact"] for m in models)
    return Result(
        clock="none",
        measured={"format": FORMAT_DOC, "models": models},
        summary=(f"bit-exact on all {sum(m['tensors_checked'] for m in models)} tensors (4 round trips + "
                 f"container); palette covers {100 * main['palette_coverage']:.3f}% of weights, "
                 f"{100 * main['verbatim_weight_share']:.2f}% in verbatim rows (MiniLM; SmolLM2* "
                 f"{100 * smol['verbatim_weight_share']:.2f}%)"),
        verdict="matches" if ok else "differs",
        why=(f"The format of {FORMAT_DOC} (palette 16, canonical Huffman <= 12 bits, 64-weight verbatim rows, "
             "palette form) is implemented; 'matches' means encode/decode, header round trip, palette form and "
             "the palette->Huffman transcode are exact on every tensor, and the container file round-trips. "
             "*SmolLM2 is dequantized 4-bit weights."),
        setup={"weights": ", ".join(m["weights"] for m in models),
               "workload": "every floating-point tensor cast to bf16 (RNE), default parameters"},
        article={"format": "exponent: 16-entry palette + Huffman; rows of 64 with other exponents verbatim; "
                           "sign+mantissa byte as is; palette form for inference"},
        figures=[figure],
    )


def plot(models: list[dict[str, Any]], ctx: Context) -> str:
    plt = pyplot()

    fig, axes = plt.subplots(len(models), 2, figsize=(13, 3.6 * len(models)), squeeze=False)
    for row, m in zip(axes, models, strict=True):
        ts = [t for t in m["tensors"] if len(t["shape"]) >= 2]
        flag = "" if m["representative"] else " (dequantized 4-bit: not representative)"
        row[0].plot([100 * t["verbatim_weight_share"] for t in ts], ".", label="weights in verbatim rows")
        row[0].plot([100 * (1 - t["palette_coverage"]) for t in ts], ".", label="weights outside the palette")
        row[0].set_yscale("symlog", linthresh=0.01)
        row[0].set_xlabel("weight matrix (file order)")
        row[0].set_ylabel("% of the tensor's weights")
        row[0].set_title(f"{m['weights']}: palette misses and verbatim rows{flag}", fontsize=9)
        row[0].legend(fontsize=7)
        row[1].plot([t["coded_symbol_entropy"] for t in ts], [t["mean_code_bits"] for t in ts], ".")
        lo, hi = min(t["coded_symbol_entropy"] for t in ts), max(t["coded_symbol_entropy"] for t in ts)
        row[1].plot([lo, hi], [lo, hi], "k--", lw=0.8, label="code length = entropy")
        row[1].set_xlabel("entropy of the coded exponents (bits)")
        row[1].set_ylabel("mean Huffman code length (bits)")
        row[1].set_title(f"{m['weights']}: canonical Huffman (max 12 bits) vs entropy, per tensor", fontsize=9)
        row[1].legend(fontsize=7)
    return save_figure(fig, ctx, "U2.png")


EXPERIMENT = Experiment(claim="U2", title="The Unweight format, implemented and lossless on real weights",
                        run=run, quick_minutes=0.75, timed=False)
