"""ShareGPT parsing: the packaged (truncated) file and hand-made edge cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reference.workload import WorkloadError, iter_sharegpt


def test_packaged_sharegpt_parses_to_its_cut() -> None:
    convs = list(iter_sharegpt())
    assert len(convs) > 10_000  # CLAIMS.md: ~11k complete first-turn pairs
    assert all(c.prompt.strip() and c.answer.strip() for c in convs)
    assert len({c.id for c in convs}) > 0.99 * len(convs)
    assert [c.id for c in iter_sharegpt(limit=5)] == [c.id for c in convs[:5]]


def _conv(i: int, first: str = "human", second: str = "gpt", prompt: str = "q", answer: str = "a") -> dict:
    return {"id": f"c{i}", "conversations": [{"from": first, "value": prompt}, {"from": second, "value": answer}]}


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_truncated_file_small_chunks_and_filtering(tmp_path: Path, chunk: int) -> None:
    items = [_conv(0), _conv(1, first="gpt"), _conv(2, prompt="  "), {"id": "x", "conversations": []},
             _conv(3, answer="a\n" * 50), "junk", _conv(4)]
    text = json.dumps(items, indent=2)
    path = tmp_path / "s.json"
    path.write_text(text[: text.rindex('"c4"')])  # cut inside the last conversation
    got = list(iter_sharegpt(path, chunk_bytes=chunk))
    assert [c.id for c in got] == ["c0", "c3"]
    path.write_text(text)
    assert [c.id for c in iter_sharegpt(path, chunk_bytes=chunk)] == ["c0", "c3", "c4"]


def test_not_an_array(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text('{"a": 1}')
    with pytest.raises(WorkloadError, match="JSON array"):
        list(iter_sharegpt(path))
    path.write_text("")
    with pytest.raises(WorkloadError, match="JSON array"):
        list(iter_sharegpt(path))


def test_garbage_between_objects_is_an_error_not_a_silent_stop(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text('[{"id": "a", "conversations": []}, nonsense, {"id": "b"}]')
    with pytest.raises(WorkloadError, match="malformed JSON after 0 conversations"):
        list(iter_sharegpt(path))
