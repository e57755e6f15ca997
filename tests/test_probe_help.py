"""Every option of the user-facing command lines has a help text, and every usage line names the module
as users run it (``python -m serve``, not ``__main__.py``). Checked on the source, so it costs nothing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLIS = ["serve/__main__.py", "serve/engines.py", "serve/keys.py", "serve/pipeline.py", "serve/disagg.py",
        "serve/disagg_dist.py", "reference/disagg/__main__.py", "reference/cluster/__main__.py",
        *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "experiments").glob("bench_*.py")),
        "experiments/gpu_check.py"]


def calls(path: Path, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", getattr(n.func, "id", None)) == name]


@pytest.mark.parametrize("cli", CLIS)
def test_every_option_has_help_and_the_usage_names_the_module(cli: str) -> None:
    path = ROOT / cli
    bare = [f"line {c.lineno}: {ast.unparse(c)[:80]}" for c in calls(path, "add_argument")
            if not any(k.arg == "help" for k in c.keywords)]
    assert not bare, f"{cli}: options without help:\n" + "\n".join(bare)
    for parser in calls(path, "ArgumentParser"):
        prog = next((k.value for k in parser.keywords if k.arg == "prog"), None)
        assert isinstance(prog, ast.Constant) and "-m " in prog.value, f"{cli} line {parser.lineno}: no prog"
