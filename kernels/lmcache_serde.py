"""LMCache serde plugin "kvtc": importing this module registers it with LMCache's serde factory.

    import kvtc.kernels.lmcache_serde   # before LMCache builds its L2 adapters
    --l2-adapter '{"type": "fs", "base_path": "/cache",
                   "serde": {"type": "kvtc", "artifact": "llama-3.1-8b@production", "ratio": 16,
                             "registry": "s3://bucket/kvtc", "model": "meta-llama/Llama-3.1-8B"}}'

The transform is kernels/chunk_serde.py; this module only adapts it to LMCache's `Serializer` /
`Deserializer` interfaces (`MemoryObj` in and out) and wraps them in LMCache's
`AsyncSerdeProcessor`. The artifact is pulled and checked when the adapter is built.
"""
from __future__ import annotations

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory
from lmcache.v1.memory_management import MemoryObj

from kvtc.kernels.chunk_serde import ChunkSerdeSettings, ChunkTransform

SERDE_TYPE = "kvtc"


def _tensor(obj: MemoryObj, what: str) -> torch.Tensor:
    t = obj.tensor
    if t is None:
        raise ValueError(f"kvtc serde: the {what} MemoryObj has no tensor")
    return t


class KVTCSerializer(Serializer):
    def __init__(self, transform: ChunkTransform) -> None:
        self.transform = transform

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        data = self.transform.serialize(_tensor(src, "source"))
        out = _tensor(dst, "destination").reshape(-1).view(torch.uint8)
        if out.numel() < len(data):
            raise ValueError(f"kvtc serde: destination holds {out.numel()} bytes, the chunk needs {len(data)}")
        out[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return len(data)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        if len(layout_desc.shapes) != 1:
            raise ValueError(f"kvtc serde codes one KV tensor per object, got {len(layout_desc.shapes)} groups")
        return self.transform.serialized_size(tuple(layout_desc.shapes[0]), layout_desc.dtypes[0])


class KVTCDeserializer(Deserializer):
    def __init__(self, transform: ChunkTransform) -> None:
        self.transform = transform

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        data = _tensor(src, "source").reshape(-1).view(torch.uint8).cpu().numpy()
        self.transform.deserialize(memoryview(data), _tensor(dst, "destination"))


def create_kvtc_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    """LMCache serde factory: kwargs are the "serde" dict without "type"."""
    settings = ChunkSerdeSettings.from_kwargs(dict(kwargs))
    transform = ChunkTransform.from_settings(settings)
    return AsyncSerdeProcessor(KVTCSerializer(transform), KVTCDeserializer(transform),
                               max_workers=settings.max_workers)


if SERDE_TYPE not in get_registered_serde_types():
    register_serde_factory(SERDE_TYPE, create_kvtc_serde)
