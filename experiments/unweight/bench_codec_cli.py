"""The decompression command end to end: ``python -m fast.codec decompress`` against ZipNN's and lmzip's.

    python -m experiments.unweight.bench_codec_cli [--weights minilm smollm2] [--repeat 5] [--json PATH]

What a user runs to get a plain bf16 safetensors file back, timed as a whole process (interpreter start,
imports, reading the compressed file, decoding, writing the output, exit), one thread on one core for each:

* **ours**: ``python -m fast.codec decompress CONTAINER OUT`` (``OMP_NUM_THREADS=1``: the C decoders at one
  thread; the output written through ``atomic_output``, fsync included), for the Huffman container and the rANS
  one;
* **ZipNN**: a script that opens a safetensors file of ZipNN-compressed tensors (one uint8 blob per tensor,
  ``ZipNN(input_format='byte', bytearray_dtype='bfloat16', threads=1)``, shapes in the metadata), decompresses
  each with ``ZipNN.decompress``, wraps it as a torch bf16 tensor (no copy) and writes them all with
  ``safetensors.torch.save_file`` (``torch.set_num_threads(1)``);
* **lmzip** (where installed: ``pip install -e ".[peers]"``; else skipped with a line saying so): a script that
  runs ``lmz.decompress(archive, out, workers=1)`` (its CRCs checked), the archive made by ``lmz.compress`` of
  the whole file (its default level), which writes the file back byte for byte.

Input: every floating-point tensor with >= 2 dimensions cast to bf16, as one safetensors file (as
``bench_codec_peers.py``). Every run's output is checked: ours and lmzip's byte-identical to the input file,
ZipNN's tensor by tensor (save_file orders its header its own way). ``--repeat`` runs alternate the commands;
reported: each command's median and best wall time, the median over runs of ZipNN's time / ours and lmzip's time /
ours (the numbers to read on a shared machine), and a bare ``python -c pass`` for the interpreter's own start.
The CPU is named in the result.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.unweight.bench_codec_peers import (
    PEERS_EXTRA,
    arguments,
    model_tensors,
    package_version,
    pin_one_core,
    store,
    write_model_file,
)

DEFAULT_JSON = Path(__file__).resolve().parents[1] / "results" / "bench_codec_cli.json"
REPO = Path(__file__).resolve().parents[2]

ZIPNN_DECOMPRESS = """
import json, sys, warnings
import torch, zipnn
from safetensors import safe_open
from safetensors.torch import save_file
torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*not writable.*")  # torch.frombuffer on the bytes zipnn returns
z = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1)
with safe_open(sys.argv[1], "np") as f:
    shapes = json.loads(f.metadata()["shapes"])
    out = {n: torch.frombuffer(z.decompress(f.get_tensor(n).tobytes()), dtype=torch.bfloat16).reshape(shapes[n])
           for n in f.keys()}
save_file(out, sys.argv[2])
"""

LMZIP_DECOMPRESS = """
import sys
import lmz
lmz.decompress(sys.argv[1], sys.argv[2], workers=1, overwrite=True)
"""


def zipnn_file(tensors: dict[str, np.ndarray], path: Path) -> None:
    """A safetensors file of ZipNN-compressed tensors: one uint8 blob each, their shapes in the metadata."""
    import zipnn
    from safetensors.numpy import save_file

    z = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1)
    blobs = {n: np.frombuffer(z.compress(bytearray(t.tobytes())), np.uint8) for n, t in tensors.items()}
    save_file(blobs, str(path), metadata={"shapes": json.dumps({n: list(t.shape) for n, t in tensors.items()})})


def same_tensors(path: Path, tensors: dict[str, np.ndarray]) -> bool:
    from reference.model.safetensors_io import SafetensorsFile

    with SafetensorsFile(path) as f:
        return set(f) == set(tensors) and all(
            f.info(n).dtype == "BF16" and np.array_equal(f[n], t) for n, t in tensors.items())


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def measure_model(weights: str, repeat: int, workdir: Path, env: dict[str, str], lmzip: bool = False) -> dict[str, Any]:
    from fast.codec.__main__ import encode_to_reference
    from reference.codec.container_write import compress_checkpoint

    tensors = model_tensors(weights)
    src = workdir / f"{weights}.bf16.safetensors"
    write_model_file(tensors, src)
    source = src.read_bytes()
    inputs = {"zipnn": workdir / f"{weights}.zipnn.safetensors"}
    zipnn_file(tensors, inputs["zipnn"])
    for mode in ("unweight", "rans"):
        inputs[f"ours_{mode}"] = workdir / f"{weights}.{mode}.safetensors"
        compress_checkpoint(str(src), inputs[f"ours_{mode}"], mode=mode, encoder=encode_to_reference)
    if lmzip:
        import lmz

        inputs["lmzip"] = workdir / f"{weights}.lmz"
        lmz.compress(str(src), str(inputs["lmzip"]), workers=1)
    out = workdir / f"{weights}.out.safetensors"
    cmds = {name: [sys.executable, "-m", "fast.codec", "decompress", str(path), str(out)]
            for name, path in inputs.items() if name.startswith("ours")}
    cmds["zipnn"] = [sys.executable, "-c", ZIPNN_DECOMPRESS, str(inputs["zipnn"]), str(out)]
    if lmzip:
        cmds["lmzip"] = [sys.executable, "-c", LMZIP_DECOMPRESS, str(inputs["lmzip"]), str(out)]
    cmds["python_start"] = [sys.executable, "-c", "pass"]
    runs: dict[str, list[float]] = {name: [] for name in cmds}
    for r in range(repeat + 1):  # run 0 warms the page cache and builds the C decoders: checked, not timed
        names = list(cmds)
        for name in names[r % len(names):] + names[:r % len(names)]:
            out.unlink(missing_ok=True)
            seconds = timed(cmds[name], env)
            if (name.startswith("ours") or name == "lmzip") and out.read_bytes() != source:
                raise AssertionError(f"{name}: the decompressed file differs from the input")
            if name == "zipnn" and not same_tensors(out, tensors):
                raise AssertionError("zipnn: the decompressed tensors differ from the input")
            if r:
                runs[name].append(seconds)
    out.unlink(missing_ok=True)
    row: dict[str, Any] = {"weights": weights, "tensors": len(tensors), "file_bytes": len(source),
                           "compressed_bytes": {n: p.stat().st_size for n, p in inputs.items()}, "commands": {}}
    for name, times in runs.items():
        row["commands"][name] = {"runs_s": times, "median_s": float(np.median(times)), "best_s": min(times)}
        if name.startswith("ours"):
            row["commands"][name]["zipnn_over_ours_median"] = float(np.median(
                [z / o for z, o in zip(runs["zipnn"], times, strict=True)]))
            row["commands"][name]["zipnn_over_ours_best"] = min(runs["zipnn"]) / min(times)
            if "lmzip" in runs:
                row["commands"][name]["lmzip_over_ours_median"] = float(np.median(
                    [z / o for z, o in zip(runs["lmzip"], times, strict=True)]))
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = arguments(argv, "python -m experiments.unweight.bench_codec_cli", __doc__, 5, DEFAULT_JSON)
    from fast.cpu_isa import describe_cpu
    from reference.provenance import commit, machine

    cores = pin_one_core()  # the child processes inherit the one core
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result: dict[str, Any] = {
        "machine": machine(), "cpu": describe_cpu(), "commit": commit(), "cores": cores, "repeat": args.repeat,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"zipnn": package_version("zipnn"), "lmzip": package_version("lmzip"),
                     "safetensors": package_version("safetensors"), "torch": package_version("torch")},
        "what": "whole processes, one core, one thread: start, imports, read, decode, write (ours with fsync), exit",
        "models": []}
    lmzip = importlib.util.find_spec("lmz") is not None
    if not lmzip:
        print(f"lmzip is not installed: skipped ({PEERS_EXTRA})")
    with tempfile.TemporaryDirectory(prefix="bench_codec_cli.") as tmp:
        for weights in args.weights:
            row = measure_model(weights, args.repeat, Path(tmp), env, lmzip)
            result["models"].append(row)
            c = row["commands"]
            print(f"{weights}: {row['file_bytes'] / 1e6:.1f} MB of bf16 out; whole process, one core, median of "
                  f"{args.repeat} (bare python start {c['python_start']['median_s']:.2f} s)")
            z = c["zipnn"]
            print(f"  {'zipnn decompress + save_file':36s} {z['median_s']:.2f} s (best {z['best_s']:.2f})")
            if "lmzip" in c:
                print(f"  {'lmz.decompress':36s} {c['lmzip']['median_s']:.2f} s (best {c['lmzip']['best_s']:.2f})")
            for name in (n for n in c if n.startswith("ours")):
                versus = f", {c[name]['lmzip_over_ours_median']:.2f}x lmzip's" if "lmzip" in c else ""
                print(f"  {name:36s} {c[name]['median_s']:.2f} s (best {c[name]['best_s']:.2f}) = "
                      f"{c[name]['zipnn_over_ours_median']:.2f}x ZipNN's speed (best times "
                      f"{c[name]['zipnn_over_ours_best']:.2f}x){versus}")
    return store(result, load_before, args.json)


if __name__ == "__main__":
    main()
