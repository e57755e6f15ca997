"""The import arrows of the layout: reference/ stands alone, fast/ builds on it, conformance/ and
experiments/ sit on top and do not import each other (what both need lives below them)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# package -> top-level modules it must never import
FORBIDDEN = {
    "reference": {"fast", "serve", "conformance", "experiments", "torch", "triton"},
    "fast": {"conformance", "experiments"},
    "conformance": {"experiments"},
    "experiments": {"conformance"},
}


def imported_tops(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (at any depth, lazy imports included)."""
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_runs_against_the_arrows(package: str) -> None:
    bad = [f"{p.relative_to(REPO)} imports {sorted(imported_tops(p) & FORBIDDEN[package])}"
           for p in sorted((REPO / package).rglob("*.py")) if imported_tops(p) & FORBIDDEN[package]]
    assert not bad, "\n".join(bad)


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from experiments.registry import Result\n    import torch.nn\n")
    assert imported_tops(f) == {"experiments", "torch"}


PACKAGES = ("reference", "fast", "conformance", "experiments", "serve")


def module_file(name: str) -> Path | None:
    """The file of module ``name`` in this tree (a package's ``__init__.py``), or None if it is not ours."""
    base = REPO.joinpath(*name.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def imported_files(path: Path) -> set[Path]:
    """The files of this tree that ``path`` imports (at any depth, lazy imports included): ``import a.b`` and
    ``from a.b import c`` name a.b, or a.b.c where c is a module of its own."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = node.module
            if node.level:  # relative: from the package that holds ``path``
                parts = path.relative_to(REPO).parent.parts
                module = ".".join(parts[:len(parts) - node.level + 1] + (node.module,))
            for alias in node.names:
                names.add(f"{module}.{alias.name}" if module_file(f"{module}.{alias.name}") else module)
    return {f for f in map(module_file, names) if f is not None and f != path}


def import_circles(files: list[Path]) -> list[list[Path]]:
    """Every set of files that import each other in a loop (the strongly connected components, Tarjan)."""
    graph = {f: imported_files(f) for f in files}
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    circles = []

    def visit(f: Path) -> None:
        index[f] = low[f] = len(index)
        stack.append(f)
        for g in graph.get(f, ()):
            if g not in index:
                visit(g)
                low[f] = min(low[f], low[g])
            elif g in stack:
                low[f] = min(low[f], index[g])
        if low[f] == index[f]:
            part = []
            while True:
                g = stack.pop()
                part.append(g)
                if g == f:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for f in files:
        if f not in index:
            visit(f)
    return circles


def test_no_import_circles() -> None:
    """No two files of the tree import each other, directly or around a loop (lazy imports count too)."""
    files = sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))
    circles = import_circles(files)
    assert not circles, "\n".join(" <-> ".join(str(p.relative_to(REPO)) for p in c) for c in circles)


def test_the_circle_check_sees_a_lazy_circle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from pkg import a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert import_circles(sorted(pkg.glob("*.py"))) == [[pkg / "a.py", pkg / "b.py"]]
