"""The NIXL carrier: the decode worker READS each KV payload out of the prefill worker's memory.

With ``--kv-carrier nixl`` the bytes of a KV payload (``wire.py``: header, K, V, fp8 scales,
exactly what a TCP KV frame carries) no longer travel inside the frame. The prefill worker
writes them into a staging arena that its NIXL agent registered (host DRAM, UCX backend) and
sends, in the KV frame, a *descriptor*: the layer and positions, where the bytes lie in that
arena, and a SHA-256 digest of them (``PROTOCOL.md`` section 4.1). The decode worker posts a
NIXL READ from the prefill agent's arena into its own registered arena, checks the digest (so
the bytes are as authenticated as a signed frame's), and installs them as it installs a TCP KV
frame. The frames keep the control: the prefill agent's metadata and arena travel in the
MANIFEST (``kv_source``), the descriptors are the layer-ready notices, DONE/ACK/ABORT are
unchanged. This is how vLLM's NixlConnector moves KV (the consumer reads the producer's
registered memory and tells it when it is done), except that what is registered here is a
staging arena of wire-encoded bytes, not the paged cache itself, so bf16/fp8 on the wire and
every check of the TCP carrier stay the same.

The prefill worker frees a stream's regions when the decode worker acknowledges DONE (sent only
once every read of the stream has finished) or when the stream ends otherwise; a payload that
does not fit in the arena goes inline, as a plain KV frame. A read that fails or does not finish
within ``read_timeout`` seconds (the prefill worker died) counts as a lost frame: the decode
worker computes the missing positions itself, as with a lost TCP frame.

``nixl`` is an optional dependency (``pip install -e '.[nixl]'``): this module imports it only
when a carrier is built, and ``require_nixl()`` says what to install.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

CARRIERS = ("tcp", "nixl")
INSTALL_HINT = "pip install 'nixl==1.5.1' (or, in this repository, pip install -e '.[nixl]')"
# KV descriptor: KV_HEADER (reserved byte 1) | offset u64 | length u32 | blake2b-256 of the bytes
DESCRIPTOR = struct.Struct("<QI32s")
DESCRIPTOR_FLAG = 1  # the KV header's reserved byte: 0 = values inline, 1 = NIXL descriptor


class CarrierError(RuntimeError):
    """The NIXL carrier cannot run here (package missing, agent or registration failed)."""


def nixl_available() -> bool:
    """True when the ``nixl`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("nixl") is not None


def require_nixl() -> None:
    """Raise CarrierError naming the package and the install command when ``nixl`` is missing."""
    if not nixl_available():
        raise CarrierError(f"--kv-carrier nixl needs the NIXL Python package `nixl` (with its UCX "
                           f"backend), which is not installed: {INSTALL_HINT}")


def payload_digest(data: bytes | memoryview) -> bytes:
    """SHA-256 of a KV payload, carried in its (signed) descriptor frame. SHA-256, not BLAKE2b: with
    the CPU's SHA instructions ~1.2 GB/s here, BLAKE2b ~0.44 (measured on this machine)."""
    return hashlib.sha256(data).digest()


class Arena:
    """First-fit allocator over one registered byte buffer (offsets, 64-byte aligned)."""

    ALIGN = 64

    def __init__(self, size: int) -> None:
        self.size = size
        self.buf = np.zeros(size, np.uint8)
        self.free_list: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted, merged

    @property
    def addr(self) -> int:
        return int(self.buf.ctypes.data)

    def alloc(self, n: int) -> int | None:
        """Offset of ``n`` free bytes, or None when no hole is large enough."""
        n = -(-max(n, 1) // self.ALIGN) * self.ALIGN
        for i, (off, length) in enumerate(self.free_list):
            if length >= n:
                self.free_list[i:i + 1] = [(off + n, length - n)] if length > n else []
                return off
        return None

    def free(self, off: int, n: int) -> None:
        """Give back what ``alloc(n)`` returned at ``off``."""
        n = -(-max(n, 1) // self.ALIGN) * self.ALIGN
        spans = sorted([*self.free_list, (off, n)])
        merged: list[tuple[int, int]] = []
        for o, length in spans:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((o, length))
        self.free_list = merged

    def free_bytes(self) -> int:
        return sum(length for _, length in self.free_list)


PROGRESS_DELAY_US = 100  # the progress thread sleeps this long between polls (_new_agent)


def _new_agent(name: str) -> Any:
    """A NIXL agent (UCX backend) whose progress thread sleeps PROGRESS_DELAY_US between polls.

    nixl 1.5.1's Python API hard-codes ``pthrDelay = 0``: the progress thread then spins, a core
    per agent even when idle (measured here: 1.0 CPU-s per second for two idle agents), which on a
    2-core machine starves the workers' own compute. It cannot be turned off either: over UCX's TCP
    transport (the one UCX picks here: its shared-memory transports lack the peer-failure handling
    NIXL asks for) a READ only progresses while the *target* agent progresses too. So the agent is
    built with a config whose ``pthrDelay`` is at least PROGRESS_DELAY_US: idle CPU 0.02 s/s, and
    30 reads of 96 KB take ~5 ms instead of ~14-40 ms (/tmp probe, this machine)."""
    import nixl._api as api

    bind, base = api.nixlBind, api.nixlBind.nixlAgentConfig

    class Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 (the binding's name)
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, max(int(value), PROGRESS_DELAY_US))

    bind.nixlAgentConfig = Config
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    finally:
        bind.nixlAgentConfig = base


class _Agent:
    """One NIXL agent (UCX backend) with one registered DRAM arena."""

    def __init__(self, role: str, node: int, arena_bytes: int) -> None:
        require_nixl()
        try:
            import nixl._api  # noqa: F401
        except ImportError as e:  # installed but broken (a missing shared library)
            raise CarrierError(f"the nixl package is installed but does not load ({e}): "
                               f"{INSTALL_HINT}") from e
        self.name = f"unfire-{role}-{node}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.agent = _new_agent(self.name)
            self.arena = Arena(arena_bytes)
            self.reg = self.agent.register_memory([(self.arena.addr, arena_bytes, 0, "")], "DRAM")
        except Exception as e:  # nixl raises its own types (nixlBackendError, ...)
            raise CarrierError(f"NIXL agent {self.name} could not start with the UCX backend "
                               f"and register {arena_bytes} bytes: {e}") from e


class NixlSource(_Agent):
    """The prefill worker's side: stages KV payloads in its registered arena for peers to read."""

    def __init__(self, node: int, arena_bytes: int = 64 << 20) -> None:
        super().__init__("prefill", node, arena_bytes)
        self._descriptor = {"agent": self.name, "metadata": self.agent.get_agent_metadata().hex(),
                            "addr": self.arena.addr, "size": arena_bytes}

    def descriptor(self) -> dict[str, Any]:
        """The MANIFEST's ``kv_source``: agent name and metadata, and where its arena lies."""
        return dict(self._descriptor)

    def stage(self, payload: bytes) -> tuple[int, bytes] | None:
        """Copy ``payload`` into the arena: (offset, descriptor bytes), or None when it is full."""
        off = self.arena.alloc(len(payload))
        if off is None:
            return None
        self.arena.buf[off:off + len(payload)] = np.frombuffer(payload, np.uint8)
        return off, DESCRIPTOR.pack(off, len(payload), payload_digest(payload))

    def release(self, regions: list[tuple[int, int]]) -> None:
        """Free (offset, length) regions once the reader is done with them."""
        for off, n in regions:
            self.arena.free(off, n)
        regions.clear()


@dataclass
class Read:
    """One posted READ: where the bytes land here, and what they must hash to."""

    handle: Any
    off: int
    length: int
    digest: bytes
    posted: float


class NixlSink(_Agent):
    """The decode worker's side: reads KV payloads out of prefill agents' arenas into its own."""

    def __init__(self, node: int, arena_bytes: int = 64 << 20, read_timeout: float = 5.0) -> None:
        super().__init__("decode", node, arena_bytes)
        self.read_timeout = read_timeout
        self.remotes: dict[str, dict[str, Any]] = {}  # agent name -> its kv_source

    def connect(self, source: dict[str, Any]) -> str | None:
        """Load a prefill agent's metadata (once per agent). None, or why it cannot be used."""
        name = source["agent"]
        if name in self.remotes:
            return None if self.remotes[name] == source else "kv_source changed for a known agent"
        try:
            loaded = self.agent.add_remote_agent(bytes.fromhex(source["metadata"]))
        except Exception as e:
            return f"cannot load NIXL agent metadata of {name}: {e}"
        if (loaded.decode() if isinstance(loaded, bytes) else loaded) != name:
            return f"NIXL metadata names agent {loaded!r}, the manifest {name!r}"
        self.remotes[name] = source
        return None

    def forget(self, name: str) -> None:
        """Drop a prefill agent whose reads failed (its process is likely gone)."""
        if self.remotes.pop(name, None) is not None:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:
                pass

    def post(self, source: dict[str, Any], descriptor: bytes) -> Read | str | None:
        """Post the READ a descriptor names: a Read, None when this arena is full now (try again
        later), or why the descriptor is refused."""
        if len(descriptor) != DESCRIPTOR.size:
            return f"NIXL descriptor of {len(descriptor)} bytes, expected {DESCRIPTOR.size}"
        remote_off, length, digest = DESCRIPTOR.unpack(descriptor)
        if length < 1 or remote_off + length > source["size"]:
            return "NIXL descriptor outside the prefill agent's arena"
        if length > self.arena.size:
            return f"a KV payload of {length} bytes exceeds this worker's NIXL arena"
        off = self.arena.alloc(length)
        if off is None:
            return None
        try:
            local = self.agent.get_xfer_descs([(self.arena.addr + off, length, 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(source["addr"] + remote_off, length, 0)], "DRAM")
            handle = self.agent.initialize_xfer("READ", local, remote, source["agent"])
            if self.agent.transfer(handle) == "ERR":
                raise CarrierError("transfer posted with state ERR")
        except Exception as e:
            self.arena.free(off, length)
            return f"NIXL READ from {source['agent']} failed: {e}"
        return Read(handle, off, length, digest, time.monotonic())

    def poll(self, read: Read) -> bytes | str | None:
        """The bytes of a finished read (digest checked), None while in flight, or why it failed.
        A finished or failed read's region is given back (a timed-out one is kept: it may still
        land)."""
        try:
            state = self.agent.check_xfer_state(read.handle)
        except Exception as e:
            state = f"ERR ({e})"
        if state == "PROC":
            if time.monotonic() - read.posted < self.read_timeout:
                return None
            return f"NIXL READ not done within {self.read_timeout} s"
        try:
            self.agent.release_xfer_handle(read.handle)
        except Exception:
            pass
        if state != "DONE":
            self.arena.free(read.off, read.length)
            return f"NIXL READ failed: {state}"
        data = self.arena.buf[read.off:read.off + read.length].tobytes()
        self.arena.free(read.off, read.length)
        if payload_digest(data) != read.digest:
            return "NIXL READ brought bytes whose digest differs from the descriptor's"
        return data
