"""The runtime kernels an artifact was made for: their *.py sources travel in the version folder
under kernels/, and one hash names the bundle so a decoder can check it runs the matching code.

Bundle hash = sha256 over the lines "<relative path> <sha256 of file>\\n", sorted by path.
The `kernels` package is located without importing it (importing would load torch/triton).
Test and bench fixtures that live beside the kernels (FIXTURES) are not runtime code: they are
neither shipped nor hashed, so editing one does not change the bundle.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path


FIXTURES = frozenset({"synthetic.py"})  # synthetic specs and caches for tests and benches


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
    """{relative posix path: source bytes} of every runtime *.py file under the kernels package."""
    directory = directory if directory is not None else kernels_dir()
    if directory is None:
        return {}
    return {path.relative_to(directory).as_posix(): path.read_bytes()
            for path in sorted(directory.rglob("*.py"))
            if "__pycache__" not in path.parts and path.relative_to(directory).as_posix() not in FIXTURES}


def bundle_hash(sources: dict[str, bytes]) -> str | None:
    """Hash of a bundle given as {relative path: bytes}; None for an empty bundle."""
    if not sources:
        return None
    lines = "".join(f"{rel} {hashlib.sha256(data).hexdigest()}\n" for rel, data in sorted(sources.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def kernel_bundle_hash(directory: Path | str | None = None) -> str | None:
    """Bundle hash of the kernels installed here (compare with manifest["kernels"]["bundle_sha256"])."""
    return bundle_hash(kernel_sources(Path(directory) if directory is not None else None))
