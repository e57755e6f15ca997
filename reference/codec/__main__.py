"""Command line:
``python -m reference.codec compress IN OUT [--mode rans] | decompress IN OUT | inspect FILE``.

IN for ``compress`` is anything the weight loaders accept: a packaged model name (minilm, smollm2),
a .safetensors file, a checkpoint directory, a .gguf file. float32/float16 tensors are compressed
only with ``--to-bf16`` (round-to-nearest-even; ``decompress`` then writes that bf16 checkpoint).
``--mode unweight`` (default) writes the Unweight Huffman form; ``--mode rans`` our rANS form
(FORMAT.md section 9: smaller, decoded by interleaved lanes). Each mode takes its own parameters.

OUT appears complete or not at all: it is written to a temporary file beside it and renamed when
done. Interrupted (Ctrl-C, SIGTERM, SIGHUP), the command removes its temporary files, leaves OUT as
it was and exits with 128 + the signal number. Errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import signal
import sys

import numpy as np

from reference.bf16 import field_stats
from reference.codec.codec import (
    CHUNK_SIZE,
    CHUNKS_PER_GROUP,
    MAX_CODE_LENGTH,
    PALETTE_SIZE,
    encode,
)
from reference.codec.container_read import (
    Container,
    Encoder,
    HuffmanDecoder,
    RansDecoder,
    weight_count,
)
from reference.codec.container_write import (
    MIN_ELEMENTS,
    MODES,
    compress_checkpoint,
    decompress_checkpoint,
)
from reference.codec.errors import CodecError
from reference.codec.rans import (
    BLOCK_SIZE,
    DECODE_BITS_PER_NS,
    LANES,
    MANTISSA_BITS,
    PROB_BITS,
    TABLES,
    RansTensor,
)
from reference.model.names import tensor_kind
from reference.safe_write import Interrupted, remove_temporary_files, signals_raise

MODE_PARAMS = {
    "unweight": {"palette-size": PALETTE_SIZE, "chunk-size": CHUNK_SIZE,
                 "chunks-per-group": CHUNKS_PER_GROUP, "max-code-length": MAX_CODE_LENGTH},
    "rans": {"block-size": f"per tensor, at most {BLOCK_SIZE}, their count a multiple of 4",
             "lanes": LANES, "prob-bits": PROB_BITS, "mantissa-bits": MANTISSA_BITS,
             "max-tables": TABLES,
             "decode-cost": f"{DECODE_BITS_PER_NS} bits a nanosecond of decoding is worth; 0: the "
                            "smallest form"},
}
FLOAT_PARAMS = {"decode-cost"}


def main(argv: list[str] | None = None, *, prog: str = "python -m reference.codec",
         encoder: Encoder = encode,
         decoder: HuffmanDecoder | None = None, rans_decoder: RansDecoder | None = None,
         description: str | None = None) -> int:
    """The command line. ``python -m fast.codec`` is this function with the C encoder and decoders
    (``encoder``, ``decoder``, ``rans_decoder``: see ``compress_checkpoint`` and ``Container``):
    same arguments, same files."""
    parser = argparse.ArgumentParser(prog=prog, description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compress", help="compress a checkpoint into a container file")
    c.add_argument("source", help="packaged model name, .safetensors file or folder, or .gguf file")
    c.add_argument("out", help="the container file to write (.safetensors)")
    c.add_argument("--to-bf16", action="store_true", help="cast float32/float16 tensors to bf16 "
                                                          "(RNE) and compress")
    c.add_argument("--min-elements", type=int, default=MIN_ELEMENTS,
                   help="smaller tensors pass through")
    c.add_argument("--mode", choices=MODES, default="unweight",
                   help="unweight: the Unweight Huffman form; rans: our rANS form (FORMAT.md "
                        "section 9)")
    for flag, default in MODE_PARAMS["unweight"].items():
        c.add_argument(f"--{flag}", type=int, default=None, help="unweight mode (default "
                                                                 f"{default})")
    for flag, default in MODE_PARAMS["rans"].items():
        c.add_argument(f"--{flag}", type=float if flag in FLOAT_PARAMS else int, default=None,
                       help=f"rans mode (default {default})")
    d = sub.add_parser("decompress", help="write a container back as a plain bf16 safetensors file")
    d.add_argument("container", help="the container file")
    d.add_argument("out", help="the safetensors file to write")
    i = sub.add_parser("inspect", help="per-tensor table: form, shape, ratio, entropy bound, "
                                       "rare-exponent share")
    i.add_argument("container", help="the container file")
    args = parser.parse_args(argv)
    try:
        with signals_raise():
            run(args, encoder, decoder, rans_decoder)
    except CodecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the disk is full, a permission is missing: name it, without a traceback
        print(f"error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", file=sys.stderr)
        return 2
    except Interrupted as e:
        remove_temporary_files()  # those the signal stopped before their own clean-up began
        print(f"interrupted by {signal.Signals(e.signum).name}: temporary files removed, no "
              "partial output left", file=sys.stderr)
        return 128 + e.signum
    return 0


def run(args: argparse.Namespace, encoder: Encoder = encode, decoder: HuffmanDecoder | None = None,
        rans_decoder: RansDecoder | None = None) -> None:
    """Carry out one parsed command."""
    if args.command == "compress":
        params = {}
        for mode, flags in MODE_PARAMS.items():
            for flag in flags:
                value = getattr(args, flag.replace("-", "_"))
                if value is not None and mode != args.mode:
                    raise CodecError(f"--{flag} is a parameter of --mode {mode}, not of --mode "
                                     f"{args.mode}")
                if value is not None:
                    params[flag.replace("-", "_")] = value
        counts = compress_checkpoint(args.source, args.out, to_bf16=args.to_bf16,
                                     min_elements=args.min_elements,
                                     progress=True, mode=args.mode, encoder=encoder, **params)
        print(f"wrote {args.out}: {counts['compressed']} tensors compressed, {counts['passed']} "
              "passed through")
        if counts["castable_passed"]:
            print(f"note: {counts['castable_passed']} float32/float16 tensors were passed through "
                  "unchanged; "
                  "add --to-bf16 to cast them to bf16 and compress them", file=sys.stderr)
    elif args.command == "decompress":
        n = decompress_checkpoint(args.container, args.out, progress=True, decoder=decoder,
                                  rans_decoder=rans_decoder)
        print(f"wrote {args.out}: {n} tensors")
    else:
        inspect(args.container, decoder, rans_decoder)


def inspect(path: str, decoder: HuffmanDecoder | None = None,
            rans_decoder: RansDecoder | None = None) -> None:
    """Print one row per tensor; decodes (and so verifies) every tensor to measure its entropy."""
    total_in = total_out = 0
    with Container(path, decoder=decoder, rans_decoder=rans_decoder) as c:
        print(f"{'tensor':52s} {'kind':9s} {'form':>7s} {'shape':>14s} {'dtype':>9s} {'ratio':>7s} "
              f"{'bound':>7s} "
              f"{'rare':>8s}")
        for name, array, dtype in c.items(progress=True):
            shape = "x".join(map(str, array.shape)) or "scalar"
            if c.is_compressed(name):
                # items() has just decoded and verified it
                ct = c.compressed(name, check_arrays=False)
                n = weight_count(ct)
                h = field_stats(array).exponent_entropy
                ratio, bound = 2 * n / ct.nbytes, 16 / (8 + h)
                if isinstance(ct, RansTensor):  # rare: the escaped weights' share
                    form, share = "rans", ct.n_escapes / max(n, 1)
                else:  # rare: the verbatim chunks' share
                    form, share = "huffman", ct.n_verbatim / max(ct.layout.n_chunks, 1)
                src = c.headers[name]["source_dtype"]
                total_in, total_out = total_in + 2 * n, total_out + ct.nbytes
                src = "BF16" if src == "BF16" else f"{src}>bf16"
                print(f"{name[:52]:52s} {tensor_kind(name):9s} {form:>7s} {shape:>14s} {src:>9s} "
                      f"{ratio:6.4f}x {bound:6.4f}x {100 * share:7.3f}%")
            else:
                total_in, total_out = total_in + array.nbytes, total_out + array.nbytes
                print(
                    f"{name[:52]:52s} {tensor_kind(name):9s} {'raw':>7s} {shape:>14s} {dtype:>9s}"
                )
    print(f"whole file: {total_in / 2**20:.2f} MiB of tensors in {total_out / 2**20:.2f} MiB: "
          f"{total_in / max(total_out, 1):.4f}x "
          f"({np.float64(1 - total_out / max(total_in, 1)):.1%} smaller)")


if __name__ == "__main__":
    sys.exit(main())
