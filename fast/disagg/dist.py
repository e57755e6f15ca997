"""``DistEndpoint``: one end of a frame link between two torch.distributed ranks.

A frame travels as two point-to-point messages: its length (one int64) and its bytes (uint8). A
length of 0 means the sender closed the link. A length above the largest possible frame closes the
link too, before any memory is allocated for it (a peer's length is never trusted). A reader thread
receives, a writer thread sends, so a worker's compute goes on while frames are on the wire; both
only ever talk to their one peer rank.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from reference.disagg.frames import HEADER_SIZE, MAX_PAYLOAD, TAG_SIZE, frame_size
from reference.disagg.transport import Endpoint, Inbox, LinkClosed

MAX_FRAME = HEADER_SIZE + MAX_PAYLOAD + TAG_SIZE


class DistEndpoint(Endpoint):
    def __init__(self, peer: int, inbox: Inbox | None = None) -> None:
        super().__init__(inbox)
        self.peer = peer
        self.error: str | None = None
        self._out: queue.Queue[bytes | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        self._reader.start()
        self._writer.start()

    def send(self, data: bytes) -> None:
        if self.closed:
            raise LinkClosed(f"link to rank {self.peer} is closed")
        self._out.put(bytes(data))

    def close(self, flush_s: float = 5.0) -> None:
        """Send the closing length 0 after what is queued, and stop."""
        if self.closed:
            return
        self.closed = True
        self._out.put(None)
        self._writer.join(timeout=flush_s)

    def wait_closed(self, timeout: float = 10.0) -> None:
        """Wait until the peer has closed its side (its length 0 has arrived)."""
        self._reader.join(timeout=timeout)

    def _read_loop(self) -> None:
        length = torch.zeros(1, dtype=torch.int64)
        try:
            while True:
                dist.recv(length, src=self.peer)
                n = int(length.item())
                if n == 0:
                    break
                if not HEADER_SIZE <= n <= MAX_FRAME:
                    self.error = f"rank {self.peer} announced a frame of {n} bytes"
                    break
                buf = torch.empty(n, dtype=torch.uint8)
                dist.recv(buf, src=self.peer)
                data = buf.numpy().tobytes()
                try:
                    if frame_size(data[:HEADER_SIZE]) != n:
                        raise ValueError("length disagrees with the frame header")
                except ValueError as e:
                    self.error = f"rank {self.peer} sent bytes that are not a frame: {e}"
                    break
                self.inbox.put((self, data))
        except RuntimeError as e:  # the process group went away (peer died)
            self.error = str(e)
        self.closed = True
        self.inbox.put((self, None))

    def _write_loop(self) -> None:
        while True:
            data = self._out.get()
            try:
                if data is None:
                    dist.send(torch.zeros(1, dtype=torch.int64), dst=self.peer)
                    return
                dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=self.peer)
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=self.peer)
            except RuntimeError as e:
                self.error = str(e)
                return
