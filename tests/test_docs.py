"""The guides tell the truth: what they name exists, what they run parses, what they quote is generated.

Every ``*.md`` guide (not ``experiments/results/``, not CHANGELOG.md) is read whole, code blocks and backticks
included:

- every repository path (``fast/codec/native/*.c``, ``reference/model/llama.py``, a bare ``scenario.py`` beside
  the guide) and every dotted module name (``fast.codec.matmul``, ``reference.codec.huffman.decode_table``)
  exists;
- every ``--option`` written after a ``python -m X`` command on the same line exists in X's argparse parser
  (the parser is taken from X's ``main`` as it calls ``parse_args``, without running anything else);
- every default a guide states for an option ("``--shutdown-grace`` seconds (default 10)", a table cell)
  is the parser's default, and the small table ``STATED_DEFAULTS`` pins the ones that must be found;
- no guide holds a commit hash of this repository, a load average or a calendar date (those belong to the
  result files, their notes and CHANGELOG.md), and none is 300 lines or longer;
- the numbers the paper generates are quoted only through generated blocks (the README's table) or links,
  never retyped: a guide sentence naming claim E10 or U4 next to a ratio or GB/s figure is reported.
- every result figure (``experiments/results/*.png``) is embedded (``![caption](path.png)``) in some guide or
  in CHANGELOG.md, and every figure a guide or CHANGELOG.md embeds (the paper's included) exists.

Each check is a function that returns what it found wrong, and each is tested on a planted error in a
temporary copy of a guide.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import io
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("reference", "fast", "serve", "conformance", "experiments", "tests", "paper")
SKIP_PARTS = {".venv", "build", "node_modules", ".git", "runs"}


def guides(root: Path = REPO) -> list[Path]:
    """Every guide: the *.md files of the repository but the result notes and the CHANGELOG."""
    out = []
    for p in sorted(root.rglob("*.md")):
        rel = p.relative_to(root)
        if SKIP_PARTS & set(rel.parts) or any(part.endswith(".egg-info") or part.startswith(".")
                                              for part in rel.parts):
            continue
        if rel.parts[:2] == ("experiments", "results") or rel.name == "CHANGELOG.md":
            continue
        out.append(p)
    return out


# ---------------------------------------------------------------------------------------------------- paths

# Names that look like repository paths but are not meant to be files here, each with its reason.
ALLOWED_NAMES = {
    "config.json": "a file of a Hugging Face checkpoint folder the user gives",
    "tokenizer.json": "a file of a Hugging Face checkpoint folder the user gives",
    "tokenizer_config.json": "a file of a Hugging Face checkpoint folder the user gives",
    "keys.toml": "the user's API keys file, shown in an example command",
    "run.json": "the output file of an example serve.bench command",
    "trace.jsonl": "the output file of an example fleet command",
    "minilm.uw": "the output file of an example compress command",
    "smollm2.unweight.safetensors": "a container an example command writes",
}
# a path is anything under a top-level package, or a bare file name with a source/guide extension
_TOPS = "|".join(PACKAGES)
_PATH = re.compile(rf"(?<![\w/.~<$-])((?:{_TOPS})/[\w./*{{}},<>-]*)")
_BARE = re.compile(r"^[\w*-]+\.(?:py|c|h|md|toml)$")
_MODULE = re.compile(r"(?<![\w./-])((?:{})(?:\.\w+)+)".format("|".join(p for p in PACKAGES if p != "paper")))


def _expand(name: str) -> list[str]:
    """``a/{b,c}.json`` -> ``a/b.json``, ``a/c.json``."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand(name[:m.start()] + alt + name[m.end():])]


def _exists(base: Path, name: str) -> bool:
    if any(ch in name for ch in "*?["):
        return any(base.glob(name))
    return (base / name).exists()


def _path_exists(doc: Path, name: str, root: Path) -> bool:
    """A path resolves from the guide's folder, one of its parents up to the root, or (a bare name) anywhere
    under the guide's folder."""
    name = name.rstrip("/") or "."
    bases = [doc.parent, *[p for p in doc.parent.parents if root in (p, *p.parents)]]
    if any(_exists(b, name) for b in bases):
        return True
    return "/" not in name and any(doc.parent.rglob(name))


def _module_exists(dotted: str, root: Path) -> bool:
    """``a.b.c`` names a module file or package under the root, or an attribute defined in the longest module
    prefix that exists (``fast.engine.Engine.load``: ``Engine`` is defined or imported in fast/engine)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:n])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if not source.is_file():
            continue
        if n == len(parts):
            return True
        attr = parts[n]
        text = source.read_text()
        if re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{attr}\b|^\s*{attr}\s*[:=]|\bimport\b.*\b{attr}\b"
                     rf"|^\s+{attr},?\s*(?:#.*)?$|[\"']{attr}[\"']\s*:", text, re.M):
            return True
        return (base / f"{attr}.py").is_file() or (base / attr).is_dir()
    return False


def missing_names(doc: Path, text: str | None = None, root: Path = REPO) -> list[str]:
    """The paths and modules a guide names that do not exist."""
    text = doc.read_text() if text is None else text
    bad: list[str] = []
    for raw in _PATH.findall(text):
        raw = raw.rstrip(".,;:)")
        if "<" in raw or raw.startswith("runs/"):  # runs/<date>-<commit>/: a placeholder, not a path
            continue
        for name in _expand(raw):
            if not _path_exists(doc, name, root):
                bad.append(name)
    for span in re.findall(r"`([^`\n]+)`", text):
        span = span.strip()
        linked = f"[`{span}`](" in text  # a link's text: the link test checks its target
        if _BARE.match(span) and span not in ALLOWED_NAMES and not linked and not _path_exists(doc, span, root):
            bad.append(span)
    for dotted in _MODULE.findall(text):
        dotted = dotted.rstrip(".")
        if re.search(r"\.(py|c|h|md|toml|json|png)$", dotted):
            continue
        if not _module_exists(dotted, root):
            bad.append(dotted)
    return sorted(set(bad))


# ---------------------------------------------------------------------------------------------------- options


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@contextlib.contextmanager
def _capturing() -> Iterator[None]:
    def grab(self: argparse.ArgumentParser, *a: object, **k: object) -> None:
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = grab  # type: ignore[method-assign,assignment]
    argparse.ArgumentParser.parse_known_args = grab  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved


@functools.cache
def parser_of(module: str, command: str = "") -> argparse.ArgumentParser:
    """The parser ``python -m module [command]`` reads its options with: ``main`` is called and stopped at its
    first ``parse_args``. ``command``: a word after the module (``serve fleet``, ``reference.codec compress``)."""
    mod = importlib.import_module(module)
    if not hasattr(mod, "main") and importlib.util.find_spec(f"{module}.__main__"):
        mod = importlib.import_module(f"{module}.__main__")
    argv = [command] if command else []
    saved_argv = sys.argv
    sys.argv = [module, *argv]
    try:
        with _capturing(), contextlib.redirect_stdout(io.StringIO()):
            try:
                if inspect.signature(mod.main).parameters:
                    mod.main(argv)
                else:
                    mod.main()
            except _Captured as got:
                parser = got.parser
            else:
                raise AssertionError(f"python -m {module}: main() returned without parsing arguments")
    finally:
        sys.argv = saved_argv
    if command:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                return action.choices[command]
    return parser


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of the parser, its subcommands' included."""
    out = {"--help"}
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= options_of(sub)
    return out


def _command_lines(text: str) -> Iterator[tuple[str, str, str]]:
    """(module, first word after it, the rest of its command) for every ``python -m X`` in a guide. A command
    ends at the next command on its line, at a comment, a table cell's end, or its backtick span's end; a line
    ending in a backslash goes on on the next."""
    text = re.sub(r"\\\n\s*", " ", text)
    for line in text.splitlines():
        starts = [m for m in re.finditer(r"python -m ([\w.]+)", line)]
        for i, m in enumerate(starts):
            module = m.group(1).rstrip(".")
            if module.split(".")[0] not in PACKAGES:  # pytest, pip, venv: not ours
                continue
            rest = line[m.end():starts[i + 1].start() if i + 1 < len(starts) else len(line)]
            if line[:m.start()].count("`") % 2:  # inside a backtick span: it ends at the span's end
                rest = rest.split("`")[0]
            rest = re.split(r"\s#|\||torchrun |vllm |&&", rest)[0]
            word = re.match(r"\s+([a-z][\w-]*)\b(?![.:/])", rest)
            yield module, word.group(1) if word else "", rest


def unknown_options(doc: Path, text: str | None = None) -> list[str]:
    """``python -m X ... --opt`` where X's parser has no ``--opt``."""
    text = doc.read_text() if text is None else text
    bad = []
    for module, word, rest in _command_lines(text):
        parser = parser_of(module)
        command = word if word and any(isinstance(a, argparse._SubParsersAction) and word in a.choices
                                       for a in parser._actions) else ""
        if not command and word == "fleet" and module == "serve":
            command = "fleet"
        known = options_of(parser_of(module, command) if command else parser)
        if command:
            known |= options_of(parser)
        for opt in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
            if opt not in known:
                bad.append(f"python -m {module}{' ' + command if command else ''} {opt}")
    return sorted(set(bad))


# ---------------------------------------------------------------------------------------------------- defaults

# which command a guide's options belong to, when it states their defaults
GUIDE_COMMAND = {
    "serve/README.md": ("serve", ""),
    "serve/fleet/README.md": ("serve", "fleet"),
    "reference/disagg/README.md": ("serve", ""),
    "reference/disagg/PROTOCOL.md": ("serve", ""),
    "fast/pipeline/README.md": ("serve", ""),
    "experiments/README.md": ("experiments", "reproduce"),
    "reference/cluster/README.md": ("reference.cluster", "simulate"),
}
# (guide, option, value): defaults the guides state that the checker must find (and which must be the code's)
STATED_DEFAULTS = [
    ("serve/README.md", "--pipeline-restarts", "2"),
    ("serve/README.md", "--shutdown-grace", "10"),
    ("serve/README.md", "--body-timeout", "60"),
    ("serve/README.md", "--engine", "auto"),
    ("reference/disagg/README.md", "--worker-lease", "15"),
    ("reference/disagg/README.md", "--kv-carrier", "tcp"),
    ("serve/fleet/README.md", "--ray-prefill-labels", "disagg-role=prefill"),
]
_DEFAULT = re.compile(r"`(--[a-z][a-z0-9-]*)[^`]*`[^.;|]{0,60}?\(?\bdefault:?\s+(?:`([^`]+)`|(\d[\d.]*)\b|"
                      r"([a-z][\w=.:/-]*)(?=[),;]))")
_DEFAULT_AFTER = re.compile(r"`(--[a-z][a-z0-9-]*) ([\w.:/-]+)`\s*\(the default\)|`(--[a-z][a-z0-9-]*)`\s*\(the "
                            r"default\)")


def stated_defaults(text: str) -> list[tuple[str, str]]:
    """(option, value) for each "``--opt``, default V" / "``--opt ...`` (default V)" / "``--opt V`` (the
    default)" a guide writes."""
    out = [(m.group(1), (m.group(2) or m.group(3) or m.group(4)).rstrip(".,")) for m in _DEFAULT.finditer(text)]
    out += [(m.group(1), m.group(2)) for m in _DEFAULT_AFTER.finditer(text) if m.group(1)]
    return out


def _same(stated: str, default: object) -> bool:
    if isinstance(default, bool) or default is None:
        return False
    if isinstance(default, (int, float)):
        try:
            return float(stated) == float(default)
        except ValueError:
            return False
    return stated == str(default)


def wrong_defaults(rel: str, text: str | None = None) -> list[str]:
    """Defaults the guide states that are not the parser's."""
    if rel not in GUIDE_COMMAND:
        return []
    text = (REPO / rel).read_text() if text is None else text
    module, command = GUIDE_COMMAND[rel]
    actions = {o: a for p in {parser_of(module), parser_of(module, command)} for a in p._actions
               for o in a.option_strings}
    bad = []
    for opt, value in stated_defaults(text):
        if opt in actions and not _same(value, actions[opt].default):
            bad.append(f"{opt}: the guide says default {value}, the parser has {actions[opt].default!r}")
    return sorted(set(bad))


# ---------------------------------------------------------------------------------------------------- diaries


@functools.cache
def _commits() -> frozenset[str]:
    out = subprocess.run(["git", "log", "--all", "--format=%H"], cwd=REPO, capture_output=True, text=True)
    return frozenset(out.stdout.split())


def diary_entries(text: str, commits: frozenset[str] | None = None) -> list[str]:
    """Commit hashes of this repository, load averages and calendar dates in a guide."""
    commits = _commits() if commits is None else commits
    bad = []
    for h in set(re.findall(r"(?<![\w/.-])([0-9a-f]{7,40})(?![\w/.-])", text)):
        if any(c.startswith(h) for c in commits):
            bad.append(f"commit {h}")
    bad += [f"load: {m}" for m in re.findall(r"[^.\n]{0,30}\bload(?: average)? (?:of )?~?\d[^.\n]{0,20}", text)]
    bad += [f"date {d}" for d in re.findall(r"\b20\d\d-[01]\d-[0-3]\d\b", text)]
    return bad


# claims whose figures the paper generates and guides have retyped: a paragraph naming one holds no figure
GENERATED_CLAIMS = ("E10", "U4")
_FIGURE = re.compile(r"\b\d+(?:\.\d+)?(?:x| GB/s)(?![\w])")


def retyped_numbers(text: str) -> list[str]:
    """Figures (a ratio, GB/s) in a paragraph that names E10 or U4, outside the README's generated block: a
    guide links paper/report.md or the result file for them instead."""
    text = re.sub(r"<!-- results:begin.*?<!-- results:end -->", "", text, flags=re.S)
    bad = []
    units = [u for para in re.split(r"\n\s*\n", text)
             for u in (para.splitlines() if para.lstrip().startswith(("|", "- ", "* ")) else [para])]
    for para in units:
        if re.search(r"\b(?:{})\b".format("|".join(GENERATED_CLAIMS)), para):
            bad += _FIGURE.findall(para)
    return bad


# Documents that are not read as guides start to end, so their length is not a guide's
LONG_ALLOWED = {
    "reference/codec/FORMAT.md": "the format's specification: sections are looked up, and splitting it would split "
                                 "one numbered spec",
    "paper/report.md": "generated from the result files, one section per claim",
}


# ---------------------------------------------------------------------------------------------------- tests

GUIDES = [str(p.relative_to(REPO)) for p in guides()]


def test_the_guides_are_found() -> None:
    assert {"README.md", "serve/README.md", "reference/codec/FORMAT.md", "paper/design.md"} <= set(GUIDES)
    assert not any(g.startswith("experiments/results/") or g == "CHANGELOG.md" for g in GUIDES)


@pytest.mark.parametrize("rel", GUIDES)
def test_every_named_path_and_module_exists(rel: str) -> None:
    assert not missing_names(REPO / rel), f"{rel} names what does not exist: {missing_names(REPO / rel)}"


@pytest.mark.parametrize("rel", GUIDES)
def test_every_option_of_a_command_exists(rel: str) -> None:
    bad = unknown_options(REPO / rel)
    assert not bad, f"{rel} shows options its commands do not have: {bad}"


@pytest.mark.parametrize("rel", sorted(GUIDE_COMMAND))
def test_stated_defaults_are_the_parsers(rel: str) -> None:
    bad = wrong_defaults(rel)
    assert not bad, f"{rel}: {bad}"


@pytest.mark.parametrize(("rel", "option", "value"), STATED_DEFAULTS)
def test_the_pinned_defaults_are_stated_and_true(rel: str, option: str, value: str) -> None:
    assert (option, value) in stated_defaults((REPO / rel).read_text()), f"{rel} no longer states {option} {value}"
    module, command = GUIDE_COMMAND[rel]
    actions = {o: a for p in {parser_of(module), parser_of(module, command)} for a in p._actions
               for o in a.option_strings}
    assert _same(value, actions[option].default)


@pytest.mark.parametrize("rel", GUIDES)
def test_no_diary_in_a_guide(rel: str) -> None:
    text = (REPO / rel).read_text()
    lines = len(text.splitlines())
    assert lines < 300 or rel in LONG_ALLOWED, f"{rel} is {lines} lines (a guide stays under 300)"
    if rel == "paper/report.md":  # the report: each number beside its commit and machine
        return
    assert not diary_entries(text), f"{rel}: move these to a result note or CHANGELOG.md: {diary_entries(text)}"


@pytest.mark.parametrize("rel", GUIDES)
def test_generated_numbers_are_not_retyped(rel: str) -> None:
    if rel == "paper/report.md":  # the generator's own output
        return
    assert not retyped_numbers((REPO / rel).read_text()), f"{rel}: {retyped_numbers((REPO / rel).read_text())}"


# ---------------------------------------------------------------------------------------------------- planted


def _plant(tmp_path: Path, rel: str, old: str, new: str) -> str:
    """A temporary copy of the guide ``rel`` with ``old`` replaced by ``new``: its text, which the checks read as
    if it stood at the guide's place."""
    text = (REPO / rel).read_text()
    assert old in text, f"{rel} lost the line the planted test edits: {old!r}"
    copy = tmp_path / Path(rel).name
    copy.write_text(text.replace(old, new, 1))
    return copy.read_text()


def test_a_planted_wrong_path_is_reported(tmp_path: Path) -> None:
    doc = REPO / "serve/README.md"
    text = _plant(tmp_path, "serve/README.md", "`reference/sched/scheduler.py`", "`reference/sched/schedular.py`")
    assert missing_names(doc, text) == ["reference/sched/schedular.py"]
    text += "\nSee `fast.codec.matmul_gone`, `fast/codec/native/*.cc` and `nowhere_here.py`.\n"
    assert missing_names(doc, text) == ["fast.codec.matmul_gone", "fast/codec/native/*.cc",
                                        "nowhere_here.py", "reference/sched/schedular.py"]


def test_a_planted_wrong_option_is_reported(tmp_path: Path) -> None:
    old = "python -m serve --model smollm2 --port 8000"
    planted = _plant(tmp_path, "serve/README.md", old, old.replace("--port", "--prot"))
    assert unknown_options(REPO / "serve/README.md", planted) == ["python -m serve --prot"]
    assert unknown_options(REPO / "x.md", "`python -m reference.codec compress a b --to-bf17`") == [
        "python -m reference.codec compress --to-bf17"]


def test_a_planted_wrong_default_is_reported(tmp_path: Path) -> None:
    old = "(`--pipeline-restarts`, default 2)"
    planted = _plant(tmp_path, "serve/README.md", old, old.replace("2", "3"))
    assert wrong_defaults("serve/README.md", planted) == [
        "--pipeline-restarts: the guide says default 3, the parser has 2"]


def test_a_planted_diary_entry_is_reported() -> None:
    head = sorted(_commits())[0]
    found = diary_entries(f"Measured at {head[:7]} on 2026-12-05, load average 0.7-1.2.\nA hash-like deadbeef0.")
    assert found[0] == f"commit {head[:7]}" and any(f.startswith("load") for f in found)
    assert found[-1] == "date 2026-12-05" and len(found) == 3


def test_a_retyped_generated_number_is_reported() -> None:
    found = retyped_numbers("E10 came out at 1.11x in the rerun,\nU4 at 12.6 GB/s.\n\nA 2x gain.")
    assert found == ["1.11x", "12.6 GB/s"]
    assert retyped_numbers("<!-- results:begin -->\n| E10 | 1.25x |\n<!-- results:end -->") == []


# ---------------------------------------------------------------------------------------------------- the paper


def paper_glitches(text: str) -> list[str]:
    """What the report generator must never write: an empty dict or set, "1 threads"/"1 cores", and a result
    that names a goal ("vs vLLM: goal met") its Goal line does not state."""
    bad = [f"empty braces: {line[:80]}" for line in text.splitlines() if "{}" in line]
    bad += [f"plural of one: {m}" for m in re.findall(r"\b1 (?:threads|cores)\b", text)]
    goal = ""
    for line in text.splitlines():
        if line.startswith("**Goal:**"):
            goal = line
        m = re.match(r"\*\*Result:\*\* vs ([\w.-]+)", line)
        if m and m.group(1).lower() not in goal.lower():
            bad.append(f"result against {m.group(1)}, goal: {goal[:80]}")
    return bad


def test_the_paper_has_no_generator_glitches(tmp_path: Path) -> None:
    """The generator's own output, built into a temporary file from the stored results, and the stored paper."""
    from experiments.registry import discover
    from experiments.report import build_paper

    out = build_paper(discover(), out=tmp_path / "report.md")
    assert not paper_glitches(out.read_text()), paper_glitches(out.read_text())
    stored = (REPO / "paper/report.md").read_text()
    assert not paper_glitches(stored), "paper/report.md is stale: run python -m experiments paper"


def test_paper_glitches_are_reported() -> None:
    from experiments.report import counted, engine_goal

    planted = "**Goal:** >= 2x transformers.  \n**Result:** vs vLLM: goal met.\n1 threads on X (1 cores); {} tok/s"
    assert len(paper_glitches(planted)) == 4
    assert counted(1, "core") == "1 core" and counted(2, "thread") == "2 threads"
    record = {"goal": ">= 2x transformers", "vs_vllm": {"goal": 1.2}}
    assert not paper_glitches(f"**Goal:** {engine_goal(record)}.\n**Result:** vs vLLM: goal met.")


# ---------------------------------------------------------------------------------------------------- package data


def uncovered_native_sources(pyproject: str, root: Path = REPO) -> list[str]:
    """The .c/.h files under fast/ that no package-data pattern of pyproject.toml ships in a wheel."""
    import tomllib

    data = tomllib.loads(pyproject)["tool"]["setuptools"]["package-data"]
    shipped = {f for package, patterns in data.items() for pattern in patterns
               for f in (root / package.replace(".", "/")).glob(pattern)}
    return sorted(str(p.relative_to(root)) for p in root.glob("fast/**/*.[ch]") if p not in shipped)


def test_every_native_source_is_package_data() -> None:
    """A wheel without a C file silently falls back to torch or NumPy: every .c/.h under fast/ is shipped."""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert not uncovered_native_sources(pyproject), uncovered_native_sources(pyproject)
    planted = pyproject.replace('"fast.engine" = ["native/*.c"]', '"fast.engine" = []')
    assert planted != pyproject and uncovered_native_sources(planted) == ["fast/engine/native/fused_ops.c"]


# ---------------------------------------------------------------------------------------------------- try it

# A "try it" is a ```pycon block right after a line <!-- try-it -->: a REPL session (>>> lines, the output
# expected below each) that the docs test runs with doctest, each block in a fresh namespace, from the root.
_TRY_IT = re.compile(r"^([ \t]*)<!-- try-it -->[ \t]*\n[ \t]*```pycon[ \t]*\n(.*?)^[ \t]*```", re.M | re.S)


def try_its(text: str) -> list[str]:
    """The sessions of every try-it block of a guide, dedented."""
    out = []
    for m in _TRY_IT.finditer(text):
        indent = len(m.group(1))
        out.append("".join(line[indent:] if line[:indent].isspace() else line
                           for line in m.group(2).splitlines(keepends=True)))
    return out


def run_try_it(session: str, name: str) -> str:
    """Run one try-it session with doctest; what failed ("" when every output was the expected one)."""
    import doctest

    test = doctest.DocTestParser().get_doctest(session, {}, name, None, 0)
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    runner.run(test, out=report.write)
    return report.getvalue() if runner.failures else ""


TRY_ITS = [(rel, i) for rel in GUIDES for i in range(len(try_its((REPO / rel).read_text())))]


@pytest.mark.parametrize(("rel", "index"), TRY_ITS)
def test_every_try_it_gives_the_output_it_shows(rel: str, index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    session = try_its((REPO / rel).read_text())[index]
    failed = run_try_it(session, f"{rel} try-it {index + 1}")
    assert not failed, failed


def tour_stops(text: str) -> list[str]:
    """The stops of the tour in reference/README.md: each numbered item of a "Tour" section, and each ###
    section after them (the handoff, the cluster), with the text up to the next stop."""
    start = text.index("## Tour 1")
    stops = re.split(r"^(?=\d+\. |### |## )", text[start:], flags=re.M)
    return [s for s in stops if re.match(r"\d+\. |### ", s)]


def test_every_stop_of_the_tour_has_a_try_it() -> None:
    stops = tour_stops((REPO / "reference/README.md").read_text())
    assert len(stops) >= 23  # 12 stops of tour 1, 9 of tour 2, the handoff, the cluster
    bare = [s.splitlines()[0][:60] for s in stops if "<!-- try-it -->" not in s]
    assert not bare, f"tour stops without a try-it: {bare}"
    text = (REPO / "reference/README.md").read_text()
    handoff = next(s for s in stops if s.startswith("### The prefill/decode handoff"))
    assert "DONE(first token, kv digest)" in handoff, "the handoff stop lost PROTOCOL.md's timeline"
    assert "<!-- try-it -->" in text.split("## Then the kernels")[1]


def test_a_planted_wrong_try_it_is_reported() -> None:
    good = "<!-- try-it -->\n```pycon\n>>> 1 + 1\n2\n```\n"
    assert try_its(good) == [">>> 1 + 1\n2\n"] and run_try_it(try_its(good)[0], "good") == ""
    assert "Expected:" in run_try_it(try_its(good.replace("\n2\n", "\n3\n"))[0], "planted")
    indented = "1. a stop\n   <!-- try-it -->\n   ```pycon\n   >>> [1]\n   [1]\n   ```\n"
    assert try_its(indented) == [">>> [1]\n[1]\n"]
    assert tour_stops("## Tour 1\n1. a\n<!-- try-it -->\n2. b\n### c\n") == ["1. a\n<!-- try-it -->\n", "2. b\n",
                                                                             "### c\n"]


# ---------------------------------------------------------------------------------------------------- figures

# an embedded figure: ![caption](path.png), the path relative to the document (a link to a .png is not an embed)
_EMBED = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")


def figure_documents(root: Path = REPO) -> list[Path]:
    """Where a result figure may be embedded: every guide, and CHANGELOG.md for the dated runs."""
    return [*guides(root), root / "CHANGELOG.md"]


def _embeds(doc: Path, text: str | None = None) -> list[str]:
    text = doc.read_text() if text is None else text
    return [t for t in _EMBED.findall(re.sub(r"```.*?```", "", text, flags=re.S)) if not re.match(r"^[a-z]+:", t)]


def unembedded_results(root: Path = REPO, planted: dict[str, str] | None = None) -> list[str]:
    """The experiments/results/*.png that no guide and not CHANGELOG.md embeds (``planted``: a document's text in
    place of its file, by path relative to ``root``)."""
    planted = planted or {}
    shown = {(doc.parent / t).resolve() for doc in figure_documents(root)
             for t in _embeds(doc, planted.get(str(doc.relative_to(root))))}
    return sorted(p.name for p in (root / "experiments/results").glob("*.png") if p.resolve() not in shown)


def missing_figures(root: Path = REPO, planted: dict[str, str] | None = None) -> list[str]:
    """Figures a guide or CHANGELOG.md embeds that are not there, as ``doc: path``."""
    planted = planted or {}
    out = []
    for doc in figure_documents(root):
        rel = str(doc.relative_to(root))
        out += [f"{rel}: {t}" for t in _embeds(doc, planted.get(rel)) if not (doc.parent / t).is_file()]
    return out


def test_every_result_figure_is_embedded() -> None:
    """A result figure is shown in the section that discusses it (a guide for a current result, CHANGELOG.md for a
    dated run) or removed: none lies in experiments/results/ for no reader."""
    bad = unembedded_results()
    assert not bad, f"embed these in the section that discusses them, or remove them: {bad}"


def test_every_embedded_figure_exists() -> None:
    """The paper's figures included: paper/report.md embeds the claims' figures, and every one is there."""
    assert not missing_figures(), missing_figures()
    paper = _embeds(REPO / "paper/report.md")
    assert len(paper) >= 10 and all((REPO / "paper" / t).is_file() for t in paper)


def test_a_planted_unembedded_or_missing_figure_is_reported(tmp_path: Path) -> None:
    embed = ("![The step policy under a burst: ITL p99 against TTFT p50, gathering against the default and vLLM's "
             "server](../experiments/results/bench_burst_policy_run5_tradeoff.png)")
    named = "(`experiments/results/bench_burst_policy_run5_tradeoff.png`)"
    named_only = _plant(tmp_path, "serve/README.md", embed, named)
    assert unembedded_results(planted={"serve/README.md": named_only}) == ["bench_burst_policy_run5_tradeoff.png"]
    in_code = _plant(tmp_path, "serve/README.md", embed, f"```\n{embed}\n```")
    assert unembedded_results(planted={"serve/README.md": in_code}) == ["bench_burst_policy_run5_tradeoff.png"]
    gone = _plant(tmp_path, "paper/report.md", "![E1](../experiments/results/E1.png)",
                  "![E1](../experiments/results/E1_gone.png)")
    assert missing_figures(planted={"paper/report.md": gone}) == ["paper/report.md: ../experiments/results/E1_gone.png"]
    assert unembedded_results(planted={"paper/report.md": gone}) == ["E1.png"]
    # a new result figure that nobody embeds (only named and linked), in a repository of its own
    root = tmp_path / "repo"
    (root / "experiments/results").mkdir(parents=True)
    for name in ("a.png", "b.png"):
        (root / "experiments/results" / name).write_bytes(b"\x89PNG")
    (root / "CHANGELOG.md").write_text("![run a](experiments/results/a.png)\n")
    (root / "guide").mkdir()
    (root / "guide/README.md").write_text("See `experiments/results/b.png` or [b](../experiments/results/b.png).\n")
    assert unembedded_results(root) == ["b.png"] and missing_figures(root) == []
