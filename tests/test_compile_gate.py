"""The compile gate (conformance/compile_gate.py): every kernel compiles for sm_90 with the real Triton
compiler and ptxas, no GPU; and it fails readably when a kernel would not compile or would spill.

Compiling needs TRITON_INTERPRET=0 in a fresh process (this pytest process has the interpreter on),
so each test runs ``python -m conformance --compile ...`` or a small script in a child process,
with the real CLI. The mutations copy a kernel module with one textual change into a temporary
package that shadows ``fast`` (the same idea as tests/test_conformance_mutation.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _env(tmp_path: Path, extra_path: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", OMP_NUM_THREADS="1",
               XDG_CACHE_HOME=str(tmp_path / "cache"), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path) if extra_path else "", str(REPO)) if p)
    return env


def _gate(tmp_path: Path, *args: str, extra_path: Path | None = None) -> tuple[int, str, dict]:
    """Run the gate's CLI; with ``extra_path`` (a mutant fast/) from there, so that its fast/ is imported."""
    out = tmp_path / "gate.json"
    proc = subprocess.run([sys.executable, "-m", "conformance", "--compile", "sm_90", "--json", str(out), *args],
                          cwd=extra_path or REPO, env=_env(tmp_path, extra_path), capture_output=True, text=True,
                          timeout=900)
    doc = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, proc.stdout + proc.stderr, doc


def _mutant_tree(tmp_path: Path, rel: str, old: str, new: str) -> Path:
    """A copy of fast/ with one change in ``rel`` (a path under fast/); returns the folder to put first on
    PYTHONPATH."""
    root = tmp_path / "mutant"
    shutil.copytree(REPO / "fast", root / "fast", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    path = root / "fast" / rel
    source = path.read_text()
    assert source.count(old) == 1, f"the mutation target {old!r} must occur once in fast/{rel}"
    path.write_text(source.replace(old, new))
    return root


def _launches_file(tmp_path: Path, *kernels: str, extra_path: Path | None = None) -> Path:
    """A launches file holding the real-shape launches of the named kernels only (fast: few compiles), as
    the launchers (of the mutant fast/ in ``extra_path``, if given) plan them."""
    script = ("import sys; from conformance import real_shapes, launches; "
              "ks = sys.argv[2:]; "
              "launches.save(__import__('pathlib').Path(sys.argv[1]), "
              "[x for x in real_shapes.subset_launches() if x.kernel.split(':')[1] in ks])")
    path = tmp_path / "launches.json"
    subprocess.run([sys.executable, "-c", script, str(path), *kernels], cwd=extra_path or REPO,
                   env=_env(tmp_path, extra_path), check=True, timeout=300)
    return path


@pytest.mark.slow  # the README's test command runs the gate itself; ~1 min on a loaded 2-core machine
def test_every_subset_launch_compiles_for_sm_90(tmp_path):
    """The representative real-shape launches (every kernel at least once) compile, with no spills."""
    code, out, doc = _gate(tmp_path, "--no-cases")
    assert code == 0, out[-4000:]
    kernels = {r["kernel"].split(":")[1] for r in doc["results"]}
    assert {"_matmul_kernel", "_reduce_kernel", "_palette_decode_kernel", "_huffman_kernel", "_verbatim_kernel",
            "_round_kernel", "_decode_kernel", "_combine_kernel", "_prefill_kernel", "_copy_kernel",
            "_row_exponent_kernel", "_rescale_kernel", "_encode_kernel", "_encode_elementwise_kernel"} <= kernels
    for r in doc["results"]:
        assert r["status"] == "ok" and r["registers"] and r["spill_bytes"] == 0, r
    big = [r for r in doc["results"] if r["kernel"].endswith("_matmul_kernel") and "b256" in r["origin"]]
    assert big and all(r["wgmma"] for r in big)  # batch 256 reaches Hopper's tensor-core instructions
    assert "compiled cleanly, 0 failed" in out


@pytest.mark.slow
def test_recorded_conformance_launches_compile(tmp_path):
    """Launches recorded while conformance cases run under the interpreter compile too."""
    rec = tmp_path / "rec.json"
    env = dict(_env(tmp_path), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "conformance", "--device", "cpu", "-k", "bf16.round_rne",
                           "-k", "kv.decode_attention.fp8.triton", "--record-launches", str(rec)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(rec.read_text())
    assert {d["kernel"] for d in doc["launches"]} >= {"fast.bf16:_round_kernel",
                                                      "fast.kv.attention_triton:_decode_kernel"}
    assert all(d["origin"] for d in doc["launches"])
    solo = tmp_path / "solo"
    solo.mkdir()
    code, out, gate = _gate(solo, "--launches", str(rec), "--no-cache", "--no-shapes")
    assert code == 0, out[-4000:]
    assert any(r["origin"] == "bf16.round_rne.special" or "bf16.round_rne" in r["origin"] for r in gate["results"])


def test_helper_without_jit_fails_with_file_and_line(tmp_path):
    """The defect main had: a helper a kernel calls lost its @triton.jit (the interpreter accepts it)."""
    root = _mutant_tree(tmp_path, "bf16.py", "@triton.jit\ndef bf16_bits_rne(x):", "def bf16_bits_rne(x):")
    code, out, doc = _gate(tmp_path, "--launches", str(_launches_file(tmp_path, "_round_kernel")),
                           "--no-cache", "--no-shapes", extra_path=root)
    assert code == 1, out[-3000:]
    errors = [r for r in doc["results"] if r["status"] == "error"]
    assert errors and all("bf16_bits_rne" in r["detail"] for r in errors), errors
    assert any("fast/bf16.py:" in r["detail"] for r in errors), errors[0]["detail"]
    assert "error: fast.bf16:_round_kernel" in out


def test_interpreter_only_construct_fails(tmp_path):
    """A kernel using what only the interpreter runs (``break`` in a loop: the interpreter executes the
    kernel as Python, the compiler has no such statement) fails to compile, with the kernel's line."""
    root = _mutant_tree(tmp_path, "kv/attention_triton.py", "    for i in range(NUM_SPLITS):\n        w = ",
                        "    for i in range(NUM_SPLITS):\n        if i > 64:\n            break\n        w = ")
    code, out, doc = _gate(tmp_path, "--launches", str(_launches_file(tmp_path, "_combine_kernel")), "--no-cache",
                           "--no-shapes", extra_path=root)
    assert code == 1, out[-3000:]
    errors = [r for r in doc["results"] if r["status"] == "error"]
    assert errors and any("attention_triton.py:" in r["detail"] for r in errors), [r["detail"] for r in errors]


def test_tile_change_that_spills_fails_the_gate(tmp_path):
    """Prefill attention back at 4 warps (its default before the gate existed) spills: the gate says so."""
    root = _mutant_tree(tmp_path, "kv/attention_triton.py",
                        "return 8 if block_m * next_pow2(head_dim) >= 2048 else 4",
                        "return 4")
    launches = _launches_file(tmp_path, "_prefill_kernel", extra_path=root)
    code, out, doc = _gate(tmp_path, "--launches", str(launches), "--no-cache", "--no-shapes", extra_path=root)
    assert code == 1, out[-3000:]
    spills = [r for r in doc["results"] if r["status"] == "spills"]
    assert spills and all(r["spill_bytes"] > 0 and r["default"] for r in spills)
    assert "bytes of register spills per thread" in out and "in a default configuration" in out


def test_gate_refuses_the_interpreter(tmp_path):
    env = dict(_env(tmp_path), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "conformance", "--compile", "sm_90", "--no-cases"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unset TRITON_INTERPRET" in proc.stderr


def test_bad_launches_file_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"launches": [{"args": 3}]}')
    code, out, _ = _gate(tmp_path, "--launches", str(bad))
    assert code == 2 and "not a launches file" in out


@pytest.mark.parametrize("native", [False])
def test_torch_encoder_general_path_runs_without_the_interpreter(tmp_path, native):
    """The general torch encoder path on CPU tensors with TRITON_INTERPRET=0: no @triton.jit function is
    called from host code (it raised on a GPU), and the bytes equal the reference encoder's."""
    script = f"""
import numpy as np, torch
import fast.codec.encode as enc
import reference.codec as rc
from fast.bf16 import from_numpy_bits, split_sm_exponent
from fast.codec.convert import huffman_arrays
assert type(split_sm_exponent).__name__ == "function"
rng = np.random.default_rng(0)
bits = (rng.standard_normal(7 * 60).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).reshape(7, 60)
params = dict(chunk_size=6, chunks_per_group=3)  # chunks not a multiple of 4: the general path
mine = huffman_arrays(enc.encode(from_numpy_bits(bits), **params, native={native}))
ref = huffman_arrays(rc.encode(bits, **params))
assert mine.keys() == ref.keys() and all(np.array_equal(mine[k], ref[k]) for k in ref)
print("same bytes")
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "same bytes" in proc.stdout, proc.stdout + proc.stderr


def _kinds(launch) -> tuple:
    return tuple(d[0] for d in launch.args)


@pytest.mark.slow
def test_real_shape_plans_match_the_launchers_argument_lists():
    """conformance/real_shapes.py writes each kernel's arguments by name: every kernel the conformance cases
    launch (recorded here, under the interpreter) has a plan, with the same kinds of argument in each
    position (tensor, int, float, constexpr), so a launcher that changes its kernel's arguments breaks this."""
    import torch

    from conformance.launches import record_launches
    from conformance.real_shapes import all_launches
    from conformance.registry import load_cases
    from conformance.run_cases import run_cases, select
    from fast.triton_util import H100

    names = ["bf16.round_rne.special", "codec.palette_decode.random", "codec.huffman_decode.odd_1d",
             "matmul.fused_vs_plain.synthetic_96x320.b5.split3", "kv.decode_attention.split_kv.fp8.triton",
             "kv.prefill_attention.bf16_query.fp8.triton", "kv.fp8_write.triton", "kv.write.bfloat16.triton",
             "kv.fp8_encode.bit_classes"]
    cases = select(load_cases(), names, False)
    with record_launches() as rec:
        results = run_cases(cases, torch.device("cpu"), False, on_start=lambda c: setattr(rec, "origin", c.name))
    assert all(not r.failed for r in results), [r.detail for r in results if r.failed]
    planned: dict[str, set] = {}
    for x in all_launches([H100]):
        planned.setdefault(x.kernel, set()).add(_kinds(x))
    recorded = rec.all()
    assert len({x.kernel for x in recorded}) == 14  # every kernel of fast/
    for x in recorded:
        assert x.kernel in planned, f"{x.kernel} (launched by {x.origin}) has no real-shape plan"
        assert _kinds(x) in planned[x.kernel], f"{x.kernel}: recorded {_kinds(x)}, planned {planned[x.kernel]}"


def test_make_launch_rejects_unknown_and_missing_arguments():
    import triton.language as tl

    from conformance.launches import make_launch

    def kernel(x_ptr, n, BLOCK: tl.constexpr):  # a kernel's parameters, as make_launch reads them
        pass

    with pytest.raises(TypeError, match="no value for parameter n"):
        make_launch(kernel, (), {"x_ptr": None, "BLOCK": 4})
    with pytest.raises(TypeError, match="no parameter named"):
        make_launch(kernel, (), {"x_ptr": None, "n": 3, "BLOCK": 4, "BLOK": 8})
    launch = make_launch(kernel, (None, 3), {"BLOCK": 4, "num_warps": 8})
    assert launch.args == (("none",), ("int", 3), ("const", 4)) and launch.num_warps == 8
