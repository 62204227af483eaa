"""The runtime codec an artifact was made for: its *.py sources travel in the version folder under
kernels/, and one hash names the bundle so a decoder can check it runs the matching code.

The bundle is the codec folder itself, `kvtc/kernels/codec/` (every *.py under it, recursively, its
`__init__.py` included; paths relative to it, so `kernels/spec.py` in a version folder is
`kvtc/kernels/codec/spec.py`): what a decoder must run to read what an encoder wrote. A file added
there joins the bundle; there is no list to keep in step. The serving integrations
(`kvtc/kernels/integrations/`: the transformers cache, LMCache's serde and server, vLLM's tier) call the
codec and change no byte of a blob, so they are neither shipped nor hashed: editing one leaves every
artifact's bundle hash unchanged. Neither is `kvtc/kernels/__init__.py` (lazy names only).

Not in the bundle either: the format's vocabulary the codec imports from kvtc.artifacts (`groups.py`:
a group's feature columns; `blocks.py`: a block type's bits and side information; likewise `schema`,
`fingerprint` and `tensor_parallel`). Their meaning is the artifact format's, not the kernels': the
manifest records each group's layers and heads and each block's type, bits and scale_bits (a
block whose bits are not its type's is refused when published), and the registry reads every version
it published with them (older manifests load unchanged), so their meaning cannot change without a new
manifest schema version. Most of their lines are the calibration's and the registry's checks and messages;
hashing them would warn every server of a kernel mismatch for an edited error message. Their
wire-relevant values are pinned by tests instead (tests/artifacts/test_groups.py: feature column order;
tests/kernels/codec/test_codec.py: block bit widths); docs/registry.md, "The kernel bundle".

Bundle hash = sha256 over the lines "<relative path> <sha256 of file>\\n", sorted by path.
The codec package is located without importing it (importing would load torch/triton; finding it imports
only the light `kvtc.kernels` package).
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

CODEC_PACKAGE = "kvtc.kernels.codec"


def codec_dir(package: str = CODEC_PACKAGE) -> Path | None:
    """Directory of the installed codec package (kvtc/kernels/codec), or None when it is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def kernel_sources(directory: Path | None = None) -> dict[str, bytes]:
    """{posix path relative to the codec folder: source bytes} of every *.py under it (recursively).

    directory: a codec folder (default: the installed one), or a version folder's kernels/."""
    directory = directory if directory is not None else codec_dir()
    if directory is None:
        return {}
    return {path.relative_to(directory).as_posix(): path.read_bytes()
            for path in sorted(directory.rglob("*.py")) if path.is_file()}


def bundle_hash(sources: dict[str, bytes]) -> str | None:
    """Hash of a bundle given as {relative path: bytes}; None for an empty bundle."""
    return digests_hash({rel: hashlib.sha256(data).hexdigest() for rel, data in sources.items()})


def digests_hash(digests: dict[str, str]) -> str | None:
    """The bundle hash, the one formula: sha256 of "path sha256-hex\n" lines in path order, from each file's
    digest (what a manifest lists); None for an empty bundle."""
    if not digests:
        return None
    lines = "".join(f"{rel} {digests[rel]}\n" for rel in sorted(digests))
    return hashlib.sha256(lines.encode()).hexdigest()


def kernel_bundle_hash(directory: Path | str | None = None) -> str | None:
    """Bundle hash of the codec installed here, or of the codec folder `directory` (compare with
    manifest["kernels"]["bundle_sha256"])."""
    return bundle_hash(kernel_sources(Path(directory) if directory is not None else None))
