"""What the coordinator counts per worker, from the frames it relays (the endpoint's ``/metrics``
shows it).

KV payload bytes a prefill worker sent and a decode worker was forwarded, handoffs (prefill: DONE
frames sent; decode: requests finished on received KV), recomputes (decode: requests whose prompt,
or part of it, it computed itself), and the exposed transfer time: from the prefill worker's DONE
forwarded to the decode worker's first token back, the part of the handoff the client waits for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reference.disagg import messages
from reference.disagg.frames import Frame, Kind
from reference.disagg.nixl_carrier import DESCRIPTOR, DESCRIPTOR_FLAG
from reference.disagg.wire import KV_HEADER

# streams whose DONE was forwarded but whose first token has not come back
MAX_OPEN_TRANSFERS = 65536


@dataclass
class NodeStats:
    """What the coordinator saw of one worker."""

    role: str
    pid: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    kv_bytes_nixl: int = 0  # of kv_bytes_sent/received: read with NIXL, only a descriptor framed
    handoffs: int = 0
    recomputes: int = 0
    exposed_transfer_s: float = 0.0  # decode: DONE forwarded -> first token back, summed
    exposed_transfers: int = 0


def kv_payload_size(payload: bytes) -> tuple[int, bool]:
    """(KV payload bytes, read with NIXL?) of a KV frame: its own length, or for a NIXL descriptor
    (``nixl_carrier.py``) the length of the payload it points at."""
    flag_at, size = 3, KV_HEADER.size
    if len(payload) == size + DESCRIPTOR.size and payload[flag_at] == DESCRIPTOR_FLAG:
        return DESCRIPTOR.unpack_from(payload, size)[1], True
    return len(payload), False


class Accounting:
    """``stats[node]`` for every worker that said HELLO; ``count`` is called on each frame of a live
    request."""

    def __init__(self) -> None:
        self.stats: dict[int, NodeStats] = {}
        self.done_at: dict[int, float] = {}  # stream -> when its DONE was forwarded

    def joined(self, node: int, role: str, pid: int) -> None:
        self.stats[node] = NodeStats(role, pid)

    def count(self, sender: Any, decode_node: int | None, frame: Frame, now: float) -> None:
        """``sender``: the worker that sent ``frame`` (``routing.Worker``); ``decode_node``: the
        request's."""
        mine = self.stats.get(sender.node)
        if mine is None:
            return
        if sender.role == "prefill" and frame.kind is Kind.KV:
            peer = self.stats.get(decode_node) if decode_node is not None else None
            if peer is not None:
                size, nixl = kv_payload_size(frame.payload)
                mine.kv_bytes_sent += size
                peer.kv_bytes_received += size
                if nixl:
                    mine.kv_bytes_nixl += size
                    peer.kv_bytes_nixl += size
        elif sender.role == "prefill" and frame.kind is Kind.DONE:
            mine.handoffs += 1
            self.done_at.setdefault(frame.stream, now)
            # first tokens that never came: forget the oldest half
            if len(self.done_at) > MAX_OPEN_TRANSFERS:
                for stream in list(self.done_at)[:MAX_OPEN_TRANSFERS // 2]:
                    del self.done_at[stream]
        elif sender.role == "decode" and frame.kind is Kind.TOKEN and frame.stream in self.done_at:
            mine.exposed_transfer_s += now - self.done_at.pop(frame.stream)
            mine.exposed_transfers += 1
        elif sender.role == "decode" and frame.kind is Kind.FINISH:
            self.done_at.pop(frame.stream, None)
            body = messages.load(Kind.FINISH, frame.payload)
            if body["recomputed"]:
                mine.recomputes += 1
            elif body["finish_reason"] != "error":
                mine.handoffs += 1
