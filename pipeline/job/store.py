"""Content-addressed cache of per-shard results, on a local directory or any fsspec URI.

A shard's entry is named by what determines it: the model fingerprint, the capture settings
and the shard id (itself a hash of the shard's tokens). Entries are written whole (stage then
rename on local disks; one PUT on object stores), so a crash leaves either the entry or nothing,
and a rerun processes only the shards that are missing.

Layout: ``<root>/<model fingerprint id>/<capture key>/<shard id>.rows.safetensors`` (held-out
shards: a capped sample of captured rows with their positions) and
``<root>/<model fingerprint id>/<capture key>/acc/<accumulator>.stats`` (training statistics: one
running total per accumulator with the ids of the shards folded into it, in fold order; see
`kvtc.pipeline.job.accumulators`). Statistics objects carry a sha256 per tensor, verified on read;
one that fails is moved aside as ``<name>.stats.corrupt`` so the next run recomputes it.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass

import fsspec
from fsspec.implementations.local import LocalFileSystem
import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from kvtc.artifacts.local_files import atomic_write, cache_root
from kvtc.workers.stats import CalibrationStats
from kvtc.workers.stats_file import CorruptStats, read_footer, read_tensor, write_stats

KINDS = ("rows",)
ACC_DIR = "acc"


def default_store_uri() -> str:
    return os.path.join(cache_root(), "shards")


def settings_key(settings: dict) -> str:
    """Short stable hash of a JSON-able settings dict."""
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def capture_key(capture: dict, model_dtype: str) -> str:
    """Scope of a shard entry besides the model: capture settings and the dtype the model ran in
    (fp32-CPU and bf16-GPU statistics of one model are different measurements)."""
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
        """Write one entry whole from arrays plus JSON metadata; returns its size in bytes."""
        data = st_save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata={"kvtc": json.dumps(metadata, sort_keys=True)})
        return self.put_bytes(shard_id, kind, data)

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

    def get_bytes(self, shard_id: str, kind: str) -> bytes:
        fs, _ = self._fs_and_base
        try:
            with fs.open(self._path(shard_id, kind), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"shard entry {self.uri(shard_id, kind)} is missing; rerun the calibration to recompute it") from None

    def get(self, shard_id: str, kind: str) -> tuple[dict[str, np.ndarray], dict]:
        """Arrays and JSON metadata of an entry written by `put`."""
        data = self.get_bytes(shard_id, kind)
        try:
            header_len = int.from_bytes(data[:8], "little")
            metadata = json.loads(json.loads(data[8 : 8 + header_len]).get("__metadata__", {}).get("kvtc", "{}"))
            return st_load(data), metadata
        except Exception as exc:
            raise ValueError(f"shard entry {self.uri(shard_id, kind)} is unreadable ({exc}); delete it and rerun") from exc

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
            return atomic_write(path, stats.write_to)
        with fs.open(path, "wb") as f:
            return stats.write_to(f)

    def acc_shards(self, name: str) -> list[str] | None:
        """Shard ids folded into a stored accumulator (its footer only), None when it is absent.
        A corrupt one is moved aside (next to it, `.corrupt`) and reported absent: it gets recomputed."""
        fs, _ = self._fs_and_base
        path = self._acc_path(name)
        if not fs.exists(path):
            return None
        try:
            with fs.open(path, "rb") as f:
                return list(CalibrationStats.read_metadata(f, self.acc_uri(name))["shard_ids"])
        except CorruptStats:
            self.quarantine(name)
            return None

    def get_acc(self, name: str, keys: list[tuple[str, int]] | None = None) -> CalibrationStats:
        """A stored accumulator (only the (stream, group) `keys` when given), checksums verified.
        Missing: FileNotFoundError naming it. Corrupt: `CorruptStats` naming it, after moving it
        aside so that a rerun recomputes it."""
        fs, _ = self._fs_and_base
        try:
            with fs.open(self._acc_path(name), "rb") as f:
                return CalibrationStats.read_from(f, self.acc_uri(name), keys)
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
        fs, _ = self._fs_and_base
        path = self._acc_path(name)
        if fs.exists(path):
            fs.mv(path, f"{path}.{why}")

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

    def put_basis(self, name: str, tensors: dict[str, np.ndarray], metadata: dict) -> int:
        """Write a basis object whole (checksummed arrays + JSON metadata); returns its bytes."""
        fs, base = self._fs_and_base
        path = self._basis_path(name)
        fs.makedirs(f"{base}/bases", exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with fs.open(tmp, "wb") as f:
            n = write_stats(f, tensors, metadata)
        fs.mv(tmp, path)
        return n

    def get_basis(self, name: str) -> tuple[dict[str, np.ndarray], dict]:
        """Arrays and metadata of a basis object, checksums verified (CorruptStats names it)."""
        fs, _ = self._fs_and_base
        uri = f"{self.root.rstrip('/')}/{self.model_id}/{self.capture_key}/bases/{name}.basis"
        with fs.open(self._basis_path(name), "rb") as f:
            footer = read_footer(f, uri)
            return {key: read_tensor(f, footer, key, uri) for key in footer["tensors"]}, footer["metadata"]

    def drop_basis(self, name: str) -> None:
        fs, _ = self._fs_and_base
        if fs.exists(self._basis_path(name)):
            fs.rm(self._basis_path(name))
