"""Sequence's prompt check: the fast path for plain ints decides exactly as the item-by-item rule."""

from __future__ import annotations

import enum

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.sched import RequestError, Sequence


class Colour(enum.IntEnum):
    RED = 3


def rule(tokens: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)


items = st.integers(-3, 2**40) | st.booleans() | st.floats(0, 10) | st.just(Colour.RED) | st.just(np.int64(4))


@given(st.lists(items, min_size=1, max_size=20))
def test_accepts_exactly_non_negative_ints(tokens):
    if rule(tokens):
        assert Sequence(tokens, max_tokens=1).token_ids == tokens
    else:
        with pytest.raises(RequestError, match="non-negative integers"):
            Sequence(tokens, max_tokens=1)
