"""The runtime kernels an artifact was made for: their *.py sources travel in the version folder
under kernels/, and one hash names the bundle so a decoder can check it runs the matching code.

Bundle hash = sha256 over the lines "<relative path> <sha256 of file>\\n", sorted by path.
The `kernels` package is located without importing it (importing would load torch/triton).
The bundle is the runtime codec (CODEC: what a decoder must run to read what an encoder wrote); the
serving integrations beside it (INTEGRATIONS) call the codec and change no byte of a blob, so they are
neither shipped nor hashed: editing one leaves every artifact's bundle hash unchanged.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path


# every file of kvtc/kernels is in exactly one of the two (tests/kernels/test_codec.py checks it)
CODEC = frozenset({
    "__init__.py", "spec.py", "codec.py", "blob.py", "layered.py", "layout.py", "layers.py", "coefficients.py",
    "backend.py", "bitpack.py", "quantize.py", "dequantize.py", "reference.py", "rope.py", "rope_center.py",
    "entropy.py", "ecsq.py", "rans.py", "rans_numba.py", "rans_triton.py", "chunk_serde.py",
})
INTEGRATIONS = frozenset({
    "kvtc_cache.py",  # the transformers cache class
    "lmcache_serde.py",  # LMCache's serde plugin (its chunk format is chunk_serde.py, in the codec)
    "lmcache_server.py",  # the `kvtc lmcache-server` launcher
    "lmcache_client.py",  # LMCache's multiprocess client, as the live test and bench drive the server
    "vllm_offload.py",  # vLLM's OffloadingSpec (kv_connector_extra_config)
})


def kernels_dir(package: str = "kvtc.kernels") -> Path | None:
    """Directory of the installed kernels package, or None when it is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def kernel_sources(directory: Path | None = None) -> dict[str, bytes]:
    """{relative posix path: source bytes} of the runtime codec's files (CODEC) in the kernels package."""
    directory = directory if directory is not None else kernels_dir()
    if directory is None:
        return {}
    return {path.relative_to(directory).as_posix(): path.read_bytes()
            for path in sorted(directory.rglob("*.py"))
            if path.relative_to(directory).as_posix() in CODEC}


def bundle_hash(sources: dict[str, bytes]) -> str | None:
    """Hash of a bundle given as {relative path: bytes}; None for an empty bundle."""
    if not sources:
        return None
    lines = "".join(f"{rel} {hashlib.sha256(data).hexdigest()}\n" for rel, data in sorted(sources.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def kernel_bundle_hash(directory: Path | str | None = None) -> str | None:
    """Bundle hash of the kernels installed here (compare with manifest["kernels"]["bundle_sha256"])."""
    return bundle_hash(kernel_sources(Path(directory) if directory is not None else None))
