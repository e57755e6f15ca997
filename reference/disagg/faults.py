"""A seeded fault injector for the handoff, and the list of faults with their documented outcomes.

Frame faults act on the frames of a handoff (MANIFEST, KV, DONE, ACK) where the coordinator
forwards them, the same way over every transport; process faults act on whole workers. With the
same seed and the same frames, the same faults happen.
"""

from __future__ import annotations

import random
from typing import Any

from reference.disagg.frames import HEADER_SIZE, Frame, Kind
from reference.disagg.transport import Link

FAULTS: dict[str, str] = {
    "drop": "a handoff frame is lost -> the decode worker computes what is missing itself (same "
            "output)",
    "delay": "a handoff frame arrives late (up to 50 ms) -> no effect on the output",
    "duplicate": "a handoff frame arrives twice -> the copy is refused by its sequence number",
    "reorder": "a handoff frame overtakes the next one -> KV frames land by position; no effect",
    "flip": "one bit of a handoff frame flips -> the tag check refuses it; as drop",
    "stall": "the handshake stalls (MANIFEST held 2 s) -> the prefill worker gives up (ABORT) and "
             "the decode "
             "worker computes the prompt itself",
    "kill-prefill": "a prefill worker is killed (SIGKILL) mid-transfer and restarted -> its "
                    "requests are "
                    "computed by their decode workers",
    "kill-decode": "a decode worker is killed (SIGKILL) while decoding and restarted -> its "
                   "requests migrate "
                   "to a live decode worker, going on from the tokens already streamed (2 "
                   "attempts), else fail "
                   "with an error",
    "abort": "a request is cancelled after its transfer started -> it ends with finish_reason "
             "'abort'; "
             "every worker frees its blocks",
}
FRAME_FAULTS = ("drop", "delay", "duplicate", "reorder", "flip", "stall")


def parse_faults(spec: str | None) -> list[str]:
    """``"drop,flip"`` -> ["drop", "flip"]; an unknown name raises ValueError listing the known
    ones."""
    names = [s.strip() for s in (spec or "").split(",") if s.strip()]
    for n in names:
        if n not in FAULTS:
            raise ValueError(f"unknown fault {n!r}; known: {', '.join(FAULTS)}")
    return names


class FaultInjector:
    """Forwards handoff frames, sometimes not as asked. ``rate``: chance per frame of each frame
    fault."""

    def __init__(self, faults: list[str], seed: int, rate: float = 0.15, delay_s: float = 0.05,
                 stall_s: float = 2.0) -> None:
        self.faults = [f for f in faults if f in FRAME_FAULTS]
        self.rng = random.Random(seed)
        self.rate, self.delay_s, self.stall_s = rate, delay_s, stall_s
        self.held: list[tuple[float, Link, bytes]] = []  # (release time, link, bytes)
        self.counters: dict[str, int] = {}

    def forward(self, link: Link, frame: Frame, now: float) -> None:
        data = frame.raw
        fault = None
        for name in self.faults:
            if name == "stall":
                if frame.kind is Kind.MANIFEST and self.rng.random() < 0.5:
                    fault = name
            elif self.rng.random() < self.rate:
                fault = name
            if fault:
                break
        if fault is None:
            return self._send(link, data)
        self.counters[fault] = self.counters.get(fault, 0) + 1
        if fault == "drop":
            return
        if fault == "flip":
            # past the header: framing stays intact
            bit = self.rng.randrange(HEADER_SIZE * 8, len(data) * 8)
            flipped = bytearray(data)
            flipped[bit // 8] ^= 1 << (bit % 8)
            return self._send(link, bytes(flipped))
        if fault == "duplicate":
            self._send(link, data)
            return self._send(link, data)
        if fault == "delay":
            self.held.append((now + self.rng.uniform(0, self.delay_s), link, data))
        elif fault == "reorder":
            self.held.append((now + 0.01, link, data))  # the next frame on this link goes first
        elif fault == "stall":
            self.held.append((now + self.stall_s, link, data))

    def pump(self, now: float) -> None:
        """Release the held frames whose time has come."""
        due = [h for h in self.held if h[0] <= now]
        self.held = [h for h in self.held if h[0] > now]
        for _, link, data in due:
            self._send(link, data)

    def _send(self, link: Link, data: bytes) -> Any:
        try:
            link.forward(data)
        except ConnectionError:
            pass  # the peer is gone; the coordinator notices on its own
