"""Building the engine the server fronts: the reference (NumPy) one or the fast (torch) one.

The fast engine lives in ``fast.engine`` and is imported only when asked for, so the server runs
without torch; if it is not there, the error says so and how to get the reference engine instead.
Both take the same scheduling options (``num_blocks``, ``block_size``, ``max_num_seqs``, ...).
"""

from __future__ import annotations

import importlib
from typing import Any

from reference.sched import Tenants


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot be built here (missing module or package)."""


def load_engine(model: str, kind: str = "reference", *, tenants: Tenants | None = None, policy: str = "sjf+wfq",
                dtype: str = "bfloat16", **engine_kwargs: Any) -> Any:
    """An engine over ``model`` (a packaged model name or a checkpoint path) with its tokenizer."""
    if tenants is None:
        tenants = Tenants.open()
    options = dict(policy=policy, tenants=tenants, **engine_kwargs)
    if kind == "reference":
        from reference.engine.engine import Engine
        from reference.model.llama import LlamaModel
        from reference.model.tokenizer import load_tokenizer

        return Engine(LlamaModel.load(model), load_tokenizer(model), **options)
    if kind == "fast":
        try:
            fast_engine = importlib.import_module("fast.engine")
        except ImportError as e:
            raise EngineUnavailable(f"--engine fast needs the fast engine (fast.engine), which cannot be imported "
                                    f"here: {e}. Install the fast extra (pip install -e '.[fast]') on a checkout "
                                    "that has fast/engine, or use --engine reference") from None
        return fast_engine.Engine.load(model=model, dtype=dtype, compressed=False, **options)
    raise EngineUnavailable(f"unknown engine {kind!r}: use 'reference' or 'fast'")
