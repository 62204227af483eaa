"""Local files: the one cache root and the one atomic write every part of kvtc uses."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where kvtc caches pulled artifacts, converted models and shard statistics: `cache_dir`, else
    $KVTC_CACHE, else ~/.cache/kvtc."""
    return Path(cache_dir or os.environ.get("KVTC_CACHE") or Path.home() / ".cache" / "kvtc").expanduser()


def process_umask() -> int:
    """The umask, read without changing it where the OS allows (os.umask(0) would race other threads)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def atomic_write(target: str | os.PathLike, data: bytes | Callable[[BinaryIO], int | None]) -> int:
    """Write a local file whole or not at all: a temp file beside it (created with the process umask;
    mkstemp alone would leave 0600), fsync, rename over `target`. `data`: the bytes, or a function
    that writes them to the open file. Returns the bytes written."""
    target = os.fspath(target)
    folder = os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~process_umask())
        with os.fdopen(fd, "wb") as handle:
            if callable(data):
                data(handle)
            else:
                handle.write(data)
            handle.flush()
            size = handle.tell()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        return size
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
