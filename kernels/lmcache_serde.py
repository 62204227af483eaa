"""LMCache serde plugin "kvtc": importing this module registers it with LMCache's serde factory.

    kvtc lmcache-server ... --l2-adapter '{"type": "fs", "base_path": "/cache",
        "serde": {"type": "kvtc", "artifact": "llama-3.1-8b@production", "ratio": 16,
                  "registry": "s3://bucket/kvtc", "model": "meta-llama/Llama-3.1-8B"}}'

(`kvtc lmcache-server` registers it and runs LMCache's own server: kernels/lmcache_server.py.)
The transform is kernels/chunk_serde.py; this module only adapts it to LMCache's `Serializer` /
`Deserializer` interfaces (`MemoryObj` in and out) and wraps them in LMCache's
`AsyncSerdeProcessor`. The artifact is pulled and checked when the adapter is built; the key's
`kv_rank` picks the rank's basis. Both factory conventions are accepted (the "serde" dict with or
without "type"), and the serializers take `key` as an optional argument (LMCache revisions differ).
A chunk that cannot be coded raises an error naming its key, which LMCache's processor logs and
counts as a failed store or a miss: nothing wrong reaches the engine and the server keeps running.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory
from lmcache.v1.memory_management import MemoryObj

from kvtc.kernels.blob import BlobError
from kvtc.kernels.chunk_serde import ChunkSerdeSettings, ChunkTransform, RankedChunkTransforms

SERDE_TYPE = "kvtc"
TESTED_LMCACHE = ">=0.5.6,<0.6"  # the range pyproject's `lmcache` extra pins
_log = logging.getLogger(__name__)


def _tensor(obj: MemoryObj, what: str) -> torch.Tensor:
    t = obj.tensor
    if t is None:
        raise ValueError(f"kvtc serde: the {what} MemoryObj has no tensor")
    return t


def describe(key: Any) -> str:
    """A key as the logs name it: model, rank and chunk hash."""
    if key is None:
        return "chunk"
    digest = getattr(key, "chunk_hash", b"")
    digest = digest.hex()[:16] if isinstance(digest, (bytes, bytearray)) else str(digest)
    return f"chunk {getattr(key, 'model_name', '?')}/rank {getattr(key, 'kv_rank', '?')}/{digest}"


class KVTCSerializer(Serializer):
    def __init__(self, transforms: RankedChunkTransforms) -> None:
        self.transforms = transforms
        self._warned: set[str] = set()

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: Any = None) -> int:
        try:
            out = _tensor(dst, "destination").reshape(-1).view(torch.uint8)
            data = self.transforms(getattr(key, "kv_rank", 0)).serialize(_tensor(src, "source"), out.numel())
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
    def __init__(self, transforms: RankedChunkTransforms) -> None:
        self.transforms = transforms

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: Any = None) -> None:
        try:
            transform = self.transforms(getattr(key, "kv_rank", 0))
            data = _tensor(src, "source").reshape(-1).view(torch.uint8).cpu().numpy()
            transform.deserialize(memoryview(data), _tensor(dst, "destination"))
        except BlobError as exc:
            raise BlobError(f"kvtc serde: stored {describe(key)} does not decode: {exc}") from exc
        except Exception as exc:
            raise ValueError(f"kvtc serde cannot load {describe(key)}: {exc}") from exc


def create_kvtc_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    """LMCache serde factory: kwargs are the "serde" dict, with or without "type"."""
    settings = ChunkSerdeSettings.from_kwargs(dict(kwargs))
    transforms = RankedChunkTransforms(lambda rank: ChunkTransform.from_settings(settings, rank))
    return AsyncSerdeProcessor(KVTCSerializer(transforms), KVTCDeserializer(transforms),
                               max_workers=settings.max_workers)


def register() -> None:
    """Register "kvtc" with LMCache's serde factory (idempotent)."""
    if SERDE_TYPE not in get_registered_serde_types():
        register_serde_factory(SERDE_TYPE, create_kvtc_serde)


register()
