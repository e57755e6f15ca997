"""One module per claim of paper/claims.md, and the runner: ``python -m experiments reproduce``."""
