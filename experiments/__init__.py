"""One module per claim of CLAIMS.md, and the runner: ``python -m experiments reproduce``."""
