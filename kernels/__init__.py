"""KVTC runtime codec: Triton kernels with plain-torch references, blob format, a transformers cache.

    from kvtc.kernels import KVTCCodec
    codec = KVTCCodec(artifact, 16)          # or KVTCCodec.from_registry("name@ref", 16, registry=uri)
    blob = codec.encode(keys, values)        # (layers, kv_heads, tokens, head_dim), keys with RoPE
    keys, values = codec.decode(blob)

    cache = KVTCCache(codec, config=model.config)   # model.generate(..., cache=cache)

Importing the package loads nothing (not torch either): each public name is imported from its module
on first use; `KVTCCache`, `compress_cache` and `restore_cache` import transformers then.
"""
from typing import Any

__all__ = ["FORMAT_VERSION", "BlobError", "BlobHeader", "CodecSpec", "CodedBlock", "GroupCode", "KVTCCache",
           "KVTCCodec", "compress_cache", "model_id", "read_blob", "restore_cache"]
_HOMES = {"FORMAT_VERSION": "blob", "BlobError": "blob", "BlobHeader": "blob", "read_blob": "blob", "KVTCCodec": "codec",
          "CodecSpec": "spec", "CodedBlock": "spec", "GroupCode": "spec", "model_id": "spec",
          "KVTCCache": "kvtc_cache", "compress_cache": "kvtc_cache", "restore_cache": "kvtc_cache"}


def __getattr__(name: str) -> Any:
    """The public names, each imported from its module on first use: importing the package loads nothing."""
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"kvtc.kernels.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'kvtc.kernels' has no attribute {name!r}")
