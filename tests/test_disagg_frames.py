"""The handoff's bytes: frames, control payloads, KV payloads. Whatever a peer sends, the receiver
either gets exactly what was sent or refuses it with the module's own error, never anything else."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.bf16 import bf16_to_float32, float32_to_bf16
from reference.disagg import messages
from reference.disagg.frames import HEADER_SIZE, VERSION, FrameError, Kind, ReplayGuard, decode_frame, encode_frame
from reference.disagg.messages import MessageError
from reference.disagg.transport import Link, SocketEndpoint, connect, listen, pipe
from reference.disagg.wire import KVLayout, WireError, decode_kv, encode_kv
from reference.kv import fp8

SECRET = b"k" * 32
kinds = st.sampled_from(list(Kind))


def frame_bytes(payload: bytes = b"hello", kind: Kind = Kind.KV, seq: int = 0) -> bytes:
    return encode_frame(kind=kind, src=3, stream=7, seq=seq, payload=payload, secret=SECRET)


@given(kinds, st.integers(0, 65535), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.binary(max_size=300))
def test_frame_roundtrip(kind, src, stream, seq, payload):
    f = decode_frame(encode_frame(kind=kind, src=src, stream=stream, seq=seq, payload=payload, secret=SECRET), SECRET)
    assert (f.kind, f.src, f.stream, f.seq, f.payload) == (kind, src, stream, seq, payload)


@given(st.binary(min_size=0, max_size=200), st.data())
def test_any_flipped_bit_is_refused(payload, data):
    raw = bytearray(frame_bytes(payload))
    bit = data.draw(st.integers(0, len(raw) * 8 - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(FrameError):
        decode_frame(bytes(raw), SECRET)


@given(st.binary(max_size=200), st.data())
def test_truncated_or_extended_frame_is_refused(payload, data):
    raw = frame_bytes(payload)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(FrameError):
        decode_frame(raw[:cut], SECRET)
    with pytest.raises(FrameError):
        decode_frame(raw + b"\0", SECRET)


@given(st.binary(max_size=400))
def test_random_bytes_never_crash_the_decoder(data):
    with pytest.raises(FrameError):
        decode_frame(data, SECRET)


def test_refusals_name_the_problem():
    raw = frame_bytes()
    with pytest.raises(FrameError, match="authentication"):
        decode_frame(raw, b"other secret")
    other_version = raw[:4] + bytes([VERSION + 1]) + raw[5:]
    with pytest.raises(FrameError, match="version 2 is not supported"):
        decode_frame(other_version, SECRET)
    with pytest.raises(FrameError, match="bad magic"):
        decode_frame(b"XXXX" + raw[4:], SECRET)
    huge = bytearray(raw)
    huge[20:24] = (2**32 - 1).to_bytes(4, "little")
    with pytest.raises(FrameError, match="exceeds the limit"):
        decode_frame(bytes(huge), SECRET)


@given(st.lists(st.integers(0, 300), max_size=200), st.randoms())
def test_replay_guard_accepts_each_seq_once_in_any_order(seqs, rnd):
    guard = ReplayGuard(window=1000)
    rnd.shuffle(seqs)
    accepted = [s for s in seqs if guard.accept(1, s)]
    assert sorted(accepted) == sorted(set(seqs))


def test_link_refuses_duplicates_and_other_secrets():
    a, b = pipe()
    sender, receiver = Link(a, SECRET, node=1), Link(b, SECRET, node=2)
    sender.send(Kind.TOKEN, 5, b"{}")
    _, raw = b.inbox.get_nowait()
    assert receiver.accept(raw) is not None
    assert receiver.accept(raw) is None and receiver.counters["frames_duplicate"] == 1
    stranger = Link(a, b"x" * 32, node=1)
    stranger.send(Kind.TOKEN, 5, b"{}")
    assert receiver.accept(b.inbox.get_nowait()[1]) is None and receiver.counters["frames_refused"] == 1


# -- control payloads ------------------------------------------------------------------------------

GOOD_ACK = {"of": "manifest", "cached_tokens": 16}


def test_control_payload_roundtrip_and_strictness():
    assert messages.load(Kind.ACK, messages.dump(Kind.ACK, GOOD_ACK)) == GOOD_ACK
    for bad in ({**GOOD_ACK, "extra": 1}, {"of": "manifest"}, {**GOOD_ACK, "cached_tokens": -1},
                {**GOOD_ACK, "cached_tokens": True}, {**GOOD_ACK, "of": "nonsense"}, [1, 2]):
        with pytest.raises(MessageError):
            messages.load(Kind.ACK, json.dumps(bad).encode())
    with pytest.raises(MessageError, match="unexpected fields"):
        messages.dump(Kind.ACK, {**GOOD_ACK, "extra": 1})


@given(kinds, st.binary(max_size=200))
def test_random_control_payloads_raise_message_error_only(kind, payload):
    try:
        messages.load(kind, payload)
    except MessageError:
        pass


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=12)


@given(kinds, st.dictionaries(st.sampled_from(["id", "prompt", "of", "layout", "reason", "action", "index", "x"]),
                              json_values, max_size=6))
def test_random_json_objects_raise_message_error_only(kind, body):
    try:
        messages.load(kind, json.dumps(body).encode())
    except MessageError:
        pass


# -- KV payloads -----------------------------------------------------------------------------------

def kv(count: int, seed: int = 0, heads: int = 2, dim: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    scale = np.float32(10.0) ** rng.integers(-3, 3, size=(count, heads, 1))
    return ((rng.standard_normal((2, count, heads, dim)) * scale).astype(np.float32))


@given(st.integers(0, 40), st.integers(1, 30), st.integers(0, 1000))
def test_kv_payload_roundtrip_per_wire_dtype(start, count, seed):
    k, v = kv(count, seed)
    for wire in ("fp32", "bf16", "fp8"):
        layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=8, wire=wire)
        payload = encode_kv(layout, 2, start, k, v)
        assert len(payload) == layout.payload_size(start, count)
        layer, s, k2, v2 = decode_kv(layout, start + count, payload)
        assert (layer, s) == (2, start)
        if wire == "fp32":
            assert k2.tobytes() == k.tobytes() and v2.tobytes() == v.tobytes()
        elif wire == "bf16":
            assert np.array_equal(k2, bf16_to_float32(float32_to_bf16(k)))
        else:  # each (block, head) has its own power-of-two scale: the fp8 module's rule
            blocks = (start + np.arange(count)) // 8
            for b in np.unique(blocks):
                rows = blocks == b
                e = fp8.scale_exponent(fp8.finite_abs_max(k[rows], axis=(0, 2)))[None, :, None]
                assert np.array_equal(k2[rows], fp8.decode(fp8.encode(k[rows], e), e))


def test_kv_payload_refusals():
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=8, wire="fp32")
    k, v = kv(5)
    good = encode_kv(layout, 1, 10, k, v)
    with pytest.raises(WireError, match="outside the prompt"):
        decode_kv(layout, 12, good)
    with pytest.raises(WireError, match="layer 3"):
        decode_kv(layout, 20, encode_kv(layout, 3, 10, k, v))
    with pytest.raises(WireError, match="bytes, expected"):
        decode_kv(layout, 20, good[:-1])
    with pytest.raises(WireError, match="wire code"):
        decode_kv(KVLayout(3, 2, 4, 8, "bf16"), 20, good)


@given(st.binary(max_size=300), st.sampled_from(["fp32", "bf16", "fp8"]))
def test_random_kv_payloads_raise_wire_error_only(payload, wire):
    try:
        decode_kv(KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=8, wire=wire), 64, payload)
    except WireError:
        pass


# -- sockets ---------------------------------------------------------------------------------------

def test_socket_link_carries_frames_and_closes_on_garbage():
    server = listen()
    try:
        client = connect(server.getsockname()[1])
        conn, _ = server.accept()
        peer = SocketEndpoint(conn)
        for i in range(3):
            client.send(frame_bytes(bytes([i]) * 1000, seq=i))
        got = [peer.inbox.get(timeout=5)[1] for _ in range(3)]
        assert [decode_frame(g, SECRET).seq for g in got] == [0, 1, 2]
        client.sock.sendall(b"NOT A FRAME, JUST BYTES....." * 2)  # a header that fails: the link closes
        assert peer.inbox.get(timeout=5)[1] is None
        assert "not a frame" in (peer.error or "")
        client.close()
        peer.close()
    finally:
        server.close()


def test_socket_link_reports_a_peer_that_hangs_up_mid_frame():
    server = listen()
    try:
        raw = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        peer = SocketEndpoint(conn)
        raw.sendall(frame_bytes(b"x" * 100)[:HEADER_SIZE + 10])
        time.sleep(0.05)
        raw.close()
        assert peer.inbox.get(timeout=5)[1] is None
        peer.close()
    finally:
        server.close()
