"""``python -m serve fleet SCENARIO.toml``: a simulator scenario run on real server processes behind one gateway.

``sites.py`` starts a ``python -m serve`` per worker of every local site; ``view.py`` is the router's view of
them (load and health from ``/metrics`` and ``/health``); ``gateway.py`` is the OpenAI-compatible front door
that routes every request with ``reference.cluster.router.Router``; ``cli.py`` puts them together.
"""

from serve.fleet.cli import Fleet, main
from serve.fleet.sites import FleetError

__all__ = ["Fleet", "FleetError", "main"]
