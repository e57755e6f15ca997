"""Frames: the unit of the handoff protocol on any transport (``PROTOCOL.md`` section 2).

A frame is a 28-byte header, a payload and a 32-byte HMAC-SHA256 tag:

    magic "UFKV" | version u8 | kind u8 | src u16 | stream u64 | seq u32 | length u32 | crc32 u32
    payload (length bytes)
    tag = HMAC-SHA256(secret, header || payload)

all integers little-endian. ``src`` is the sender's node id, ``stream`` the request attempt the
frame belongs to (0 for link-level frames), ``seq`` counts the sender's frames from 0, ``crc32`` is
zlib's CRC-32 of the payload. A receiver checks, in this order and before it reads the payload: the
magic, the version, the kind, that length <= MAX_PAYLOAD and that exactly that many bytes came,
the tag (constant-time compare), the CRC. Any failure raises ``FrameError`` naming the field.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"UFKV"
VERSION = 1
HEADER = struct.Struct("<4sBBHQIII")
HEADER_SIZE = HEADER.size  # 28
TAG_SIZE = 32
MAX_PAYLOAD = 64 << 20  # 64 MiB: a larger length field is refused before any byte is read


class FrameError(ValueError):
    """Bytes that are not a valid, authentic frame of this protocol version."""


class Kind(enum.IntEnum):
    HELLO = 1  # worker -> coordinator: who I am (role, model digest, KV layout)
    REQUEST = 2  # coordinator -> worker: a request to prefill (prefill) or to expect (decode)
    MANIFEST = 3  # prefill -> decode: opens a KV stream
    KV = 4  # prefill -> decode: K and V of one layer for a range of token positions
    DONE = 5  # prefill -> decode: every KV frame was sent; carries the first token
    ABORT = 6  # any -> any: the stream ends without a handoff (reason inside)
    ACK = 7  # decode -> prefill: manifest accepted (how many tokens it already has) / done received
    HEARTBEAT = 8  # worker -> coordinator: alive, and its load
    TOKEN = 9  # decode -> coordinator: one output token
    FINISH = 10  # decode -> coordinator: the request ended (all output tokens, reason, error)
    SHUTDOWN = 11  # coordinator -> worker: stop after answering BYE
    BYE = 12  # worker -> coordinator: final counters, free blocks


STREAM_KINDS = frozenset({Kind.MANIFEST, Kind.KV, Kind.DONE, Kind.ACK})  # the handoff itself


@dataclass(frozen=True)
class Frame:
    kind: Kind
    src: int
    stream: int
    seq: int
    payload: bytes
    raw: bytes = b""  # the frame's bytes as received (a coordinator forwards them unchanged)


def encode_frame(*, kind: Kind, src: int, stream: int, seq: int, payload: bytes,
                 secret: bytes) -> bytes:
    """The bytes of one frame, tag included."""
    if len(payload) > MAX_PAYLOAD:
        raise FrameError(f"payload of {len(payload)} bytes exceeds the limit of {MAX_PAYLOAD}")
    header = HEADER.pack(MAGIC, VERSION, int(kind), src, stream, seq, len(payload),
                         zlib.crc32(payload))
    return header + payload + hmac.new(secret, header + payload, hashlib.sha256).digest()


def parse_header(header: bytes) -> tuple[Kind, int, int, int, int, int]:
    """(kind, src, stream, seq, payload length, crc) of a header; checks magic, version, kind,
    length."""
    if len(header) < HEADER_SIZE:
        raise FrameError(f"truncated header: {len(header)} of {HEADER_SIZE} bytes")
    magic, version, kind, src, stream, seq, length, crc = HEADER.unpack_from(header)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}: not a frame of this protocol")
    if version != VERSION:
        raise FrameError(
            f"protocol version {version} is not supported (this side speaks {VERSION})"
        )
    try:
        kind = Kind(kind)
    except ValueError:
        raise FrameError(f"unknown frame kind {kind}") from None
    if length > MAX_PAYLOAD:
        raise FrameError(f"payload length {length} exceeds the limit of {MAX_PAYLOAD}")
    return kind, src, stream, seq, length, crc


def frame_size(header: bytes) -> int:
    """Total bytes of the frame that starts with ``header`` (validated): what a stream reader
    reads."""
    return HEADER_SIZE + parse_header(header)[4] + TAG_SIZE


def decode_frame(data: bytes, secret: bytes) -> Frame:
    """Check and parse one whole frame. Raises FrameError; never returns an unauthenticated
    frame."""
    kind, src, stream, seq, length, crc = parse_header(data)
    if len(data) != HEADER_SIZE + length + TAG_SIZE:
        raise FrameError(f"frame of {len(data)} bytes, its header says "
                         f"{HEADER_SIZE + length + TAG_SIZE}")
    body, tag = data[:HEADER_SIZE + length], data[HEADER_SIZE + length:]
    if not hmac.compare_digest(tag, hmac.new(secret, body, hashlib.sha256).digest()):
        raise FrameError("authentication failed: the tag does not match (other secret, or "
                         "corrupted)")
    payload = body[HEADER_SIZE:]
    if zlib.crc32(payload) != crc:
        raise FrameError("payload checksum mismatch")
    return Frame(kind, src, stream, seq, payload, data)


class ReplayGuard:
    """Refuses a frame whose (src, seq) was already accepted, or is too old to tell (duplicates,
    replays).

    Frames may arrive out of order: per sender it keeps the highest seq seen and the set of seqs
    accepted within ``window`` below it.
    """

    def __init__(self, window: int = 1 << 16) -> None:
        self.window = window
        self.highest: dict[int, int] = {}
        self.seen: dict[int, set[int]] = {}

    def accept(self, src: int, seq: int) -> bool:
        high = self.highest.get(src, -1)
        seen = self.seen.setdefault(src, set())
        if seq in seen or seq <= high - self.window:
            return False
        seen.add(seq)
        if seq > high:
            self.highest[src] = seq
            if len(seen) > 2 * self.window:
                self.seen[src] = {s for s in seen if s > seq - self.window}
        return True
