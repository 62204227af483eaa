"""LMCache serde plugin "kvtc": importing this module registers it with LMCache's serde factory.

    kvtc lmcache-server ... --l2-adapter '{"type": "fs", "base_path": "/cache",
        "serde": {"type": "kvtc", "artifact": "llama-3.1-8b@production", "ratio": 16,
                  "registry": "s3://bucket/kvtc", "model": "meta-llama/Llama-3.1-8B"}}'

(`kvtc lmcache-server` registers it and runs LMCache's own server: kernels/integrations/lmcache_server.py.)
The transform is kernels/codec/chunk_serde.py; this module only adapts it to LMCache's `Serializer` /
`Deserializer` interfaces (`MemoryObj` in and out) and wraps them in LMCache's
`AsyncSerdeProcessor`. The artifact is pulled and checked when the adapter is built; the key's packed
`kv_rank` (world size, rank, local world size, local rank: `lmcache_ranks.KVRank`) picks the placement:
the tensor-parallel rank's basis and, under pipeline parallelism, the stage's layers.

Positions: LMCache's MP server resolves a request's token range [start, end) into one key per chunk,
chunk i at token start + i x chunk size (`MPCacheServerContext.resolve_obj_keys`). `install_position_hook`
(called by `kvtc lmcache-server` before the server starts) records each chunk hash's position there,
so chunks of an artifact calibrated with RoPE removed are coded at their true positions and a first
chunk keeps the artifact's sinks raw. Without the hook (the serde imported into another process) such
an artifact is refused when the adapter is built, and a rope-kept one codes every token.

Binding: each stored chunk's frame carries `key_binding(key)` (every field of the ObjectKey, the tenant's
`cache_salt` included: one tenant's chunk is a miss for another) and the chunk's identity (artifact digest, model,
RoPE, KV layout: kernels/codec/chunk_identity.py, with what the key says of the engine, `engine_of`: its model name
and world size), and its blob the artifact, ratio, rank's heads, stage's layers and start position; the
deserializer compares them with the key asked for and the position the server resolved, and a mismatch is a miss.
A chunk of another identity, or a version-1 frame that carries none, is named once per reason in the log (each such
chunk still fails its load, as LMCache reports it).

Both factory conventions are accepted (the "serde" dict with or without "type"), and the serializers
take `key` as an optional argument (LMCache revisions differ). A chunk that cannot be coded raises an
error naming its key, which LMCache's processor logs and counts as a failed store or a miss: nothing
wrong reaches the engine and the server keeps running.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory
from lmcache.v1.memory_management import MemoryObj

from kvtc.kernels.codec.blob import BlobError
from kvtc.kernels.codec.chunk_identity import Engine, IdentityMismatch
from kvtc.kernels.codec.chunk_serde import UNBOUND, binding
from kvtc.kernels.integrations.lmcache_settings import ChunkSerdeSettings
from kvtc.kernels.integrations.lmcache_ranks import KVRank, RankedChunkTransforms

SERDE_TYPE = "kvtc"
TESTED_LMCACHE = ">=0.5.6,<0.6"  # the LMCache releases this plugin is tested with (0.5.6)
_log = logging.getLogger(__name__)


class ChunkPositions:
    """chunk hash -> the absolute position of the chunk's first token, the `capacity` most recent."""

    def __init__(self, capacity: int = 1 << 18) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._start: OrderedDict[bytes, int] = OrderedDict()

    def record(self, hashes: list[bytes], start: int, chunk_size: int) -> None:
        with self._lock:
            for i, h in enumerate(hashes):
                self._start[h] = start + i * chunk_size
                self._start.move_to_end(h)
            while len(self._start) > self.capacity:
                self._start.popitem(last=False)

    def get(self, chunk_hash: Any) -> int | None:
        with self._lock:
            return self._start.get(chunk_hash)


POSITIONS = ChunkPositions()
_hook_lock = threading.Lock()
_hooked = False


def install_position_hook() -> bool:
    """Record the position of every chunk key LMCache's MP server resolves (into POSITIONS); idempotent.
    False where this LMCache has no `MPCacheServerContext.resolve_obj_keys` (positions stay unknown)."""
    global _hooked
    with _hook_lock:
        if _hooked:
            return True
        try:
            # optional: an LMCache without its multiprocess server leaves positions unknown
            from lmcache.v1.multiprocess.engine_context import MPCacheServerContext  # noqa: PLC0415 - see above
        except ImportError:
            return False
        original = getattr(MPCacheServerContext, "resolve_obj_keys", None)
        if original is None:
            return False

        def resolve_obj_keys(self, key, object_group_ids):  # noqa: ANN001 - LMCache's signature
            out = original(self, key, object_group_ids)
            try:
                if out and out[0]:
                    POSITIONS.record([k.chunk_hash for k in out[0]], int(key.start), int(self.chunk_size))
            except Exception:  # never fail LMCache's request for a position not recorded
                _log.exception("kvtc serde: chunk positions not recorded for request %s", getattr(key, "request_id", "?"))
            return out

        resolve_obj_keys.__wrapped__ = original  # type: ignore[attr-defined]
        MPCacheServerContext.resolve_obj_keys = resolve_obj_keys
        _hooked = True
        return True


def positions_known() -> bool:
    """Whether chunk positions are recorded in this process (install_position_hook ran)."""
    return _hooked


def _tensor(obj: MemoryObj, what: str) -> torch.Tensor:
    t = obj.tensor
    if t is None:
        raise ValueError(f"kvtc serde: the {what} MemoryObj has no tensor")
    return t


def key_binding(key: Any) -> bytes:
    """The binding digest of an LMCache ObjectKey: every field that names the object (content hash, model,
    packed rank, object group, cache salt), so a chunk stored under one key never loads for another."""
    if key is None:
        return UNBOUND
    return binding(getattr(key, "chunk_hash", b""), getattr(key, "model_name", ""), getattr(key, "kv_rank", None),
                   getattr(key, "object_group_id", 0), getattr(key, "cache_salt", ""))


def engine_of(key: Any) -> Engine:
    """What an LMCache key says of the engine that stored its chunk: its model name and world size (a chunk's
    identity, beside the artifact's)."""
    if key is None:
        return Engine()
    try:
        world = KVRank.decode(getattr(key, "kv_rank", None)).world_size
    except ValueError:
        world = 0  # not LMCache's packed rank: the transform refuses the key with the reason
    return Engine(str(getattr(key, "model_name", "")), world)


def _recorded_start(transform: Any, positions: ChunkPositions | None, key: Any) -> int | None:
    """The position the server resolved for `key`'s chunk, where the transform's bytes depend on it."""
    if not transform.positional or positions is None or key is None:
        return None
    return positions.get(getattr(key, "chunk_hash", None))


def describe(key: Any) -> str:
    """A key as the logs name it: model, rank (decoded), chunk hash and, where it has one, its tenant (cache_salt)."""
    if key is None:
        return "chunk"
    digest = getattr(key, "chunk_hash", b"")
    digest = digest.hex()[:16] if isinstance(digest, (bytes, bytearray)) else str(digest)
    kv_rank = getattr(key, "kv_rank", None)
    try:
        rank = f"{KVRank.decode(kv_rank)} (kv_rank {kv_rank:#010x})"
    except (ValueError, TypeError):
        rank = f"kv_rank {kv_rank!r}"
    salt = getattr(key, "cache_salt", "")
    return f"chunk {getattr(key, 'model_name', '?')}/{rank}/{digest}" + (f" of tenant {salt!r}" if salt else "")


class KVTCSerializer(Serializer):
    def __init__(self, transforms: RankedChunkTransforms, positions: ChunkPositions | None = None) -> None:
        self.transforms = transforms
        self.positions = positions
        self._warned: set[str] = set()

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: Any = None) -> int:
        try:
            out = _tensor(dst, "destination").reshape(-1).view(torch.uint8)
            transform = self.transforms(getattr(key, "kv_rank", None))
            start = _recorded_start(transform, self.positions, key)
            data = transform.serialize(_tensor(src, "source"), out.numel(), start=start, key=key_binding(key),
                                       engine=engine_of(key))
        except Exception as exc:
            raise ValueError(f"kvtc serde cannot store {describe(key)}: {exc}") from exc
        out[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return len(data)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """The chunk's size bound; for a layout the artifact cannot code, the raw size (the store then fails
        in `serialize` with the reason, logged, rather than raising inside LMCache's allocation path)."""
        shapes, dtypes = list(layout_desc.shapes), list(layout_desc.dtypes)
        try:
            if len(shapes) != 1:
                raise ValueError(f"kvtc serde codes one KV tensor per object, got {len(shapes)} groups")
            return self.transforms.serialized_size(tuple(shapes[0]), dtypes[0])
        except ValueError as exc:
            if str(exc) not in self._warned:
                self._warned.add(str(exc))
                _log.warning("kvtc serde: %s; such chunks will not be stored", exc)
            return sum(int(torch.Size(s).numel()) * torch.empty(0, dtype=d).element_size()
                       for s, d in zip(shapes, dtypes)) + 8


class KVTCDeserializer(Deserializer):
    """Loads a chunk only where its frame and blob agree with the key asked for: the key's binding, its
    rank's artifact, ratio, heads and layers, the position the server resolved for it, and the chunk's identity (a
    mismatch is a BlobError: LMCache logs it, with the key, and counts a miss; another identity is named here once
    per reason, its per-chunk error only says so)."""

    def __init__(self, transforms: RankedChunkTransforms, positions: ChunkPositions | None = None) -> None:
        self.transforms = transforms
        self.positions = positions
        self._told: set[tuple[str, ...]] = set()
        self._lock = threading.Lock()

    def _named_once(self, key: Any, exc: IdentityMismatch) -> BlobError:
        with self._lock:
            first = exc.reasons not in self._told
            self._told.add(exc.reasons)
        if first:
            _log.warning("kvtc serde: %s (the first: stored %s); every such chunk is a miss, said once", exc,
                         describe(key))
        return BlobError(f"kvtc serde: stored {describe(key)} is a miss: not this deployment's chunk (why: named "
                         "once in the log)")

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: Any = None) -> None:
        try:
            transform = self.transforms(getattr(key, "kv_rank", None))
            start = _recorded_start(transform, self.positions, key)
            data = _tensor(src, "source").reshape(-1).view(torch.uint8).cpu().numpy()
            transform.deserialize(memoryview(data), _tensor(dst, "destination"), start=start,
                                  key=None if key is None else key_binding(key), engine=engine_of(key))
        except IdentityMismatch as exc:
            raise self._named_once(key, exc) from None
        except BlobError as exc:
            raise BlobError(f"kvtc serde: stored {describe(key)} does not decode: {exc}") from exc
        except Exception as exc:
            raise ValueError(f"kvtc serde cannot load {describe(key)}: {exc}") from exc


def create_kvtc_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    """LMCache serde factory: kwargs are the "serde" dict, with or without "type"."""
    settings = ChunkSerdeSettings.from_kwargs(dict(kwargs))
    transforms = RankedChunkTransforms.from_settings(settings, positions=positions_known())
    return AsyncSerdeProcessor(KVTCSerializer(transforms, POSITIONS), KVTCDeserializer(transforms, POSITIONS),
                               max_workers=settings.max_workers)


def register() -> None:
    """Register "kvtc" with LMCache's serde factory (idempotent)."""
    if SERDE_TYPE not in get_registered_serde_types():
        register_serde_factory(SERDE_TYPE, create_kvtc_serde)


register()
