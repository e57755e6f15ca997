"""Which worker gets a request: the coordinator's view of its workers, and its two choices.

Prefill: prefix affinity first: the worker that was sent the longest leading run of this prompt's
prefix-block keys (``reference/kv/prefix_hash.py``, the same in every process) most likely still has
those blocks cached; then fewest in-flight prefill tokens. Decode: fewest in-flight decode tokens
(prompt + max output of what it holds), then most free blocks (from its heartbeats).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

RECENT_KEYS = 100_000  # prefix keys remembered per prefill worker


@dataclass
class Worker:
    node: int
    role: str  # "prefill" or "decode"
    link: Any
    block_size: int
    num_blocks: int
    alive: bool = True
    free_blocks: int = 0
    inflight_tokens: int = 0
    # prefix keys routed here, oldest first
    recent_keys: OrderedDict = field(default_factory=OrderedDict)
    bye: dict | None = None
    revision: int = 0  # of the control payloads, from its HELLO (PROTOCOL.md section 3.1)


def affinity(worker: Worker, keys: Sequence[bytes]) -> int:
    """How many leading keys of the prompt were routed to this worker (and may still be cached
    there)."""
    n = 0
    while n < len(keys) and keys[n] in worker.recent_keys:
        n += 1
    return n


def choose_prefill(workers: Sequence[Worker], keys: Sequence[bytes]) -> Worker:
    best = min(workers, key=lambda w: (-affinity(w, keys), w.inflight_tokens, w.node))
    for k in keys:
        best.recent_keys[k] = None
        best.recent_keys.move_to_end(k)
    while len(best.recent_keys) > RECENT_KEYS:
        best.recent_keys.popitem(last=False)
    return best


def choose_decode(workers: Sequence[Worker]) -> Worker:
    return min(workers, key=lambda w: (w.inflight_tokens, -w.free_blocks, w.node))
