"""LMCache's settings of the kvtc serde: its kwargs (ChunkSerdeSettings) and the deployment's chunk key file,
validated without torch, so `kvtc lmcache-server` refuses a bad --l2-adapter before anything heavy loads. The
transform they configure is kernels/codec/chunk_serde.py; the ranks it serves, lmcache_ranks.py."""
from __future__ import annotations

import os
import secrets
import stat
import time
from dataclasses import dataclass
from typing import Any

from kvtc.artifacts.blocks import check_ratios
from kvtc.artifacts.errors import IntegrityError
from kvtc.artifacts.safe_io import open_regular
from kvtc.kernels.codec.chunk_options import CHUNK_KEY_BYTES, CHUNK_KEY_ENV, CHUNK_MODES

NEW_KEY_S = 2.0  # an empty key file younger than this is being written by the server that created it

_KWARGS = ("artifact", "ratio", "registry", "backend", "model", "max_workers", "mode", "pad", "pp_partition",
           "key_file")
# the chunk coder's research options: what the server codes with is their default, reachable from Python
# (ChunkTransform / KVTCCodec keywords) and bench/served_quality.py, not from a deployment's config
RESEARCH_KWARGS = ("sink_budget", "sink_format", "outlier_factor")


def load_chunk_key(path: str | os.PathLike) -> bytes:
    """The deployment's chunk key at `path` (CHUNK_KEY_BYTES random bytes): read it, or create it once,
    exclusively, with mode 0600. ValueError naming the file when it cannot serve: not a regular file (a FIFO,
    a device, a folder, a symlink out of its folder; one within it, as a Kubernetes Secret mounts, is followed),
    readable by group or others, empty, or not CHUNK_KEY_BYTES long. Keep it outside the chunk store: a writer of
    the store who can read it can forge chunks."""
    path = os.fspath(path)
    for _ in range(40):
        try:
            fd = open_regular(path, "kvtc chunk key", links="in_folder")  # never blocks: a FIFO is refused
        except FileNotFoundError:
            fresh = secrets.token_bytes(CHUNK_KEY_BYTES)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            except FileExistsError:
                continue  # created by another server a moment ago: read theirs
            except OSError as exc:
                raise ValueError(f"kvtc chunk key {path} cannot be created ({exc.strerror}); create its folder or "
                                 "point key_file elsewhere") from None
            with os.fdopen(fd, "wb") as f:
                f.write(fresh)
                f.flush()
                os.fsync(f.fileno())
            return fresh
        except IntegrityError as exc:
            raise ValueError(f"{exc}: the key must be a regular file of {CHUNK_KEY_BYTES} bytes, mode 0600") from None
        except OSError as exc:
            raise ValueError(f"kvtc chunk key {path} cannot be read ({exc.strerror}): it must be a regular file of "
                             f"{CHUNK_KEY_BYTES} bytes, mode 0600") from None
        st = os.fstat(fd)
        if st.st_mode & 0o077:
            os.close(fd)
            raise ValueError(f"kvtc chunk key {path} is readable or writable by others (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}): chmod 600 it")
        with os.fdopen(fd, "rb") as f:
            data = f.read(CHUNK_KEY_BYTES + 1)
        if not data and time.time() - st.st_mtime < NEW_KEY_S:
            time.sleep(0.05)  # being written by the server that created it a moment ago
            continue
        if len(data) != CHUNK_KEY_BYTES:
            held = "is empty" if not data else f"holds {len(data)} bytes, not {CHUNK_KEY_BYTES}"
            raise ValueError(f"kvtc chunk key {path} {held}: restore it, or delete it to start a fresh key (every "
                             "stored chunk is then a miss)")
        return data
    raise ValueError(f"kvtc chunk key {path} is empty: restore it, or delete it to start a fresh key (every stored "
                     "chunk is then a miss)")


def parse_partition(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    try:
        out = tuple(int(str(x).strip()) for x in items)
    except (TypeError, ValueError):
        out = ()
    if not out or any(n < 1 for n in out):
        raise ValueError(f'kvtc serde "pp_partition" must list layers per pipeline stage, e.g. "16,16" or [16, 16] '
                         f"(vLLM's VLLM_PP_LAYER_PARTITION), got {value!r}")
    return out


@dataclass(frozen=True)
class ChunkSerdeSettings:
    """Serde kwargs: artifact "NAME[@VERSION|ALIAS]", ratio, registry URI, backend, model (hub id or
    local dir whose config is checked against the artifact), max_workers (LMCache's thread pool),
    mode ("ecsq" | "fixed"; default: the artifact's), pad (pad every chunk to the size bound),
    pp_partition (layers per pipeline stage, as vLLM's VLLM_PP_LAYER_PARTITION; default: vLLM's),
    key_file (the deployment's chunk key, created once with mode 0600; default: $KVTC_CHUNK_KEY_FILE, else no key:
    every server sharing a store must use the same key, kept outside the store)."""

    artifact: str
    ratio: float
    registry: str | None = None
    backend: str = "auto"
    model: str | None = None
    max_workers: int = 1
    mode: str | None = None
    pad: bool = True
    pp_partition: tuple[int, ...] | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.artifact, str) or not self.artifact:
            raise ValueError('the kvtc serde needs "artifact": "NAME[@VERSION|ALIAS]" in its kwargs')
        if not isinstance(self.ratio, (int, float)) or isinstance(self.ratio, bool):
            raise ValueError(f'the kvtc serde needs "ratio": a number > 1 the artifact was allocated for, '
                             f"got {self.ratio!r}")
        check_ratios([self.ratio], 'the kvtc serde\'s "ratio": ')
        if not isinstance(self.max_workers, int) or self.max_workers < 1:
            raise ValueError(f"max_workers must be an integer >= 1, got {self.max_workers!r}")
        if self.mode is not None and self.mode not in CHUNK_MODES:
            raise ValueError(f'kvtc serde "mode" must be one of {CHUNK_MODES} (or absent: the artifact\'s default), '
                             f"got {self.mode!r}")
        if not isinstance(self.pad, bool):
            raise ValueError(f'kvtc serde "pad" must be true or false, got {self.pad!r}')
        object.__setattr__(self, "pp_partition", parse_partition(self.pp_partition))
        if self.key_file is not None and (not isinstance(self.key_file, str) or not self.key_file):
            raise ValueError(f'kvtc serde "key_file" must be a path (the deployment\'s chunk key), got {self.key_file!r}')

    def chunk_key(self) -> bytes | None:
        """The deployment's chunk key: `key_file`, else the file KVTC_CHUNK_KEY_FILE names (created once, 0600);
        None where neither is set (chunks then carry the unkeyed binding digest)."""
        path = self.key_file or os.environ.get(CHUNK_KEY_ENV) or None
        return None if path is None else load_chunk_key(path)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, object]) -> "ChunkSerdeSettings":
        """kwargs: the "serde" dict, with or without its "type" (LMCache revisions differ)."""
        kwargs = dict(kwargs)
        kind = kwargs.pop("type", "kvtc")
        if kind != "kvtc":
            raise ValueError(f'the kvtc serde was handed a config of type {kind!r}')
        research = [k for k in RESEARCH_KWARGS if k in kwargs]
        if research:
            raise ValueError(f"kvtc serde option {research[0]!r} is a research option of the chunk coder, not "
                             "deployment config: remove it (the server codes with its default, the served one; "
                             f"Python callers pass ChunkTransform(..., {research[0]}=...))")
        unknown = sorted(set(kwargs) - set(_KWARGS))
        if unknown:
            raise ValueError(f"unknown kvtc serde option(s) {unknown}; accepted: {list(_KWARGS)}")
        missing = [k for k in ("artifact", "ratio") if k not in kwargs]
        if missing:
            raise ValueError(f'the kvtc serde needs {missing} in its kwargs, e.g. '
                             '{"type": "kvtc", "artifact": "llama-3.1-8b@production", "ratio": 16, '
                             '"registry": "s3://bucket/kvtc"}')
        return cls(**kwargs)  # type: ignore[arg-type]
