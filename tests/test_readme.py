"""The README's promises: two quickstart commands, the one CI runs, and a Python example that works."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_quickstart_has_exactly_the_two_commands() -> None:
    block = re.search(r"## Quickstart.*?```bash\n(.*?)```", README, re.S)
    assert block, "README has no Quickstart bash block"
    commands = [line for line in block.group(1).splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    reproduce, test = commands
    assert reproduce.endswith("python -m experiments reproduce")
    assert "pytest" in test and "conformance" in test


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run takes the line under '# 2. set up and run the tests' and runs it as written."""
    out = subprocess.run(["grep", "-A1", "-F", "# 2. set up and run the tests", "README.md"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    assert "pytest" in out
    assert "# 2. set up and run the tests" in (REPO / ".ci" / "run").read_text()


@pytest.mark.slow
def test_python_example_runs_and_checks_its_answer() -> None:
    """The example asserts the answer it prints (greedy decoding, so the answer is fixed)."""
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    assert re.search(r"^assert .*answer", code, re.M), "the README example must assert its output"
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        exec(compile(code, "README.md", "exec"), {})


def test_the_conformance_guide_counts_the_cases_it_runs() -> None:
    """The '~N cases' in conformance/README.md stays within 15% of the cases a CPU run has (not large_only)."""
    from conformance.registry import load_cases

    said = int(re.search(r"~(\d+) cases", (REPO / "conformance" / "README.md").read_text()).group(1))
    actual = sum(not case.large_only for case in load_cases().values())
    assert abs(actual - said) <= 0.15 * actual, f"README says ~{said} conformance cases, there are {actual}"


GUIDES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in REPO.glob("*/**/*.md")
                               if ".venv" not in p.parts and "build" not in p.parts
                               and "results" not in p.parts)]


@pytest.mark.parametrize("doc", GUIDES)
def test_every_relative_link_resolves(doc: str) -> None:
    """Links in the README, the guides beside the code, FORMAT.md, PROTOCOL.md and paper/ point at files."""
    path = REPO / doc
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:|^#", target):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{doc}: links to missing files: {broken}"


def test_the_front_door_stays_short_and_names_every_guide() -> None:
    assert len(README.splitlines()) < 300 and len(README.encode()) < 20_000
    for guide in ("serve/README.md", "reference/codec/README.md", "reference/disagg/README.md",
                  "fast/pipeline/README.md", "experiments/README.md", "conformance/README.md"):
        assert f"]({guide})" in README, f"README does not link {guide}"
    assert not re.search(r"\b[0-9a-f]{7,40}\b", README), "no commit hashes in the front door"


def test_the_results_table_is_the_one_the_paper_command_writes() -> None:
    """The README's table is generated (`python -m experiments paper`), never typed: stored results give it."""
    from experiments.registry import discover
    from experiments.report import BEGIN, END, load_results, table_rows, with_results_table

    assert BEGIN in README and END in README, "README lost its results markers"
    results = load_results()
    expected = with_results_table(README, table_rows(discover(), results, ran=set(results)))
    assert README == expected, "README's results table is stale: run `python -m experiments paper`"
