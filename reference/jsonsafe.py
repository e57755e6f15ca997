"""JSON from outside (a request body, a peer's payload, a file header), parsed with bounded nesting.

``json.loads`` recurses once per level of nesting: a body of 100,000 ``[`` raises ``RecursionError``
deep inside the parser, and a document just under the interpreter's limit parses but then breaks
whatever walks it next (a schema check, ``json.dumps``). ``loads`` here measures the nesting first,
without recursing, and refuses a document deeper than ``max_depth`` with ``JsonError`` (a
``ValueError``), as it refuses text that is not JSON or not UTF-8. The project's documents are
shallow: a request body needs 4 levels, a safetensors header 3, a container header 4.

The depth is counted on the brackets that stand outside strings. Counting the brackets at all is a
C-speed ``str.count``; only a document with more than ``max_depth`` of them is scanned: its strings
removed whole by one regular expression, then everything but brackets by another, and the brackets
left counted in order.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64

# a string (escapes included, matched without backtracking); a run of anything but brackets
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class JsonError(ValueError):
    """Text that is not JSON, not UTF-8, or nested deeper than allowed. The message says which."""


def nesting_depth(text: str, stop_above: int | None = None) -> int:
    """The deepest nesting of arrays and objects in ``text`` (0 for a scalar); it stops counting
    (and returns) as soon as it passes ``stop_above``."""
    if text.count("[") + text.count("{") <= (stop_above if stop_above is not None else -1):
        return text.count("[") + text.count("{")  # an upper bound that is already small enough
    depth = deepest = 0
    for c in _NOT_BRACKET.sub("", _STRING.sub("", text)):  # the brackets outside strings, in order
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and deepest > stop_above:
                    return deepest
        elif c in "]}":
            depth -= 1
    return deepest


def loads(data: str | bytes | bytearray, *, max_depth: int = MAX_DEPTH, what: str = "JSON") -> Any:
    """Parse ``data`` (bytes are decoded as UTF-8) as one JSON document nested at most ``max_depth``
    levels deep. Raises JsonError naming ``what`` and the problem."""
    if isinstance(data, bytes | bytearray):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonError(f"{what} is not valid UTF-8 ({e})") from None
    else:
        text = data
    if nesting_depth(text, stop_above=max_depth) > max_depth:
        raise JsonError(f"{what} is nested more than {max_depth} levels deep")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise JsonError(f"{what} is not valid JSON: {e}") from None
    except RecursionError:  # unreachable after the depth check; kept so no traceback can escape
        raise JsonError(f"{what} is nested too deeply") from None
