"""What every result records about where it was measured: machine, software, commit, date.

Plain Python (no NumPy needed); experiments/ and conformance/ both stamp their results with it."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def commit() -> str:
    """The git commit of the working tree, with '+dirty' if it has uncommitted changes."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
            check=True
        ).stdout.strip()
        dirty = subprocess.run(
            # results and the paper are outputs of a run: rewriting them does not make the code
            # dirty
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
             ":!experiments/results", ":!paper"],
            cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, object]:
    """The machine and software versions a measurement was taken on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, object] = {
        "cpu": cpu_model(),
        "cores": cores,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
    # 1-minute load average when this is called (the measurement's own work included)
    if hasattr(os, "getloadavg"):
        info["load_average"] = round(os.getloadavg()[0], 2)
    for dist in ("numpy", "torch", "triton"):
        v = _version(dist)
        if v:
            info[dist] = v
    return info


def now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
