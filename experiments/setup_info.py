"""Kept so that older imports work: the provenance helpers live in ``reference/provenance.py`` (used by
both experiments/ and conformance/, which do not import each other)."""

from reference.provenance import commit, cpu_model, machine, now  # noqa: F401
