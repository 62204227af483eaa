"""Serving integrations of the KVTC codec: they call kvtc.kernels.codec and change no byte of what it writes.

`kvtc_cache` (the transformers cache class, `compress_cache` / `restore_cache`), `lmcache_serde` (LMCache's
serde plugin over the codec's chunk format), `lmcache_server` (the `kvtc lmcache-server` launcher) and
`vllm_offload` (vLLM's offloading spec, `spec_module_path` "kvtc.kernels.integrations.vllm_offload").
They are neither shipped with an artifact nor hashed into its kernel bundle: editing one leaves every
artifact's bundle hash unchanged. An integration imports the codec; the codec never imports one.

Importing the package loads nothing (not torch, transformers, LMCache or vLLM): each public name is
imported from its module on first use.
"""
from typing import Any

__all__ = ["KVTCCache", "compress_cache", "restore_cache"]
_HOMES = {"KVTCCache": "kvtc_cache", "compress_cache": "kvtc_cache", "restore_cache": "kvtc_cache"}


def __getattr__(name: str) -> Any:
    """The public names, each imported from its module on first use: importing the package loads nothing."""
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"kvtc.kernels.integrations.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'kvtc.kernels.integrations' has no attribute {name!r}")
