"""KVTC runtime: the codec (`kernels/codec/`) and the serving integrations built on it (`kernels/integrations/`).

    from kvtc.kernels import KVTCCodec
    codec = KVTCCodec(artifact, 16)          # or KVTCCodec.from_registry("name@ref", 16, registry=uri)
    blob = codec.encode(keys, values)        # (layers, kv_heads, tokens, head_dim), keys with RoPE
    keys, values = codec.decode(blob)

    cache = KVTCCache(codec, config=model.config)   # model.generate(..., cache=cache)

`kvtc.kernels.codec` is what a decoder must run to read what an encoder wrote (Triton kernels, plain-torch
references, the blob and chunk formats, rANS): the kernel bundle an artifact names is that folder's hash.
`kvtc.kernels.integrations` adapts it to servers (the transformers cache, LMCache's serde and server,
vLLM's offloading tier); an integration imports the codec, the codec never imports an integration.

Importing the package loads nothing (not torch either): each public name is imported from its module
on first use; `KVTCCache`, `compress_cache` and `restore_cache` import transformers then.
"""
from typing import Any

__all__ = ["FORMAT_VERSION", "BlobError", "BlobHeader", "CodecSpec", "CodedBlock", "GroupCode", "KVTCCache",
           "KVTCCodec", "compress_cache", "model_id", "read_blob", "restore_cache"]
_HOMES = {"FORMAT_VERSION": "codec.blob", "BlobError": "codec.blob", "BlobHeader": "codec.blob", "read_blob": "codec.blob",
          "KVTCCodec": "codec.kvtc_codec", "CodecSpec": "codec.spec", "CodedBlock": "codec.spec", "GroupCode": "codec.spec",
          "model_id": "codec.spec", "KVTCCache": "integrations.kvtc_cache", "compress_cache": "integrations.kvtc_cache",
          "restore_cache": "integrations.kvtc_cache"}


def __getattr__(name: str) -> Any:
    """The public names, each imported from its module on first use: importing the package loads nothing."""
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"kvtc.kernels.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'kvtc.kernels' has no attribute {name!r}")
