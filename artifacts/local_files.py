"""Local files: the one cache root, the one atomic write, the one staged folder and the one file hash
every part of kvtc uses.

Every file the CLI writes for a user (export, report, pull --to, keygen) goes through `write_outputs`:
temp files in the target folder renamed into place, so nothing planted there is written through, and
a multi-file output is whole or absent. A folder that must appear whole (a published version, a pulled
one, a converted model) is filled in a staging folder and renamed into place (`stage_folder`)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Mapping, TypeVar

from kvtc.artifacts.errors import IntegrityError
from kvtc.artifacts.safe_io import contained_path

T = TypeVar("T")


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


def stage_folder(final: str | os.PathLike, fill: Callable[[Path], T], staging: str | os.PathLike | None = None,
                 taken: Callable[[OSError], bool] | None = None) -> T:
    """Make folder `final` whole or not at all: `fill(folder)` writes into a fresh staging folder (`staging`,
    else a temp folder beside `final`), which is then renamed to `final`; the staging folder is removed
    whatever happens. When the rename fails (`final` exists: a concurrent writer won), `taken(error)`
    says whether that is fine (True) or raises its own error; without it the error propagates.
    Returns what `fill` returned."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if staging is None:
        folder = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    else:
        folder = Path(staging)
        folder.mkdir(parents=True)
    try:
        result = fill(folder)
        try:
            os.rename(folder, final)
        except OSError as exc:
            if taken is None or not taken(exc):
                raise
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def sha256_handle(handle: BinaryIO, chunk: int = 1 << 22) -> str:
    """Hex sha256 of what is left to read in an open binary file."""
    digest = hashlib.sha256()
    for block in iter(lambda: handle.read(chunk), b""):
        digest.update(block)
    return digest.hexdigest()


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


def _check_target(path: Path, overwrite: bool) -> None:
    """Refuse a target that is a symlink, FIFO, device or directory (and, without overwrite, anything)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not overwrite:
        raise FileExistsError(f"{path} already exists; choose another name (it is never overwritten)")
    if not stat.S_ISREG(mode):
        kind = ("a symlink" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a directory" if stat.S_ISDIR(mode) else "a special file")
        raise IntegrityError(f"{path} is {kind}; refusing to write through it (remove it, or choose another folder)")


def write_outputs(root: str | os.PathLike, files: Mapping[str, bytes], *, overwrite: bool = True,
                  modes: Mapping[str, int] | None = None) -> list[Path]:
    """Write `files` ({path relative to root: bytes}) into `root`, all of them or none: every target is
    checked first (contained in root with symlinks resolved; a symlink, FIFO, device or directory there is
    refused, IntegrityError), each is written to a temp file in its own folder and fsynced, then all are
    renamed into place, so a file planted there (a hardlink included) is replaced, never written through,
    and a failure before the renames leaves the folder as it was. overwrite=False refuses any existing
    target (FileExistsError; link(2), so no race clobbers one). modes: a file's mode instead of the umask's."""
    os.makedirs(root, exist_ok=True)
    targets = []
    for rel in files:
        path = contained_path(root, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path = contained_path(root, rel)  # a parent created meanwhile is checked again
        _check_target(path, overwrite)
        targets.append(path)
    staged: list[str] = []
    placed: list[Path] = []
    try:
        for path, data in zip(targets, files.values()):
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            staged.append(tmp)
            mode = (modes or {}).get(str(os.path.relpath(path, root)).replace(os.sep, "/"))
            os.fchmod(fd, mode if mode is not None else 0o666 & ~process_umask())
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        for path, tmp in zip(targets, staged):
            if overwrite:
                _check_target(path, True)
                os.replace(tmp, path)
            else:
                os.link(tmp, path)
                os.unlink(tmp)
            placed.append(path)
    except BaseException:
        for tmp in staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if not overwrite:  # no-clobber: what this call created goes again, so it is all or nothing
            for path in placed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        raise
    return targets


class Outputs:
    """One output folder's files, collected (`add`) and written whole or not at all (`commit`, write_outputs)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.files: dict[str, bytes] = {}

    def add(self, rel: str, data: bytes) -> Path:
        """Queue `data` for root / rel; -> that path (written on commit)."""
        self.files[rel] = bytes(data)
        return self.root / rel

    def commit(self) -> list[Path]:
        return write_outputs(self.root, self.files)
