"""Typed fields from plain data (a parsed TOML/JSON file): every value checked, errors name the
field."""

from __future__ import annotations

import math
from typing import Any


class ScenarioError(ValueError):
    """A scenario file is malformed or inconsistent; the message names the field."""


def build(cls: type, table: Any, where: str) -> Any:
    table = as_table(table, where)
    fields = cls.__dataclass_fields__
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ScenarioError(f"{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
    try:
        obj = cls(**table)
    except TypeError as e:
        raise ScenarioError(f"{where}: {e}") from None
    for name, f in fields.items():
        value, kind = getattr(obj, name), str(f.type)
        if kind in ("float", "int") and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ScenarioError(f"{where}.{name}: expected a finite number, got {value!r}")
        if kind == "int" and not isinstance(value, int):
            raise ScenarioError(f"{where}.{name}: expected an integer, got {value!r}")
        if kind == "str" and not isinstance(value, str):
            raise ScenarioError(f"{where}.{name}: expected a string, got {value!r}")
        if kind.startswith("dict[") and not isinstance(value, dict):
            raise ScenarioError(f"{where}.{name}: expected a table/object, got {value!r}"[:200])
        if kind == "bool" and not isinstance(value, bool):
            raise ScenarioError(f"{where}.{name}: expected true or false, got {value!r}")
        if kind.startswith("tuple[str") and not (
            isinstance(value, tuple) and all(isinstance(v, str) for v in value)
        ):
            raise ScenarioError(f"{where}.{name}: expected a list of strings, got {value!r}")
    return obj


def as_table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ScenarioError(f"{where}: expected a table/object, got {type(value).__name__}")
    return value


def as_list(data: dict[str, Any], key: str, where: str = "", required: bool = True,
            default: list[Any] | None = None) -> list[Any]:
    """``data[key]`` as a list: required and non-empty, or optional (``default`` when absent)."""
    if not required and key not in data:
        return list(default or [])
    value = data.get(key)
    if not isinstance(value, list) or (required and not value):
        raise ScenarioError(f"{where}{key}: expected a {'non-empty ' if required else ''}list, got "
                            f"{value!r}"[:200])
    return value


def check_positive(where: str, **values: float) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise ScenarioError(f"{where}.{name}: must be > 0, got {v!r}")
