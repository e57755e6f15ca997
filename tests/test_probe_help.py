"""Every option of the user-facing command lines has a help text, and every usage line names the module
as users run it (``python -m serve``, not ``__main__.py``). Checked on the source, so it costs nothing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("reference", "fast", "serve", "conformance", "experiments")
# every module a user (or a door) runs with ``python -m``, and the files that add option groups to a door
MAINS = sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
               if '__name__ == "__main__"' in p.read_text())
# modules whose --help is another parser's: the reference codec's (prog python -m fast.codec), vLLM's own
# their parsers are built elsewhere (bench_codec_cli: bench_codec_peers.arguments)
DELEGATES = {"fast/codec/__main__.py", "experiments/engine/vllm_cli.py", "experiments/unweight/bench_codec_cli.py"}
CLIS = sorted({*MAINS, "serve/engines.py", "serve/keys.py", "serve/pipeline.py", "serve/disagg.py",
               "serve/disagg_dist.py"})


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
        if isinstance(prog, ast.Name):  # handed in by the caller (a shared parser): its default names the module
            prog = next((d for d in ast.walk(ast.parse(path.read_text())) if isinstance(d, ast.Constant)
                         and isinstance(d.value, str) and d.value.startswith("python -m ")), None)
        assert isinstance(prog, ast.Constant) and "-m " in prog.value, f"{cli} line {parser.lineno}: no prog"


@pytest.mark.parametrize("cli", MAINS)
def test_every_command_says_what_it_does(cli: str) -> None:
    """Each ``python -m`` module builds its parser with a description (the first line of ``--help``)."""
    if cli in DELEGATES:
        return
    parsers = calls(ROOT / cli, "ArgumentParser")
    assert parsers, f"{cli}: no argparse parser, so no --help"
    for parser in parsers:
        assert any(k.arg == "description" for k in parser.keywords), f"{cli} line {parser.lineno}: no description"
