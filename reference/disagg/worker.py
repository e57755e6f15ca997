"""What the prefill and the decode worker share: their load report and their goodbye."""

from __future__ import annotations

from typing import Any

from reference.disagg import messages
from reference.disagg.frames import Kind


class WorkerBase:
    """A worker has ``link``, ``scheduler``, ``block_manager``, ``streams`` and ``counters``."""

    link: Any
    scheduler: Any
    block_manager: Any
    streams: dict
    counters: dict[str, int]

    def inflight_tokens(self) -> int:
        raise NotImplementedError

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    def heartbeat(self) -> None:
        """Tell the coordinator this worker is alive, and how loaded (it routes by this)."""
        self.link.send(Kind.HEARTBEAT, 0, messages.dump(Kind.HEARTBEAT, {
            "free_blocks": self.block_manager.num_free_blocks, "inflight_tokens": self.inflight_tokens()}))

    def bye(self) -> dict:
        """The BYE body: final counters, and what is still held (all zero after a clean run)."""
        live = len(self.scheduler.waiting) + len(self.scheduler.running)
        return {"free_blocks": self.block_manager.num_free_blocks, "total_blocks": self.block_manager.num_blocks,
                "live_streams": len(self.streams), "live_sequences": live, "counters": dict(self.counters)}
