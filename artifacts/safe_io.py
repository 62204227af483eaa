"""Reads and writes that a hostile file system cannot subvert.

Reads (`read_limited`, `copy_limited`) open local files with O_NOFOLLOW | O_NONBLOCK and refuse
anything but a regular file (a FIFO would hang, a device or /dev/zero would never end, a symlink
may point anywhere), and read at most `limit` bytes; object-store objects are streamed with the same
limit. Writes (`write_contained`) stay under their root: the path is checked with symlinks resolved
and the file is opened with O_NOFOLLOW, so a planted symlink is refused, never followed.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from kvtc.artifacts.errors import IntegrityError

SMALL_FILE = 64 << 10        # aliases, digest files, signatures, claims
MANIFEST_LIMIT = 64 << 20    # a manifest.json (its listing names every file)
_CHUNK = 1 << 20
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str, what: str) -> int:
    """fd of a local regular file, opened without following a symlink or blocking on a FIFO."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            raise exc from None
        raise IntegrityError(f"{what} {path} is {_kind(mode)}, not a regular file; refusing it") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise IntegrityError(f"{what} {path} is {_kind(mode)}, not a regular file; refusing it")
    return fd


def _too_big(what: str, path: str, limit: int) -> IntegrityError:
    return IntegrityError(f"{what} {path} holds more than the {limit} bytes allowed for it (replaced or "
                          "tampered); refusing it")


def _stream(source: BinaryIO, sink: Any, limit: int, what: str, path: str) -> int:
    total = 0
    while True:
        chunk = source.read(min(_CHUNK, limit + 1 - total))
        if not chunk:
            return total
        total += len(chunk)
        if total > limit:
            raise _too_big(what, path, limit)
        sink(chunk)


def _open(fs: Any, local: bool, path: str, what: str) -> BinaryIO:
    if local:
        return os.fdopen(open_regular(path, what), "rb")
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise
    if info.get("type") not in (None, "file"):
        raise IntegrityError(f"{what} {path} is a {info.get('type')}, not a file; refusing it")
    return fs.open(path, "rb", block_size=_CHUNK)


def read_limited(fs: Any, local: bool, path: str, limit: int, what: str) -> bytes:
    """The bytes of a regular file or object, at most `limit` of them (IntegrityError beyond)."""
    parts: list[bytes] = []
    with _open(fs, local, path, what) as source:
        _stream(source, parts.append, limit, what, path)
    return b"".join(parts)


def copy_limited(fs: Any, local: bool, path: str, target: Path, limit: int, what: str) -> int:
    """Stream a regular file or object into a new file `target` (never a symlink), at most `limit` bytes."""
    with _open(fs, local, path, what) as source, _create(target) as sink:
        return _stream(source, sink.write, limit, what, path)


def _create(path: Path) -> BinaryIO:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.fdopen(os.open(path, flags, 0o666), "wb")
    except OSError as exc:
        if os.path.islink(path):
            raise IntegrityError(f"{path} is a symlink; refusing to write through it") from None
        raise exc


def contained_path(root: str | os.PathLike, rel: str) -> Path:
    """root / rel for a relative path of plain segments that, symlinks resolved, stays under root."""
    parts = str(rel).split("/")
    if str(rel).startswith("/") or any(p in ("", ".", "..") or "\0" in p or "\\" in p for p in parts):
        raise IntegrityError(f"unsafe file path {rel!r}; refusing it")
    path = Path(root, *parts)
    real_root = os.path.realpath(root)
    if not os.path.realpath(path).startswith(real_root.rstrip(os.sep) + os.sep):
        raise IntegrityError(f"{rel!r} resolves outside {root} (a symlink?); refusing to write it")
    return path


def write_contained(root: str | os.PathLike, rel: str, data: bytes) -> Path:
    """Write `data` to root / rel (parents created), refusing to leave root or to follow a symlink."""
    os.makedirs(root, exist_ok=True)
    path = contained_path(root, rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    path = contained_path(root, rel)  # a parent created meanwhile is checked again
    with _create(path) as handle:
        handle.write(data)
    return path
