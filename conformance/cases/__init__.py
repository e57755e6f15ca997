"""Conformance case modules. Each module here registers its cases when imported (see registry.py)."""
