"""The KV payload: one layer's keys and values for a run of token positions, in a wire dtype.

Payload of a KV frame (little-endian), ``PROTOCOL.md`` section 4:

    layer u16 | wire u8 (0 fp32, 1 bf16, 2 fp8) | 0 u8 | start u32 | count u32
    K values [count, kv_heads, head_dim], then V values, in the wire dtype
    fp8 only: K scale exponents int8 [groups, kv_heads], then V's

fp32 is the cache's own bytes (bit-exact). bf16 rounds to nearest even (``reference/bf16.py``).
fp8 is e4m3 with the reference's scale rule (``reference/kv/fp8.py``): the positions are cut into
groups at block boundaries (position p is in group p // block_size), and each (group, kv-head) gets
the power-of-two scale ``scale_exponent(max |x|)``, so every finite value fits without saturating.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from reference.bf16 import bf16_to_float32, float32_to_bf16
from reference.kv import fp8

KV_HEADER = struct.Struct("<HBBII")
WIRE_CODES = {"fp32": 0, "bf16": 1, "fp8": 2}
WIRE_ITEM_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}


class WireError(ValueError):
    """A KV payload that does not match the stream's layout."""


@dataclass(frozen=True)
class KVLayout:
    """What both ends must agree on before a byte of KV moves."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    wire: str = "fp32"

    def __post_init__(self) -> None:
        if self.wire not in WIRE_CODES:
            raise WireError(f"wire dtype must be one of {sorted(WIRE_CODES)}, got {self.wire!r}")

    @property
    def scale_rule(self) -> str:
        return "pow2-per-block-head" if self.wire == "fp8" else "none"

    def as_message(self) -> dict:
        return {**asdict(self), "scale_rule": self.scale_rule}

    def groups(self, start: int, count: int) -> int:
        """How many blocks the positions [start, start + count) touch (fp8 scale groups)."""
        return (start + count - 1) // self.block_size - start // self.block_size + 1

    def payload_size(self, start: int, count: int) -> int:
        values = 2 * count * self.num_kv_heads * self.head_dim * WIRE_ITEM_BYTES[self.wire]
        scales = 2 * self.groups(start, count) * self.num_kv_heads if self.wire == "fp8" else 0
        return KV_HEADER.size + values + scales


def layout_of(model_config: object, block_size: int, wire: str) -> KVLayout:
    c = model_config
    return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, block_size,
                    wire)  # type: ignore[attr-defined]


def encode_kv(layout: KVLayout, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> bytes:
    """Payload for K, V (float32 [count, kv_heads, head_dim]) of positions [start, start +
    count)."""
    count = len(k)
    parts = [KV_HEADER.pack(layer, WIRE_CODES[layout.wire], 0, start, count)]
    if layout.wire == "fp32":
        parts += [np.ascontiguousarray(x, "<f4").tobytes() for x in (k, v)]
    elif layout.wire == "bf16":
        parts += [
            float32_to_bf16(np.ascontiguousarray(x, np.float32)).astype("<u2").tobytes()
            for x in (k, v)
        ]
    else:
        group = np.arange(start, start + count) // layout.block_size - start // layout.block_size
        exps = []
        for x in (k, v):
            e = np.full((layout.groups(start, count), layout.num_kv_heads), fp8.MIN_SCALE_EXP,
                        np.int32)
            np.maximum.at(e, group, fp8.scale_exponent(fp8.finite_abs_max(x, axis=-1)))
            parts.append(fp8.encode(x, e[group][:, :, None]).tobytes())
            exps.append(e.astype(np.int8).tobytes())
        parts += exps
    return b"".join(parts)


def decode_kv(
    layout: KVLayout, prompt_len: int, payload: bytes
) -> tuple[int, int, np.ndarray, np.ndarray]:
    """(layer, start, K, V) as float32, after checking every field against the layout and the
    prompt."""
    if len(payload) < KV_HEADER.size:
        raise WireError(f"KV payload of {len(payload)} bytes is shorter than its "
                        f"{KV_HEADER.size}-byte header")
    layer, wire, reserved, start, count = KV_HEADER.unpack_from(payload)
    if wire != WIRE_CODES[layout.wire] or reserved:
        raise WireError(f"KV payload wire code {wire} does not match the stream's {layout.wire!r}")
    if layer >= layout.num_layers:
        raise WireError(f"KV payload for layer {layer}; the model has {layout.num_layers}")
    if count < 1 or start + count > prompt_len:
        raise WireError(f"KV payload positions [{start}, {start + count}) outside the prompt of "
                        f"{prompt_len}")
    if len(payload) != layout.payload_size(start, count):
        raise WireError(f"KV payload of {len(payload)} bytes, expected "
                        f"{layout.payload_size(start, count)}")
    shape = (count, layout.num_kv_heads, layout.head_dim)
    n = count * layout.num_kv_heads * layout.head_dim
    off = KV_HEADER.size
    if layout.wire == "fp32":
        k = np.frombuffer(payload, "<f4", n, off).reshape(shape).astype(np.float32)
        v = np.frombuffer(payload, "<f4", n, off + 4 * n).reshape(shape).astype(np.float32)
        return layer, start, k, v
    if layout.wire == "bf16":
        k = bf16_to_float32(np.frombuffer(payload, "<u2", n, off).astype(np.uint16)).reshape(shape)
        v = bf16_to_float32(np.frombuffer(payload, "<u2", n,
                                          off + 2 * n).astype(np.uint16)).reshape(shape)
        return layer, start, k, v
    groups = layout.groups(start, count)
    group = np.arange(start, start + count) // layout.block_size - start // layout.block_size
    e_off = off + 2 * n
    out = []
    for i in range(2):
        codes = np.frombuffer(payload, np.uint8, n, off + i * n).reshape(shape)
        exps = (
            np.frombuffer(
                payload,
                np.int8,
                groups * layout.num_kv_heads,
                e_off + i * groups * layout.num_kv_heads,
            )
            .reshape(groups, -1)
            .astype(np.int32)
        )
        if exps.min() < fp8.MIN_SCALE_EXP or exps.max() > fp8.MAX_SCALE_EXP:
            raise WireError(
                f"fp8 scale exponent outside [{fp8.MIN_SCALE_EXP}, {fp8.MAX_SCALE_EXP}]"
            )
        out.append(fp8.decode(codes, exps[group][:, :, None]))
    return layer, start, out[0], out[1]


def model_digest(config: object, weights: object) -> str:
    """BLAKE2b-256 (hex) of the config and every weight array: both ends must run the same model."""
    h = hashlib.blake2b(digest_size=32, person=b"unfire-model-v1")
    text = json.dumps(asdict(config), sort_keys=True, default=str)  # type: ignore[call-overload]
    h.update(text.encode())
    arrays = [weights.embedding, weights.final_norm, weights.lm_head]  # type: ignore[attr-defined]
    for layer in weights.layers:  # type: ignore[attr-defined]
        arrays += [layer.attn_norm, layer.wq, layer.wk, layer.wv, layer.wo, layer.mlp_norm,
                   layer.w_gate, layer.w_up, layer.w_down]
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def kv_digest(cache: object, block_table: Sequence[int], length: int) -> str:
    """BLAKE2b-256 (hex) of K and V of positions [0, length) in every layer, as float32 bytes.

    The prefill worker puts it in DONE; with fp32 on the wire the decode worker computes it over its
    own cache (received positions and its own cached prefix) and must get the same value.
    """
    steps = kv_digest_by_layer(cache, block_table, length)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def kv_digest_by_layer(cache: object, block_table: Sequence[int],
                       length: int) -> Generator[None, None, str]:
    """``kv_digest`` one layer at a time: it pauses after each layer (so a worker can run a step
    between them); the digest is the generator's return value."""
    h = hashlib.blake2b(digest_size=32, person=b"unfire-kvdig-v1")
    for layer in range(cache.num_layers):  # type: ignore[attr-defined]
        k, v = cache.read(layer, block_table, length)  # type: ignore[attr-defined]
        h.update(np.ascontiguousarray(k, "<f4").tobytes())
        h.update(np.ascontiguousarray(v, "<f4").tobytes())
        yield
    return h.hexdigest()
