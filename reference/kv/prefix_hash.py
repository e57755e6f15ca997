"""Prefix-cache keys: a deterministic hash chain over full blocks of token ids.

The key of block ``i`` of a sequence is

    key_i = BLAKE2b-128( key_{i-1} || len(salt) as u32 LE || salt (UTF-8) || token ids as i64 LE )

with ``key_{-1} = ROOT_KEY`` (16 zero bytes). Because each key folds in its parent's key, equal keys
mean equal *whole prefixes*, not just equal blocks: two sequences share block ``i`` only if they
agree on every token up to the end of block ``i``. The salt (e.g. a tenant id) separates tenants:
different salts give unrelated keys, so tenants never see each other's cached blocks. No salt and
the empty salt are the same. The hash is ``hashlib.blake2b``, never Python's ``hash()``, so keys are
the same in every process and on every machine (the fast path reuses this code).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from reference.kv.errors import KVCacheError

ROOT_KEY = bytes(16)  # the parent key of a sequence's first block
KEY_BYTES = 16
_PERSON = b"unfire-kv-v1"  # BLAKE2 personalization: keys never collide with other BLAKE2 uses
# copied for each key, never updated itself
_HASHER = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON)
# block length -> its int64 packer (one or two lengths in practice)
_PACKERS: dict[int, struct.Struct] = {}


def block_key(parent_key: bytes, token_ids: Sequence[int], salt: str | None = None) -> bytes:
    """The 16-byte cache key of one full block, chained from its parent's key."""
    if len(parent_key) != KEY_BYTES:
        raise KVCacheError(f"parent key must be {KEY_BYTES} bytes, got {len(parent_key)}")
    salt_bytes = (salt or "").encode("utf-8")
    packer = _PACKERS.get(len(token_ids))
    if packer is None:
        packer = _PACKERS[len(token_ids)] = struct.Struct(f"<{len(token_ids)}q")
    try:
        tokens = packer.pack(*token_ids)
    except struct.error as e:
        raise KVCacheError(f"token ids must be integers that fit in int64: {e}") from None
    # a copy of a ready hasher: cheaper than setting up BLAKE2b's parameters per block
    h = _HASHER.copy()
    h.update(parent_key + struct.pack("<I", len(salt_bytes)) + salt_bytes + tokens)
    return h.digest()


def prefix_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """Keys of every full block of ``token_ids`` (a trailing partial block has no key)."""
    if block_size < 1:
        raise KVCacheError(f"block_size must be >= 1, got {block_size}")
    keys: list[bytes] = []
    parent = ROOT_KEY
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start:start + block_size], salt)
        keys.append(parent)
    return keys
