"""Reads and writes that a hostile file system cannot subvert.

Reads (`read_limited`, `copy_limited`) open local files with O_NOFOLLOW | O_NONBLOCK and refuse
anything but a regular file (a FIFO would hang, a device or /dev/zero would never end, a symlink
may point anywhere), and read at most `limit` bytes; object-store objects are streamed with the same
limit. `open_untrusted` is the one way to open a file kvtc did not just write (the statistics store,
held-out rows, the registry, the pull cache, the store key): regular files only, checked with fstat
before a byte is read, its size known (and limited) first. Writes (`contained_path`) stay under their
root and go through a temp file renamed into place (kvtc.artifacts.local_files.write_outputs), so a
planted symlink, FIFO or hardlink is refused or replaced, never written through.
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


LINKS = ("refuse", "in_folder", "follow")


def open_regular(path: str, what: str, *, links: str = "refuse") -> int:
    """fd of a local regular file, opened without blocking on a FIFO; whatever the path names, only a regular file.

    links: "refuse" a symlink (the default: kvtc's own stores and caches hold none); "in_folder": follow one whose
    target resolves inside the link's own folder (how a Kubernetes Secret or ConfigMap volume mounts a file:
    `key -> ..data/key`), refusing one that points elsewhere with the target to give instead; "follow": follow any
    (a model file the user names, which a hub snapshot links to its blob), the target still a regular file."""
    if links not in LINKS:
        raise ValueError(f"links must be one of {LINKS}, got {links!r}")
    if links == "follow":
        path = os.path.realpath(path)
    elif links == "in_folder" and os.path.islink(path):
        folder = os.path.realpath(os.path.dirname(os.path.abspath(path))).rstrip(os.sep) + os.sep
        target = os.path.realpath(path)
        if not target.startswith(folder):
            raise IntegrityError(f"{what} {path} is a symlink to {target}, outside its own folder; refusing to follow "
                                 f"it: give {target} itself")
        path = target
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


def _contained(path: str, root: str | None, what: str) -> None:
    if root is None:
        return
    real_root = os.path.realpath(root).rstrip(os.sep) + os.sep
    if not os.path.realpath(path).startswith(real_root):
        raise IntegrityError(f"{what} {path} resolves outside {root} (a symlinked folder?); refusing it")


def open_untrusted(fs: Any, local: bool, path: str, what: str, *, limit: int | None = None,
                   root: str | None = None, links: str = "refuse") -> tuple[BinaryIO, int]:
    """(open binary handle, size) of a regular file or object: the one way kvtc opens a file it did not just
    write. Local: opened with O_NOFOLLOW | O_NONBLOCK and checked with fstat (a FIFO never blocks, a
    device, directory or symlink is refused), and, with `root`, refused when its folders resolve outside
    root. Object stores: its listing must say "file". With `limit`, a larger file is refused before a
    byte of it is read. IntegrityError names the path; FileNotFoundError when it is absent. `links`: as
    `open_regular`'s."""
    if local:
        _contained(path, root, what)
        fd = open_regular(path, what, links=links)
        size = os.fstat(fd).st_size
        handle: BinaryIO = os.fdopen(fd, "rb")
    else:
        info = fs.info(path)
        if info.get("type") not in (None, "file"):
            raise IntegrityError(f"{what} {path} is a {info.get('type')}, not a file; refusing it")
        size = int(info.get("size") or 0)
        handle = None  # opened below, after the size check
    if limit is not None and size > limit:
        if handle is not None:
            handle.close()
        raise _too_big(what, path, limit)
    return (handle if handle is not None else fs.open(path, "rb", block_size=_CHUNK)), size


def _open(fs: Any, local: bool, path: str, what: str, limit: int | None = None, links: str = "refuse") -> BinaryIO:
    return open_untrusted(fs, local, path, what, limit=limit, links=links)[0]


def read_limited(fs: Any, local: bool, path: str, limit: int, what: str, *, links: str = "refuse") -> bytes:
    """The bytes of a regular file or object, at most `limit` of them (IntegrityError beyond); `links`: as
    `open_regular`'s."""
    parts: list[bytes] = []
    with _open(fs, local, path, what, limit, links) as source:
        _stream(source, parts.append, limit, what, path)
    return b"".join(parts)


def read_exactly(source: BinaryIO, n: int, what: str, path: str) -> bytes:
    """n bytes from an open handle, read in bounded chunks; IntegrityError when it ends sooner."""
    parts, got = [], 0
    while got < n:
        chunk = source.read(min(_CHUNK, n - got))
        if not chunk:
            raise IntegrityError(f"{what} {path} ends after {got} of its {n} bytes (truncated or replaced); refusing it")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def copy_limited(fs: Any, local: bool, path: str, target: Path, limit: int, what: str) -> int:
    """Stream a regular file or object into a new file `target` (never a symlink), at most `limit` bytes."""
    with _open(fs, local, path, what, limit) as source, _create(target) as sink:
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
