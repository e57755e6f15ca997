"""The HTTP front door: an OpenAI-compatible server over the reference or the fast engine.

``python -m serve`` starts it (see ``serve/__main__.py``); ``python -m serve.bench`` is a load
generator that measures any OpenAI-compatible server. Pieces: ``engine_thread.py`` (the engine on its own
thread), ``app.py`` (the HTTP API), ``answer.py`` (one answer, whole or streamed), ``protocol.py``
(request checks, error bodies), ``textstream.py`` (incremental text, stop strings), ``keys.py``
(API keys -> tenants and plans), ``metrics.py`` (Prometheus), ``engines.py`` (building either
engine), ``latency.py`` (the load generator's statistics).
"""
