"""The event-log hash: one number that fingerprints everything a simulation did.

Every event (virtual time, kind, subject id) is hashed with BLAKE2b (16 bytes, personalised) and the
hashes are summed modulo 2**128. A sum does not depend on the order in which events are added, so
events that happen at the same virtual time may be logged in any order (a macro step logs its steps
when it ends, not as each one ends) and the hash is still that of the whole log. The same scenario
and seed give the same hash; any change to what happened, when, or to whom changes it.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

from reference.cluster.build import Request
from reference.cluster.replica import Replica

HASH_MASK = (1 << 128) - 1
EVENT = struct.Struct("<dBq")  # one logged event: time, kind, subject
# copied per event, never updated
EVENT_HASHER = hashlib.blake2b(digest_size=16, person=b"unfire-cluster")


class EventLog:
    """The running sum of the events' hashes, and how many events it holds."""

    def __init__(self) -> None:
        self.digest = 0
        self.events = 0

    def add(self, t: float, kind: int, ident: int) -> None:
        """Fold one event into the hash."""
        h = EVENT_HASHER.copy()  # a copy of a ready hasher: cheaper than a new one per event
        h.update(EVENT.pack(t, kind, ident))
        self.digest = (self.digest + int.from_bytes(h.digest(), "little")) & HASH_MASK
        self.events += 1

    def hexdigest(self) -> str:
        return f"{self.digest:032x}"


def event_id(subject: object) -> int:
    """The id an event is logged under: a request's id, a replica's index, an int as is, else a CRC
    of its text."""
    if isinstance(subject, Request):
        return subject.rid
    if isinstance(subject, Replica):
        return subject.index
    if isinstance(subject, int):
        return subject
    return -1 if subject is None else zlib.crc32(str(subject).encode())
