"""Fetch a version into the local cache ($KVTC_CACHE, default ~/.cache/kvtc), verifying every file.

Local registries are read in place (and verified); remote ones are downloaded into
<cache>/<registry hash>/<name>/<version>/ through a staging folder renamed into place, so a cache
entry is either whole or absent. A cached copy that no longer verifies is fetched again.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

from kvtc.artifacts.artifact import Artifact, safe_relpath, verify_folder
from kvtc.artifacts.errors import IntegrityError
from kvtc.artifacts.manifest import MANIFEST, decode_manifest
from kvtc.artifacts.registry import Registry, as_registry, split_ref


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir or os.environ.get("KVTC_CACHE") or Path.home() / ".cache" / "kvtc").expanduser()


def _download(reg: Registry, name: str, version: str, manifest_bytes: bytes, manifest: dict, dest: Path) -> None:
    staging = dest.parent / f".tmp-{version}-{uuid.uuid4().hex}"
    try:
        prefix = reg.version_path(name, version)
        for rel in manifest["files"]:
            target = staging / safe_relpath(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            reg.fs.get_file(f"{prefix}/{rel}", str(target))
        verify_folder(staging, manifest, f"{reg.uri}: {name}@{version}")
        (staging / MANIFEST).write_bytes(manifest_bytes)
        try:
            os.rename(staging, dest)
        except OSError:
            if not (dest / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def pull(name: str, ref: str = "latest", registry: "Registry | str | None" = None,
         cache_dir: str | os.PathLike | None = None, verify: bool = True) -> Artifact:
    """`name`, `name@version` or `name@alias` -> verified local Artifact.

    Raises ArtifactNotFoundError (unknown name/ref) or IntegrityError naming a tampered or truncated file.
    """
    reg = as_registry(registry)
    name, ref = split_ref(name, ref)
    version = reg.resolve(name, ref)
    prefix = reg.version_path(name, version)
    manifest_bytes = reg.fs.cat_file(f"{prefix}/{MANIFEST}")
    manifest = decode_manifest(manifest_bytes, f"{reg.uri}: {name}@{version}")
    if reg.local:
        return Artifact(prefix, manifest, verify=verify)
    key = hashlib.sha256(reg.uri.encode()).hexdigest()[:16]
    dest = cache_root(cache_dir) / key / name / version
    dest.parent.mkdir(parents=True, exist_ok=True)
    if (dest / MANIFEST).is_file():
        try:
            if (dest / MANIFEST).read_bytes() != manifest_bytes:
                raise IntegrityError(f"cached manifest of {name}@{version} differs from the registry's")
            return Artifact(dest, manifest, verify=verify)
        except IntegrityError:
            shutil.rmtree(dest, ignore_errors=True)
    _download(reg, name, version, manifest_bytes, manifest, dest)
    return Artifact(dest, manifest, verify=False)


def copy_to(artifact: Artifact, directory: str | os.PathLike) -> Path:
    """Copy a verified version folder to `directory` (created; must not already hold a manifest)."""
    target = Path(directory)
    if (target / MANIFEST).exists():
        raise ValueError(f"{target} already holds an artifact; choose an empty directory")
    shutil.copytree(artifact.path, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".claim"))
    return target
