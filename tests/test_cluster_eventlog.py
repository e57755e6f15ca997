"""The event-log hash (reference/cluster/eventlog.py): order of equal-time events does not matter, content does."""

from __future__ import annotations

import hashlib
import struct

from hypothesis import given
from hypothesis import strategies as st

from reference.cluster.eventlog import EventLog, event_id

events = st.lists(st.tuples(st.floats(0, 1e6, allow_nan=False), st.integers(0, 7), st.integers(-1, 2**40)),
                  min_size=1, max_size=30)


def log_of(evs: list[tuple[float, int, int]]) -> EventLog:
    log = EventLog()
    for e in evs:
        log.add(*e)
    return log


@given(events, st.randoms())
def test_any_order_gives_the_same_hash(evs, rnd):
    shuffled = list(evs)
    rnd.shuffle(shuffled)
    assert log_of(evs).hexdigest() == log_of(shuffled).hexdigest()
    assert log_of(evs).events == len(evs)


@given(events, st.data())
def test_a_changed_event_changes_the_hash(evs, data):
    i = data.draw(st.integers(0, len(evs) - 1))
    t, kind, ident = evs[i]
    changed = list(evs)
    changed[i] = (t, kind, ident + 1)
    assert log_of(evs).hexdigest() != log_of(changed).hexdigest()


def test_the_hash_is_the_documented_sum():
    evs = [(0.5, 1, 7), (0.25, 2, 3)]
    want = sum(int.from_bytes(hashlib.blake2b(struct.pack("<dBq", *e), digest_size=16,
                                              person=b"unfire-cluster").digest(), "little") for e in evs) % 2**128
    assert log_of(evs).hexdigest() == f"{want:032x}"


def test_event_ids():
    assert event_id(None) == -1
    assert event_id(5) == 5
    assert event_id("site-a") == event_id("site-a") != event_id("site-b")
