"""Content-addressed cache of per-shard results, on a local directory or any fsspec URI.

A shard's entry is named by what determines it: the model fingerprint, the capture settings
and the shard id (itself a hash of the shard's tokens). Entries are written whole (stage then
rename on local disks; one PUT on object stores), so a crash leaves either the entry or nothing,
and a rerun processes only the shards that are missing.

Layout: ``<root>/<model fingerprint id>/<capture key>/<shard id>.rows.safetensors`` (held-out
shards: a capped sample of captured rows with their positions) and
``<root>/<model fingerprint id>/<capture key>/acc/<accumulator>.stats`` (training statistics: one
running total per accumulator with the ids of the shards folded into it, in fold order; see
`kvtc.pipeline.job.accumulators`). Statistics objects carry a sha256 per tensor, and their footer
is authenticated with an HMAC-SHA256 under the store's key ``<root>/.store-key`` (32 random bytes,
created once, mode 0600 on a local disk): an object forged or edited without the key fails. Held-out
rows carry an HMAC of their tensors and metadata in their own metadata. Any object that cannot be
read (forged, corrupt, bad JSON, a dtype or shape that does not fit its bytes) is moved aside as
``<name>.corrupt`` with its name in the error, so the next run recomputes it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sys
import time
import uuid
from dataclasses import dataclass
from typing import BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem
import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from kvtc.artifacts.errors import IntegrityError
from kvtc.artifacts.local_files import atomic_write, cache_root
from kvtc.artifacts.safe_io import open_untrusted, read_exactly
from kvtc.workers.stats import CalibrationStats
from kvtc.workers.stats_file import CorruptStats, read_footer, read_tensor, write_stats

KINDS = ("rows",)
ACC_DIR = "acc"
KEY_FILE = ".store-key"
_KEY_BYTES = 32
_KEYS: dict[str, bytes] = {}  # per store root, loaded once per process
_ROWS_HEADER_LIMIT = 1 << 26  # a held-out rows entry's safetensors header (JSON of three tensors)
BINDING = "kvtc_object"  # a basis object's footer metadata: what it is bound to (`ShardStore.basis_binding`)


def _data_end(header: bytes, uri: str) -> int:
    """The byte length of a safetensors entry's data, as its header's tensor offsets describe it."""
    try:
        entries = json.loads(header)
        ends = [v["data_offsets"][1] for k, v in entries.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise IntegrityError(f"shard entry {uri} has an unreadable header ({type(exc).__name__}: {exc})") from None
    if any(not isinstance(e, int) or isinstance(e, bool) or e < 0 for e in ends):
        raise IntegrityError(f"shard entry {uri} has a header with invalid tensor offsets")
    return max(ends, default=0)


def default_store_uri() -> str:
    return os.path.join(cache_root(), "shards")


def settings_key(settings: dict) -> str:
    """Short stable hash of a JSON-able settings dict."""
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def capture_key(capture: dict, model_dtype: str) -> str:
    """Scope of a shard entry besides the model: capture settings and the dtype the model ran in
    (fp32-CPU and bf16-GPU statistics of one model are different measurements); a copy probe's form is among
    the capture settings (CaptureSettings.to_dict), so stores of one form are never read as another's."""
    return settings_key({**capture, "model_dtype": model_dtype})


@dataclass(frozen=True)
class ShardStore:
    """Where shard results live. `root` is a local path or an fsspec URI; `model_id` and
    `capture_key` scope the entries to one model and one set of capture settings."""

    root: str
    model_id: str
    capture_key: str

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("shard store root is empty; pass a directory or an fsspec URI (e.g. s3://bucket/kvtc-cache)")

    @property
    def hmac_key(self) -> bytes:
        """The store's HMAC key, created (32 random bytes, 0600 locally) by the first writer."""
        if self.root not in _KEYS:
            _KEYS[self.root] = _load_or_create_key(self.root)
        return _KEYS[self.root]

    @property
    def _fs_and_base(self) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, base = fsspec.core.url_to_fs(self.root)
        return fs, f"{base.rstrip('/')}/{self.model_id}/{self.capture_key}"

    def uri(self, shard_id: str, kind: str) -> str:
        if kind not in KINDS:
            raise ValueError(f"unknown shard entry kind {kind!r}; expected one of {KINDS}")
        return f"{self.root.rstrip('/')}/{self.model_id}/{self.capture_key}/{shard_id}.{kind}.safetensors"

    def _path(self, shard_id: str, kind: str) -> str:
        _, base = self._fs_and_base
        return f"{base}/{shard_id}.{kind}.safetensors"

    def has(self, shard_id: str, kind: str) -> bool:
        fs, _ = self._fs_and_base
        return fs.exists(self._path(shard_id, kind))

    def put(self, shard_id: str, kind: str, tensors: dict[str, np.ndarray], metadata: dict) -> int:
        """Write one entry whole from arrays plus JSON metadata (authenticated); returns its size in bytes."""
        arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
        text = json.dumps(metadata, sort_keys=True)
        data = st_save(arrays, metadata={"kvtc": text, "kvtc_hmac": self._entry_mac(arrays, text)})
        return self.put_bytes(shard_id, kind, data)

    def _entry_mac(self, arrays: dict[str, np.ndarray], metadata: str) -> str:
        mac = hmac.new(self.hmac_key, metadata.encode(), hashlib.sha256)
        for name in sorted(arrays):
            a = arrays[name]
            mac.update(json.dumps([name, a.dtype.str, list(a.shape)]).encode())
            mac.update(memoryview(np.ascontiguousarray(a)).cast("B") if a.nbytes else b"")
        return mac.hexdigest()

    def put_bytes(self, shard_id: str, kind: str, data: bytes) -> int:
        """Write one entry whole. Re-writing an entry (a retried task) replaces it with identical content."""
        fs, base = self._fs_and_base
        path = self._path(shard_id, kind)
        fs.makedirs(base, exist_ok=True)
        if isinstance(fs, LocalFileSystem):
            atomic_write(path, data)
        else:
            with fs.open(path, "wb") as f:
                f.write(data)
        return len(data)

    def _open(self, path: str, what: str, limit: int | None = None) -> tuple[BinaryIO, int]:
        """(handle, size) of a stored object through safe_io.open_untrusted: a regular file (no FIFO,
        device, directory or symlink; locally inside the store's root), its size known before reading."""
        fs, _ = self._fs_and_base
        local = isinstance(fs, LocalFileSystem)
        root = fsspec.core.url_to_fs(self.root)[1] if local else None  # file:// URIs too
        return open_untrusted(fs, local, path, what, limit=limit, root=root)

    def get_bytes(self, shard_id: str, kind: str) -> bytes:
        """An entry's bytes: its safetensors header (at most 64 MiB) is read first and the object must be
        exactly the size the header describes, so an appended tail or a huge object is refused unread."""
        path, uri = self._path(shard_id, kind), self.uri(shard_id, kind)
        try:
            handle, size = self._open(path, "shard entry")
        except FileNotFoundError:
            raise FileNotFoundError(f"shard entry {uri} is missing; rerun the calibration to recompute it") from None
        with handle:
            if size < 8:
                raise IntegrityError(f"shard entry {uri} holds {size} bytes, less than a safetensors header")
            header_len = int.from_bytes(read_exactly(handle, 8, "shard entry", uri), "little")
            if header_len > min(size - 8, _ROWS_HEADER_LIMIT):
                raise IntegrityError(f"shard entry {uri}: header length {header_len} exceeds the entry or "
                                     f"{_ROWS_HEADER_LIMIT} bytes")
            header = read_exactly(handle, header_len, "shard entry", uri)
            end = _data_end(header, uri)
            if size != 8 + header_len + end:
                raise IntegrityError(f"shard entry {uri} holds {size} bytes, its header describes {8 + header_len + end} "
                                     "(extended or truncated)")
            return b"".join([header_len.to_bytes(8, "little"), header,
                             read_exactly(handle, end, "shard entry", uri)])

    def get(self, shard_id: str, kind: str) -> tuple[dict[str, np.ndarray], dict]:
        """Arrays and JSON metadata of an entry written by `put`, authenticated. An unreadable, forged or
        special (FIFO, directory, link) entry is moved aside (`.corrupt`) and raised as CorruptStats naming
        it: a rerun recomputes it."""
        try:
            data = self.get_bytes(shard_id, kind)
            header_len = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
            text, mac = meta.get("kvtc", "{}"), meta.get("kvtc_hmac")
            arrays = st_load(data)
            if not isinstance(mac, str) or not hmac.compare_digest(mac, self._entry_mac(arrays, text)):
                raise ValueError("not authenticated with the store's key (forged, or written by an older release)")
            return arrays, json.loads(text)
        except FileNotFoundError:
            raise
        except Exception as exc:  # safetensors, JSON, the file's type and the check all fail as "unreadable"
            path = self._path(shard_id, kind)
            self._move_aside(path)
            raise CorruptStats(self.uri(shard_id, kind), f"{type(exc).__name__}: {exc}; moved aside as "
                               f"{os.path.basename(path)}.corrupt") from None

    # ---- accumulators: running statistics totals, rewritten whole after every folded shard ----

    def acc_uri(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{self.model_id}/{self.capture_key}/{ACC_DIR}/{name}.stats"

    def _acc_path(self, name: str) -> str:
        _, base = self._fs_and_base
        return f"{base}/{ACC_DIR}/{name}.stats"

    def put_acc(self, name: str, stats: CalibrationStats) -> int:
        """Write an accumulator whole (stage then rename locally, one PUT remotely); returns its bytes."""
        fs, base = self._fs_and_base
        path = self._acc_path(name)
        fs.makedirs(f"{base}/{ACC_DIR}", exist_ok=True)
        if isinstance(fs, LocalFileSystem):
            return atomic_write(path, lambda f: stats.write_to(f, self.hmac_key))
        with fs.open(path, "wb") as f:
            return stats.write_to(f, self.hmac_key)

    def acc_shards(self, name: str) -> list[str] | None:
        """Shard ids folded into a stored accumulator (its footer only), None when it is absent.
        A corrupt one is moved aside (next to it, `.corrupt`) and reported absent: it gets recomputed."""
        path = self._acc_path(name)
        try:
            handle, _ = self._open(path, "statistics object")
        except FileNotFoundError:
            return None
        except IntegrityError as exc:
            handle, problem = None, CorruptStats(self.acc_uri(name), str(exc))
        try:
            if handle is None:
                raise problem
            with handle as f:
                return list(CalibrationStats.read_metadata(f, self.acc_uri(name), self.hmac_key)["shard_ids"])
        except CorruptStats as exc:
            self.quarantine(name)
            print(f"kvtc: {exc} (moved aside as {name}.stats.corrupt)", file=sys.stderr)
            return None

    def get_acc(self, name: str, keys: list[tuple[str, int]] | None = None) -> CalibrationStats:
        """A stored accumulator (only the (stream, group) `keys` when given), checksums verified.
        Missing: FileNotFoundError naming it. Corrupt: `CorruptStats` naming it, after moving it
        aside so that a rerun recomputes it."""
        try:
            try:
                handle, _ = self._open(self._acc_path(name), "statistics object")
            except IntegrityError as exc:
                raise CorruptStats(self.acc_uri(name), str(exc)) from None
            with handle as f:
                return CalibrationStats.read_from(f, self.acc_uri(name), keys, self.hmac_key)
        except FileNotFoundError:
            raise FileNotFoundError(f"statistics object {self.acc_uri(name)} is missing; rerun the calibration to recompute it") from None
        except CorruptStats:
            self.quarantine(name)
            raise

    def quarantine(self, name: str) -> None:
        """Move a bad accumulator aside (kept for inspection, never read again)."""
        self.set_aside(name, "corrupt")

    def set_aside(self, name: str, why: str) -> None:
        """Rename accumulator `name` to `<name>.stats.<why>` (replacing an older one set aside)."""
        self._move_aside(self._acc_path(name), why)

    def _move_aside(self, path: str, why: str = "corrupt") -> None:
        """Rename `path` (a file, FIFO, link or directory) to `<path>.<why>`, replacing an older file set
        aside; when that name is taken by something that cannot be replaced, a unique suffix is added."""
        fs, _ = self._fs_and_base
        target = f"{path}.{why}"
        if isinstance(fs, LocalFileSystem):
            if not os.path.lexists(path):
                return
            try:
                os.replace(path, target)
            except OSError:
                os.replace(path, f"{target}.{uuid.uuid4().hex[:8]}")
            return
        if fs.exists(path):
            fs.mv(path, target, recursive=fs.isdir(path))

    def stats_bytes(self) -> int:
        """Bytes of all statistics objects in this scope (accumulators)."""
        fs, base = self._fs_and_base
        if not fs.exists(f"{base}/{ACC_DIR}"):
            return 0
        return sum(int(info["size"]) for info in fs.ls(f"{base}/{ACC_DIR}", detail=True) if info["name"].endswith(".stats"))

    # ---- reduced bases handed from a reducer task back to the driver ----

    def _basis_path(self, name: str) -> str:
        _, base = self._fs_and_base
        return f"{base}/bases/{name}.basis"

    def basis_binding(self, name: str, bound: dict | None = None) -> dict:
        """What a basis object is bound to inside its authenticated footer: its name, this store's scope (model
        and capture settings: the job's identity) and the caller's `bound` (a task's stream, group, settings)."""
        return json.loads(json.dumps({"name": name, "model_id": self.model_id, "capture_key": self.capture_key,
                                      **(bound or {})}, sort_keys=True))

    def put_basis(self, name: str, tensors: dict[str, np.ndarray], metadata: dict, bound: dict | None = None) -> int:
        """Write a basis object whole (checksummed arrays + JSON metadata, bound to `name`, this store's scope and
        `bound`: `basis_binding`); returns its bytes."""
        fs, base = self._fs_and_base
        path = self._basis_path(name)
        fs.makedirs(f"{base}/bases", exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with fs.open(tmp, "wb") as f:
            n = write_stats(f, tensors, {**metadata, BINDING: self.basis_binding(name, bound)}, self.hmac_key)
        fs.mv(tmp, path)
        return n

    def _basis_uri(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{self.model_id}/{self.capture_key}/bases/{name}.basis"

    def _check_binding(self, name: str, footer: dict, bound: dict | None) -> None:
        """CorruptStats unless the object's footer binds it to `name`, this store's scope and `bound` (None: the
        name and scope only): an object copied from another name, job or task is authenticated content, but not
        what it claims to be."""
        want, got = self.basis_binding(name, bound), footer["metadata"].get(BINDING)
        if bound is None and isinstance(got, dict):  # the caller names no task: its name and scope only
            got = {k: got.get(k) for k in want}
        if got != want:
            if not isinstance(got, dict):
                problem = "it names no task (written by an earlier release)"
            else:
                diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
                problem = (f"it was written as {got.get('name')!r}" if got.get("name") != name else "it was written")
                problem += f" for another {'job' if {'model_id', 'capture_key'} & set(diff) else 'task'} " \
                           f"(differing: {', '.join(diff)}); copied or swapped"
            raise CorruptStats(self._basis_uri(name), problem)

    def check_basis(self, name: str, bound: dict | None = None) -> None:
        """Read a basis object's footer only (authenticated) and check what it is bound to; CorruptStats naming it
        (the object moved aside) otherwise."""
        self._read_basis(name, bound, arrays=False)

    def get_basis(self, name: str, bound: dict | None = None) -> tuple[dict[str, np.ndarray], dict]:
        """Arrays and metadata of a basis object, checksums verified and its binding checked (`check_basis`);
        CorruptStats names it (the object moved aside)."""
        return self._read_basis(name, bound, arrays=True)

    def _read_basis(self, name: str, bound: dict | None, arrays: bool):
        """The footer checked against its binding, then with `arrays` -> (arrays, metadata); a bad object is moved
        aside and CorruptStats names it."""
        uri = self._basis_uri(name)
        try:
            try:
                handle, _ = self._open(self._basis_path(name), "basis object")
            except IntegrityError as exc:
                raise CorruptStats(uri, str(exc)) from None
            with handle as f:
                footer = read_footer(f, uri, self.hmac_key)
                self._check_binding(name, footer, bound)
                if not arrays:
                    return None
                return {key: read_tensor(f, footer, key, uri) for key in footer["tensors"]}, footer["metadata"]
        except CorruptStats:
            self._move_aside(self._basis_path(name))
            raise

    def has_basis(self, name: str) -> bool:
        fs, _ = self._fs_and_base
        return fs.exists(self._basis_path(name))

    def drop_basis(self, name: str) -> None:
        fs, _ = self._fs_and_base
        if fs.exists(self._basis_path(name)):
            fs.rm(self._basis_path(name))


def _check_key_mode(mode: int, where: str) -> None:
    """Refuse a local store key that users outside its owner and group can read or write: whoever reads it
    can forge statistics the store accepts. A group sharing the store may hold it (0640/0660)."""
    if mode & 0o007:
        raise ValueError(f"shard store key {where} has mode {oct(mode & 0o777)}: users other than its owner and "
                         "group can read or change it, and whoever reads it can forge statistics. If nobody else could "
                         "have read it, `chmod 600` it; otherwise delete it (every statistics object is then "
                         "recomputed under a fresh key)")


def _load_or_create_key(root: str) -> bytes:
    """<root>/.store-key: read it, or create it exclusively (0600 on a local disk) if absent."""
    fs, base = fsspec.core.url_to_fs(root)
    path = f"{base.rstrip('/')}/{KEY_FILE}"
    local = isinstance(fs, LocalFileSystem)
    for _ in range(40):
        try:
            handle, _ = open_untrusted(fs, local, path, "shard store key", limit=_KEY_BYTES)
            with handle:
                if local:
                    _check_key_mode(os.fstat(handle.fileno()).st_mode, f"{root}/{KEY_FILE}")
                key = handle.read(_KEY_BYTES + 1)
        except FileNotFoundError:
            key = None
        except (OSError, IntegrityError) as exc:
            raise ValueError(f"shard store key {root}/{KEY_FILE} cannot be used ({exc}); it must be a regular file "
                             f"of {_KEY_BYTES} bytes readable by the calibration (delete it to start a fresh store: "
                             "every statistics object is then recomputed)") from None
        if key is not None and not key:
            time.sleep(0.05)  # created by another process a moment ago, not yet written
            continue
        if key is not None:
            if len(key) != _KEY_BYTES:
                raise ValueError(f"shard store key {root}/{KEY_FILE} is not {_KEY_BYTES} bytes; delete it (every "
                                 "statistics object is then recomputed)")
            return key
        fresh = secrets.token_bytes(_KEY_BYTES)
        try:
            if local:
                os.makedirs(base, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(fresh)
                    f.flush()
                    os.fsync(f.fileno())
            else:
                fs.makedirs(base, exist_ok=True)
                with fs.open(path, "xb") as f:
                    f.write(fresh)
        except FileExistsError:
            continue  # another process created it first: read theirs
        except (NotImplementedError, ValueError, TypeError):
            fs.pipe_file(path, fresh)
        return fresh
    raise ValueError(f"shard store key {root}/{KEY_FILE} could not be created or read")
