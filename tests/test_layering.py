"""The import arrows of the layout: reference/ stands alone, fast/ builds on it, conformance/ and
experiments/ sit on top and do not import each other (what both need lives below them)."""

from __future__ import annotations

import ast
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
