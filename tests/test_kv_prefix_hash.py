"""Prefix-cache keys: the written spec, determinism, chaining, salts."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.kv import ROOT_KEY, KVCacheError, block_key, prefix_keys


def spec_key(parent: bytes, tokens: list[int], salt: str | None) -> bytes:
    """The key exactly as prefix_hash's docstring writes it down, computed independently."""
    salt_b = (salt or "").encode()
    data = parent + struct.pack("<I", len(salt_b)) + salt_b + b"".join(struct.pack("<q", t) for t in tokens)
    return hashlib.blake2b(data, digest_size=16, person=b"unfire-kv-v1").digest()


@given(st.lists(st.integers(0, 2**40), max_size=40), st.integers(1, 8), st.none() | st.text(max_size=8))
def test_keys_follow_the_written_spec(tokens, block_size, salt):
    parent, want = ROOT_KEY, []
    for i in range(len(tokens) // block_size):
        parent = spec_key(parent, tokens[i * block_size:(i + 1) * block_size], salt)
        want.append(parent)
    assert prefix_keys(tokens, block_size, salt) == want


def test_keys_are_the_same_in_another_process():
    code = "from reference.kv import prefix_keys; print(prefix_keys(list(range(64)), 16, 'acme')[-1].hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=Path(__file__).parents[1]).stdout.strip()
    assert out == prefix_keys(list(range(64)), 16, "acme")[-1].hex()


@given(st.lists(st.integers(0, 3), min_size=4, max_size=24), st.lists(st.integers(0, 3), min_size=4, max_size=24))
def test_equal_keys_iff_equal_prefixes(a, b):
    ka, kb = prefix_keys(a, 4), prefix_keys(b, 4)
    for i in range(min(len(ka), len(kb))):
        assert (ka[i] == kb[i]) == (a[:4 * (i + 1)] == b[:4 * (i + 1)])


@given(st.lists(st.integers(0, 100), min_size=4, max_size=16), st.text(min_size=1, max_size=6))
def test_salts_separate_tenants(tokens, tenant):
    plain, salted, other = prefix_keys(tokens, 4), prefix_keys(tokens, 4, tenant), prefix_keys(tokens, 4, tenant + "x")
    assert all(p != s and s != o for p, s, o in zip(plain, salted, other, strict=True))
    assert prefix_keys(tokens, 4, "") == plain  # no salt and the empty salt are the same


def test_bad_inputs():
    with pytest.raises(KVCacheError, match="int64"):
        block_key(ROOT_KEY, [2**63])
    with pytest.raises(KVCacheError, match="parent key"):
        block_key(b"short", [1])
    with pytest.raises(KVCacheError, match="block_size"):
        prefix_keys([1, 2], 0)
    assert prefix_keys([1, 2, 3], 4) == []
