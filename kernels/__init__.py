"""KVTC runtime codec: Triton kernels with plain-torch references, blob format, DynamicCache glue.

    from kvtc.kernels import KVTCCodec
    codec = KVTCCodec(artifact, 16)          # or KVTCCodec.from_registry("name@ref", 16, registry=uri)
    blob = codec.encode(keys, values)        # (layers, kv_heads, tokens, head_dim), keys with RoPE
    keys, values = codec.decode(blob)

Imports neither transformers nor ray.
"""
from kvtc.kernels.blob import FORMAT_VERSION, BlobError, BlobHeader, read_blob
from kvtc.kernels.codec import KVTCCodec
from kvtc.kernels.hf_cache import compress_cache, restore_cache
from kvtc.kernels.spec import CodecSpec, CodedBlock, GroupCode, model_id

__all__ = ["FORMAT_VERSION", "BlobError", "BlobHeader", "CodecSpec", "CodedBlock", "GroupCode", "KVTCCodec",
           "compress_cache", "model_id", "read_blob", "restore_cache"]
