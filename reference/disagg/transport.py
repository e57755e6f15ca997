"""Transports: how whole frames move between two nodes. One small interface, several carriers.

An ``Endpoint`` is one end of a two-way link. ``send(data)`` queues the bytes of one frame and
returns at once (a sender thread, where there is one, does the writing, so a worker's next layer
computes while the last one is on the wire). What arrives is put, frame by frame, into the
endpoint's ``inbox`` (a ``queue.Queue``) as ``(endpoint, bytes)``; ``(endpoint, None)`` means the
link closed (the peer died, hung up, or sent bytes that are not a frame). Several endpoints may
share one inbox: a coordinator waits on one queue for all its workers.

Carriers here: ``pipe()`` (in-process queues, for tests and teaching) and ``SocketEndpoint`` (TCP on
127.0.0.1 by default; frames are length-prefixed by their own header). ``fast/disagg`` adds
torch.distributed. ``Link`` puts the protocol on top: frame numbering, signing, checking.

A socket reader trusts a header's length only up to the endpoint's ``max_payload``: a listener
lowers it to ``HANDSHAKE_PAYLOAD`` for a peer that has not yet proved it holds the secret (its
HELLO), so an unauthenticated peer can make it buffer at most one handshake, not a 64 MiB frame.
Every refused frame is logged once, with the reason (after ``LOGGED_REFUSALS`` on one link, refusals
are only counted).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from typing import Any

from reference.disagg.frames import (
    HEADER_SIZE,
    MAX_PAYLOAD,
    TAG_SIZE,
    Frame,
    FrameError,
    Kind,
    ReplayGuard,
    decode_frame,
    encode_frame,
    parse_header,
)

Inbox = queue.Queue  # of (Endpoint, bytes | None)
# the largest frame a peer may send before its HELLO is accepted (a HELLO is ~400 B)
HANDSHAKE_PAYLOAD = 4096
LOGGED_REFUSALS = 20  # per link; later refusals are counted, not logged
log = logging.getLogger("reference.disagg")


class LinkClosed(ConnectionError):
    """The peer is gone."""


class Endpoint:
    """Base: ``send``, ``close``, and an ``inbox`` that receives ``(self, bytes | None)``."""

    def __init__(self, inbox: Inbox | None = None) -> None:
        self.inbox: Inbox = inbox if inbox is not None else queue.Queue()
        self.closed = False

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def close(self, flush_s: float = 2.0) -> None:
        raise NotImplementedError


class QueueEndpoint(Endpoint):
    """In-process: ``send`` puts the bytes straight into the peer's inbox."""

    peer: QueueEndpoint

    def send(self, data: bytes) -> None:
        if self.closed or self.peer.closed:
            raise LinkClosed("in-process link is closed")
        self.peer.inbox.put((self.peer, bytes(data)))

    def close(self, flush_s: float = 0.0) -> None:
        if not self.closed:
            self.closed = True
            self.inbox.put((self, None))
            if not self.peer.closed:
                self.peer.closed = True
                self.peer.inbox.put((self.peer, None))


def pipe(
    inbox_a: Inbox | None = None, inbox_b: Inbox | None = None
) -> tuple[QueueEndpoint, QueueEndpoint]:
    """Two connected in-process endpoints."""
    a, b = QueueEndpoint(inbox_a), QueueEndpoint(inbox_b)
    a.peer, b.peer = b, a
    return a, b


class SocketEndpoint(Endpoint):
    """A TCP connection. A reader thread cuts the byte stream into frames by their headers (the
    header is checked before its length is trusted); a writer thread sends queued frames in
    order."""

    def __init__(self, sock: socket.socket, inbox: Inbox | None = None, start: bool = True) -> None:
        super().__init__(inbox)
        self.sock = sock
        self.error: str | None = None
        # a header announcing more is refused before its payload is read
        self.max_payload = MAX_PAYLOAD
        self._out: queue.Queue[bytes | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        """Start the reader and writer threads (later than construction, once the owner can take
        frames)."""
        self._reader.start()
        self._writer.start()

    def send(self, data: bytes) -> None:
        if self.closed:
            raise LinkClosed(f"socket link is closed ({self.error or 'closed here'})")
        self._out.put(bytes(data))

    def close(self, flush_s: float = 2.0) -> None:
        """Close after the frames already queued are written (waiting at most ``flush_s``)."""
        if self.closed:
            return
        self.closed = True
        self._out.put(None)
        if self._writer.is_alive() and threading.current_thread() is not self._writer:
            self._writer.join(timeout=flush_s)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _read_exact(self, n: int) -> bytes | None:
        chunks, got = [], 0
        while got < n:
            chunk = self.sock.recv(min(n - got, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _read_loop(self) -> None:
        try:
            while True:
                header = self._read_exact(HEADER_SIZE)
                if header is None:
                    break
                length = parse_header(header)[4]  # FrameError on a bad header
                if length > self.max_payload:
                    raise FrameError(f"a frame of {length} payload bytes exceeds this link's limit "
                                     "of "
                                     f"{self.max_payload} (the peer has not said HELLO)")
                rest = self._read_exact(length + TAG_SIZE)
                if rest is None:
                    break
                self.inbox.put((self, header + rest))
        except FrameError as e:
            self.error = f"peer sent bytes that are not a frame: {e}"
            log.warning("closing the link to %s: %s", socket_peer(self.sock), self.error)
        except OSError as e:
            self.error = str(e)
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
        self._out.put(None)
        self.inbox.put((self, None))

    def _write_loop(self) -> None:
        while True:
            data = self._out.get()
            if data is None:
                return
            try:
                self.sock.sendall(data)
            except OSError as e:
                self.error = str(e)
                return


def socket_peer(sock: socket.socket) -> str:
    """``host:port`` of the other end of ``sock``, for log lines."""
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a closed socket"


def listen(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket (localhost by default; port 0: the OS picks one, see
    getsockname())."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port))
    server.listen(64)
    return server


def connect(port: int, host: str = "127.0.0.1", inbox: Inbox | None = None,
            timeout: float = 10.0) -> SocketEndpoint:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return SocketEndpoint(sock, inbox)


class Link:
    """The protocol over one endpoint: numbers and signs what it sends, checks what it receives.

    Receiving: ``accept(data)`` returns the Frame, or None when it is refused (not a frame, wrong
    secret, corrupt, or a duplicate/replay); refusals are counted in ``counters``, never raised.
    """

    def __init__(self, endpoint: Endpoint, secret: bytes, node: int,
                 counters: dict[str, int] | None = None, guard: ReplayGuard | None = None) -> None:
        self.endpoint, self.secret, self.node = endpoint, secret, node
        self.counters = counters if counters is not None else {}
        self.guard = guard if guard is not None else ReplayGuard()
        self.next_seq = 0
        self.refusals = 0
        self.peer: Any = None  # whatever the owner wants to remember about the other end

    def send(self, kind: Kind, stream: int, payload: bytes) -> None:
        data = encode_frame(kind=kind, src=self.node, stream=stream, seq=self.next_seq,
                            payload=payload, secret=self.secret)
        self.next_seq += 1
        self.endpoint.send(data)
        self.count("frames_sent")
        self.count("bytes_sent", len(data))

    def forward(self, raw: bytes) -> None:
        """Send a frame received from a third node, unchanged (its own src, seq and tag)."""
        self.endpoint.send(raw)

    def accept(self, data: bytes) -> Frame | None:
        try:
            frame = decode_frame(data, self.secret)
        except FrameError as e:
            self.refuse("frames_refused", str(e))
            return None
        if not self.guard.accept(frame.src, frame.seq):
            self.refuse("frames_duplicate", f"duplicate or replayed frame (src {frame.src}, seq "
                                            f"{frame.seq})")
            return None
        return frame

    def refuse(self, counter: str, reason: str) -> None:
        """Count a refused frame (or peer) and log why: one line each, up to LOGGED_REFUSALS per
        link."""
        self.count(counter)
        self.refusals += 1
        if self.refusals <= LOGGED_REFUSALS:
            more = (
                "; further refusals on this link are only counted"
                if self.refusals == LOGGED_REFUSALS
                else ""
            )
            log.warning("node %d refused a frame from %s: %s%s", self.node, self.peer_name(),
                        reason, more)

    def peer_name(self) -> str:
        name = getattr(self.peer, "node", None)
        return f"node {name}" if name is not None else "a peer that has not said HELLO"

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n
