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


def _installed_kernels():
    """This file imported as the bare `kernels`: the checkout's root is on sys.path (a script, `python -m` or `-c`
    run from it, `ray job submit --working-dir .`), so its `kernels/` folder was found before the `kernels`
    distribution installed beside transformers (Hugging Face's, which transformers imports). Load that package
    from the path entries other than this checkout's root and stand it in sys.modules["kernels"] (the import
    system hands back what sys.modules holds once this file has run). Without it, ImportError names the clash."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def is_root(entry: str) -> bool:
        try:
            return os.path.samefile(entry or os.curdir, root)
        except OSError:
            return False

    path = [p for p in sys.path if isinstance(p, str) and not is_root(p)]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None or not spec.has_location:  # nothing, or a namespace folder
        raise ImportError("`kernels` here is the kvtc runtime, importable as kvtc.kernels (this checkout's root is on "
                          "sys.path, so its kernels/ folder was found under the bare name); Hugging Face's kernels "
                          "package is not installed", name="kernels")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # before it runs: its own submodules import `kernels`
    spec.loader.exec_module(module)
    return module


if __name__ == "kernels":
    _INSTALLED = _installed_kernels()

    def __getattr__(name: str) -> Any:  # a reference kept to this module object reads the installed package
        return getattr(_INSTALLED, name)
