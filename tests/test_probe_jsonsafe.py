"""``reference.jsonsafe``: the bounded-nesting JSON loader every parser of outside JSON uses. It must
parse what ``json.loads`` parses (when shallow enough), measure nesting exactly (brackets inside
strings, escaped quotes), and refuse the rest with a JsonError, never a RecursionError."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.jsonsafe import JsonError, loads, nesting_depth

docs = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(alphabet='ab[]{}"\\\n\u00e9', max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=20)


def depth(v: object) -> int:
    if isinstance(v, list):
        return 1 + max((depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((depth(x) for x in v.values()), default=0)
    return 0


@given(doc=docs, indent=st.none() | st.integers(0, 2))
def test_loads_equals_json_loads_and_the_depth_is_exact(doc, indent):
    text = json.dumps(doc, indent=indent)
    assert nesting_depth(text) == depth(doc)
    if depth(doc) <= 3:
        assert loads(text, max_depth=3) == doc
    else:
        with pytest.raises(JsonError, match="nested more than 3"):
            loads(text, max_depth=3)


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a":' * 100_000, "[" * 100_000 + "]" * 100_000])
def test_deep_documents_are_refused_not_recursed(text):
    with pytest.raises(JsonError, match="nested more than 64"):
        loads(text)


def test_bad_json_and_bad_utf8_name_what_was_read():
    with pytest.raises(JsonError, match="the header is not valid JSON"):
        loads("{", what="the header")
    with pytest.raises(JsonError, match="not valid UTF-8"):
        loads(b"\xff")
    assert loads('"[[[[\\"[[["') == '[[[["[[['  # brackets in a string are not nesting
