"""Which weights format a file holds, told from its first bytes, never from its name.

    detect_format(path) -> "gguf" | "safetensors" | "unweight"

* GGUF: the file starts with the magic ``GGUF``.
* safetensors: 8 bytes N (little-endian), then a JSON header of N bytes that starts with ``{``
  (the format requires it), N at most ``MAX_HEADER_BYTES`` and 8 + N within the file.
* an Unweight container (reference/codec/FORMAT.md section 6) is a safetensors file whose
  ``__metadata__`` holds the key ``"unweight"``.

Anything else raises ``WeightError`` saying what the file looks like (an empty file, a truncated
header, a PNG, a zip archive, a text file...). Nothing read from the file is trusted: the header
length is checked against the real size before a byte of the header is read.
"""

from __future__ import annotations

from pathlib import Path

from reference import jsonsafe
from reference.model.errors import WeightError
from reference.model.safetensors_io import MAX_HEADER_BYTES

FORMATS = ("gguf", "safetensors", "unweight")
# magic bytes of files people hand over by mistake -> what to call them
OTHER_MAGICS: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"%PDF", "a PDF document"),
    (b"PK\x03\x04", "a zip archive (a PyTorch .pt/.bin checkpoint is one: convert it to "
                    "safetensors)"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"\x28\xb5\x2f\xfd", "a zstd archive"),
    (b"\xfd7zXZ\x00", "an xz archive"),
    (b"BZh", "a bzip2 archive"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (e.g. Keras .h5 weights)"),
    (b"\x93NUMPY", "a NumPy .npy array"),
    (b"\x7fELF", "an ELF executable or library"),
    (b"\x80\x02", "a Python pickle (a PyTorch .bin checkpoint?)"),
    (b"\x80\x03", "a Python pickle (a PyTorch .bin checkpoint?)"),
    (b"\x80\x04", "a Python pickle (a PyTorch .bin checkpoint?)"),
    (b"\x80\x05", "a Python pickle (a PyTorch .bin checkpoint?)"),
)
EXPECTED = "expected a safetensors file, a GGUF file or an Unweight container"


def detect_format(path: str | Path) -> str:
    """The format of the weights file at ``path``: "gguf", "safetensors" or "unweight" (a
    container).

    Raises ``WeightError`` naming the file and what it holds instead when it is none of them."""
    path = Path(path)
    if not path.is_file():
        raise WeightError(f"{path}: no such file" if not path.exists() else f"{path}: not a "
                                                                            "regular file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(16)
        if head.startswith(b"GGUF"):
            return "gguf"
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
        if head[8:9] == b"{" and 2 <= n <= MAX_HEADER_BYTES:
            if 8 + n > size:
                raise WeightError(f"{path}: truncated safetensors file: its header length says {n} "
                                  "bytes "
                                  f"but only {size - 8} follow")
            f.seek(8)
            raw = f.read(n)
        else:
            raise WeightError(f"{path}: not weights: {what_it_is(head, size)} ({EXPECTED})")
    return "unweight" if _marks_container(raw) else "safetensors"


def _marks_container(raw: bytes) -> bool:
    """Does a safetensors header mark its file as a container? A header that does not parse is
    left to the safetensors reader, whose error says exactly what is wrong with it."""
    try:
        header = jsonsafe.loads(raw, what="header")
    except jsonsafe.JsonError:
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and "unweight" in meta


def what_it_is(head: bytes, size: int) -> str:
    """A few words on what a file that is not weights looks like, from its first bytes."""
    if size == 0:
        return "the file is empty"
    if size < 8:
        if b"GGUF".startswith(head[:4]):
            return f"a truncated GGUF file ({size} bytes)"
        return f"only {size} bytes, too short for any weights format"
    for magic, name in OTHER_MAGICS:
        if head.startswith(magic):
            return name
    for cut in range(4):  # the first bytes may end inside a UTF-8 character
        try:
            text = head[: len(head) - cut].decode("utf-8")
            break
        except UnicodeDecodeError:
            continue
    else:
        return "unrecognised binary data"
    if all(c.isprintable() or c in "\r\n\t" for c in text):
        return "a JSON text file" if text.lstrip().startswith(("{", "[")) else "a text file"
    return "unrecognised binary data"
