"""``write_text``: results files are replaced whole or not at all."""

from pathlib import Path

import pytest

from reference.safe_write import write_text


def test_write_text_writes_utf8_like_path_write_text(tmp_path: Path) -> None:
    write_text(tmp_path / "a.json", '{"µ": 1}\n')
    (tmp_path / "b.json").write_text('{"µ": 1}\n', encoding="utf-8")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


class Interrupting(str):
    def encode(self, *args: object, **kwargs: object) -> bytes:
        raise KeyboardInterrupt


def test_an_interrupted_write_keeps_the_stored_file(tmp_path: Path) -> None:
    path = tmp_path / "E5.json"
    path.write_text("stored result\n")
    with pytest.raises(KeyboardInterrupt):
        write_text(path, Interrupting("new result\n"))
    assert path.read_text() == "stored result\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["E5.json"]
