"""Routing properties: prefix affinity wins, then load; the remembered keys stay bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from reference.disagg import routing
from reference.disagg.routing import Worker, affinity, choose_decode, choose_prefill
from reference.kv.prefix_hash import prefix_keys


def workers(loads: list[int], role: str = "prefill") -> list[Worker]:
    return [Worker(node=i + 1, role=role, link=None, block_size=4, num_blocks=64, inflight_tokens=load)
            for i, load in enumerate(loads)]


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=6), st.lists(st.integers(0, 50), min_size=4, max_size=40),
       st.data())
def test_prefill_prefers_the_longest_cached_prefix_then_the_least_load(loads, prompt, data):
    ws = workers(loads)
    keys = prefix_keys(prompt, 4)
    chosen = choose_prefill(ws, keys)
    assert chosen.inflight_tokens == min(loads)  # no affinity yet: least loaded
    assert affinity(chosen, keys) == len(keys)
    if keys:  # the same prompt again: the worker that has its prefix, whatever the others' loads
        chosen.inflight_tokens = max(loads) + data.draw(st.integers(0, 100))
        again = choose_prefill(ws, keys)
        ties = [w for w in ws if affinity(w, keys) == len(keys)]
        assert again in ties


@given(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 64)), min_size=1, max_size=6))
def test_decode_prefers_least_load_then_most_free_blocks(specs):
    ws = workers([load for load, _ in specs], role="decode")
    for w, (_, free) in zip(ws, specs, strict=True):
        w.free_blocks = free
    chosen = choose_decode(ws)
    assert (chosen.inflight_tokens, -chosen.free_blocks) == min((w.inflight_tokens, -w.free_blocks) for w in ws)


def test_remembered_keys_are_bounded(monkeypatch):
    monkeypatch.setattr(routing, "RECENT_KEYS", 10)
    (w,) = workers([0])
    for start in range(0, 400, 4):
        choose_prefill([w], prefix_keys(list(range(start, start + 16)), 4))
    assert len(w.recent_keys) == 10
