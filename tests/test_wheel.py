"""The wheel carries every native source, and every native library builds from an installed copy.

A C file missing from ``pyproject.toml``'s package-data does not fail an install: its loader's ``library()``
returns None and the caller quietly takes its torch or NumPy fallback (the same bytes, slower). So this test
builds the wheel from the working tree's files (``pip wheel --no-deps --no-build-isolation``: no network),
installs it with ``pip install --no-deps --target``, and in a fresh process whose only copy of the packages is
the installed one (``PYTHONPATH``, a working directory outside the repository, ``module.__file__`` checked) and
whose build cache is empty (``UNFIRE_CACHE``), calls the ``library()`` of every module of ``fast/`` that loads
one through ``build_c.load``: none may be None, each must be built from the installed source, and every C file
the wheel ships must be some loader's source.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("reference", "fast", "conformance", "experiments", "serve")

# run in the installed copy: every loader of fast/, its library, the module's file and the source it builds
PROBE = textwrap.dedent("""
    import importlib, json, os, sys, warnings
    from pathlib import Path

    warnings.simplefilter("error", RuntimeWarning)  # a failed build warns: make it an error here
    import fast
    root = Path(fast.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        if "build_c.load(" not in path.read_text() or path.name == "build_c.py":
            continue
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        module = importlib.import_module(name)
        lib = module.library()
        found[name] = {"file": module.__file__, "source": str(module.SOURCE), "built": lib is not None,
                       "so": getattr(lib, "_name", None)}
    shipped = sorted(str(p.relative_to(root.parent)) for p in root.rglob("*.c"))
    print(json.dumps({"loaders": found, "shipped": shipped, "cache": sorted(os.listdir(os.environ["UNFIRE_CACHE"]))}))
""")


def _working_tree_files() -> list[str]:
    """The files a build of the working tree sees: tracked and untracked but not ignored, in the packages."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *PACKAGES],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if (REPO / f).is_file()]


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the working tree, installed into a folder of its own; returns that folder."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: the native libraries cannot be built anywhere")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for rel in ["pyproject.toml", "README.md", *_working_tree_files()]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    _run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
          "-w", str(tmp / "dist")], cwd=tmp)
    wheels = list((tmp / "dist").glob("unfire-*.whl"))
    assert len(wheels) == 1, wheels
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp / "site"), str(wheels[0])],
         cwd=tmp)
    return tmp / "site"


@pytest.mark.slow  # ~35 s on 2 shared cores: the wheel, and seven C files compiled at -O3
def test_every_native_library_builds_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNFIRE_", "PYTHON", "TRITON_"))}
    env |= {"PYTHONPATH": str(installed), "UNFIRE_CACHE": str(cache), "PYTHONNOUSERSITE": "1"}
    done = _run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    loaders = report["loaders"]
    # the loaders this repository has (a lost one would shrink the check): the codec's, the attention's, the
    # fused ops', the lesson's
    assert {"fast.codec.matmul_c", "fast.codec.decode_c", "fast.codec.decode_rans_c", "fast.codec.encode_c",
            "fast.kv.attention_c", "fast.engine.fused_c", "fast.lesson.row_scale_c"} <= set(loaders)
    for name, got in loaders.items():
        assert got["file"].startswith(str(installed)), f"{name} was imported from {got['file']}, not the wheel"
        assert got["source"].startswith(str(installed)) and Path(got["source"]).is_file(), got
        assert got["built"], f"{name}.library() is None in the installed wheel: a silent fallback"
        assert got["so"] and got["so"].startswith(str(cache)), f"{name} loaded {got['so']}, not a fresh build"
    sources = {str(Path(got["source"]).relative_to(installed)) for got in loaders.values()}
    assert set(report["shipped"]) == sources, "a C file the wheel ships has no loader, or a loader's is missing"
    in_repo = {str(p.relative_to(REPO)) for p in (REPO / "fast").rglob("*.c")}
    assert in_repo <= set(report["shipped"]), f"not in the wheel: {sorted(in_repo - set(report['shipped']))}"
    assert len([f for f in report["cache"] if f.endswith(".so")]) == len(loaders)
