"""Writing files so that nothing is lost: an output appears whole or not at all, and temporary
files never outlive the command that made them, however it ends.

``atomic_output(path)`` writes through a temporary file beside ``path`` and renames it at the end.
``signals_raise()`` turns SIGINT, SIGTERM and SIGHUP into an exception, ``Interrupted``, so that
clean-up code runs. ``temporary_file(...)`` makes a temporary file and records it before such a
signal can interrupt, so a command line can call ``remove_temporary_files()`` on the way out and
leave no stray file, even when the signal came between the file's creation and the ``try`` that
would have removed it.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

_LIVE: set[Path] = set()  # temporary files of this process, not yet renamed or removed
_SIGNALS = [getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n)]
# a signal that came while a temporary file was being made
_creating = {"now": False, "pending": None}


class Interrupted(BaseException):
    """A signal arrived (inside ``signals_raise``): unwinds the stack like Ctrl-C, so every
    ``finally`` and ``with`` removes its files."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int) -> None:
    for s in _SIGNALS:  # later signals are ignored: the clean-up this one starts is not cut short
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def _handler(signum: int, frame: object) -> None:
    if _creating["now"]:  # between mkstemp and recording its name: wait until it is recorded
        _creating["pending"] = signum
        return
    _interrupt(signum)


@contextmanager
def signals_raise() -> Iterator[None]:
    """While inside, SIGINT, SIGTERM and SIGHUP raise ``Interrupted`` (only the main thread can set
    handlers: elsewhere this does nothing). The old handlers come back on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _handler) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _creating.update(now=False, pending=None)


def temporary_file(directory: Path, prefix: str, suffix: str) -> tuple[int, Path]:
    """A new private file in ``directory`` (``tempfile.mkstemp``), recorded until ``discard``; a
    signal that comes while it is made is raised only once it is recorded."""
    _creating["now"] = True
    try:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
        _LIVE.add(Path(name))
    finally:
        _creating["now"] = False
    pending, _creating["pending"] = _creating["pending"], None
    if pending is not None:
        _interrupt(pending)
    return fd, Path(name)


def discard(path: Path, *, remove: bool = True) -> None:
    """Forget a temporary file (it was renamed into place), removing it first if ``remove``."""
    if remove:
        path.unlink(missing_ok=True)
    _LIVE.discard(path)


def remove_temporary_files() -> None:
    """Remove every temporary file this process still has (for an interrupted command line)."""
    for path in list(_LIVE):
        discard(path)


@contextmanager
def atomic_output(path: str | Path) -> Iterator[BinaryIO]:
    """A file to write ``path`` through: it appears complete under ``path`` or not at all.

    The bytes go to a fresh temporary file in the same directory (so the rename stays on one file
    system), are flushed to disk (fsync), and only then renamed over ``path`` (``os.replace``,
    atomic on POSIX). On any exception, KeyboardInterrupt and SystemExit included, the temporary
    file is removed and whatever was under ``path`` before stays as it was.
    """
    path = Path(path)
    fd, tmp = temporary_file(path.parent, f".{path.name}.", ".tmp")
    try:
        umask = os.umask(0o022)  # mkstemp makes the file private (0600): give it the usual mode
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        discard(tmp, remove=False)
    except BaseException:
        discard(tmp)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def write_text(path: str | Path, text: str) -> None:
    """``Path(path).write_text(text)`` (UTF-8) through ``atomic_output``: a results file, say, is
    replaced whole or not at all, so an interrupted run never leaves the stored one half-written."""
    with atomic_output(path) as f:
        f.write(text.encode("utf-8"))
