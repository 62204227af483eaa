"""The KVTC runtime codec: what a decoder must run to read what an encoder wrote.

Spec (`spec`), codec (`kvtc_codec.KVTCCodec`) and its modes (`modes`: `fixed_mode`, `ecsq_mode`), blob and
chunk formats (`blob`, `layered`, `chunk_serde`), the coefficient coder a cache keeps resident
(`coefficients`), quantizers (Triton kernels and their torch references), RoPE removal, ECSQ and
interleaved rANS, and the check of a model config against an artifact (`model_config`). Every *.py of this folder, this file included, is the kernel bundle an artifact names
(kvtc.artifacts.bundle hashes the folder and ships it in the version folder); nothing here imports
kvtc.kernels.integrations.

Importing the package loads nothing (not torch either): each public name is imported from its module on
first use, and `from kvtc.kernels.codec import ecsq` imports that module.
"""
from typing import Any

__all__ = ["FORMAT_VERSION", "BlobError", "BlobHeader", "CodecSpec", "CodedBlock", "GroupCode", "KVTCCodec",
           "check_config", "model_id", "read_blob"]
_HOMES = {"FORMAT_VERSION": "blob", "BlobError": "blob", "BlobHeader": "blob", "read_blob": "blob",
          "KVTCCodec": "kvtc_codec", "CodecSpec": "spec", "CodedBlock": "spec", "GroupCode": "spec", "model_id": "spec",
          "check_config": "model_config"}


def __getattr__(name: str) -> Any:
    """The public names, each imported from its module on first use: importing the package loads nothing."""
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"kvtc.kernels.codec.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'kvtc.kernels.codec' has no attribute {name!r}")
