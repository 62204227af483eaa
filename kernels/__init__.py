"""KVTC runtime codec: Triton kernels with plain-torch references, blob format, a transformers cache.

    from kvtc.kernels import KVTCCodec
    codec = KVTCCodec(artifact, 16)          # or KVTCCodec.from_registry("name@ref", 16, registry=uri)
    blob = codec.encode(keys, values)        # (layers, kv_heads, tokens, head_dim), keys with RoPE
    keys, values = codec.decode(blob)

    cache = KVTCCache(codec, config=model.config)   # model.generate(..., cache=cache)

Imports neither transformers nor ray; `KVTCCache`, `compress_cache` and `restore_cache` import
transformers on first use.
"""
from typing import Any

from kvtc.kernels.blob import FORMAT_VERSION, BlobError, BlobHeader, read_blob
from kvtc.kernels.codec import KVTCCodec
from kvtc.kernels.spec import CodecSpec, CodedBlock, GroupCode, model_id

__all__ = ["FORMAT_VERSION", "BlobError", "BlobHeader", "CodecSpec", "CodedBlock", "GroupCode", "KVTCCache",
           "KVTCCodec", "compress_cache", "model_id", "read_blob", "restore_cache"]
_NEEDS_TRANSFORMERS = ("KVTCCache", "compress_cache", "restore_cache")


def __getattr__(name: str) -> Any:
    if name in _NEEDS_TRANSFORMERS:
        from kvtc.kernels import kvtc_cache

        return getattr(kvtc_cache, name)
    raise AttributeError(f"module 'kvtc.kernels' has no attribute {name!r}")
