"""Fetch a version into the local cache ($KVTC_CACHE, default ~/.cache/kvtc), verifying every file.

Every registry, local or remote, is read once: the manifest's bytes are checked (digest, pin,
signature) and the files it lists are streamed (at most their listed size, regular files only) into
<cache>/<registry hash>/<name>/<version>/ through a staging folder, verified there and renamed into
place, so a cache entry is either whole or absent, and what the caller gets is the private copy that
was verified, never the registry's files again (a file swapped after the check is never used).
A cached copy that no longer verifies is fetched again.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import uuid
import warnings
from pathlib import Path

from kvtc.artifacts.artifact import Artifact, contained, verify_folder
from kvtc.artifacts.env_values import env_flag
from kvtc.artifacts.errors import IntegrityError
from kvtc.artifacts.local_files import cache_root, stage_folder
from kvtc.artifacts.manifest import DIGEST_FILE, MANIFEST, SIGNATURE_FILE, manifest_digest
from kvtc.artifacts.names import split_ref
from kvtc.artifacts.registry import Registry, as_registry
from kvtc.artifacts.local_files import write_outputs
from kvtc.artifacts.safe_io import MANIFEST_LIMIT, SMALL_FILE, read_limited
from kvtc.artifacts.signing import load_public_key, verify_signature

PUBLIC_KEY_ENV = "KVTC_PUBLIC_KEY"            # default Ed25519 public key (PEM path) to check signatures with
REQUIRE_SIGNATURE_ENV = "KVTC_REQUIRE_SIGNATURE"  # "1": refuse unsigned versions


def _within(root: Path, path: Path) -> Path:
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    if not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise IntegrityError(f"{path} resolves outside the cache {root}; refusing it")
    return path


def _download(reg: Registry, name: str, version: str, manifest_bytes: bytes, manifest: dict, dest: Path,
              signature: bytes | None) -> list[str]:
    """Fetch only the listed files into a staging folder, verify, rename into place; -> damaged optional files."""
    def fill(staging: Path) -> list[str]:
        prefix = reg.version_path(name, version)
        extras = set(manifest.get("extras") or [])
        for rel, entry in manifest["files"].items():
            target = contained(staging, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                try:
                    reg.copy_file(f"{prefix}/{rel}", target, entry["size"], f"{reg.uri}: {name}@{version}: file")
                except FileNotFoundError:
                    raise IntegrityError(f"{reg.uri}: {name}@{version}: file {rel} is listed in the manifest but "
                                         "missing from the registry (deleted?); republish the version") from None
            except IntegrityError:
                if rel not in extras:
                    raise
                target.unlink(missing_ok=True)  # a missing, oversized or special optional file: reported damaged
        damaged = verify_folder(staging, manifest, f"{reg.uri}: {name}@{version}")
        (staging / DIGEST_FILE).write_bytes((manifest_digest(manifest_bytes) + "\n").encode())
        if signature is not None:
            (staging / SIGNATURE_FILE).write_bytes(signature)
        (staging / MANIFEST).write_bytes(manifest_bytes)
        return damaged

    # a concurrent pull that renamed its copy first: that copy stands
    return stage_folder(dest, fill, dest.parent / f".tmp-{version}-{uuid.uuid4().hex}",
                        lambda exc: (dest / MANIFEST).is_file())


def check_signature(reg: Registry, name: str, version: str, manifest_bytes: bytes,
                    public_key: "str | os.PathLike | None", require_signature: bool,
                    signature: bytes | None = None) -> str | None:
    """Verify `signature` (default: the version's manifest.sig) with `public_key` when given; -> the
    signer's key id, or None when unchecked."""
    where = f"{reg.uri}: {name}@{version}"
    if require_signature and not public_key:
        raise ValueError("requiring a signature needs the signer's public key: pass --key PUBLIC.pem "
                         f"(or set ${PUBLIC_KEY_ENV})")
    if not public_key:
        return None
    load_public_key(public_key)  # a bad key file fails even when there is nothing to check
    if signature is None:
        signature = reg.read_signature(name, version)
    if signature is None and not require_signature:
        warnings.warn(f"{where} is not signed; loading it unverified (require signatures with "
                      "--require-signature)", stacklevel=3)
        return None
    return verify_signature(manifest_bytes, signature, public_key, where)


def pull(name: str, ref: str = "latest", registry: "Registry | str | None" = None,
         cache_dir: str | os.PathLike | None = None, verify: bool = True, *,
         public_key: "str | os.PathLike | None" = None, require_signature: bool | None = None) -> Artifact:
    """`name`, `name@version`, `name@alias` or `name@sha256:HEX` -> verified local Artifact.

    The manifest is checked against its digest (and the digest an alias or a sha256 ref pins); with
    `public_key` (default $KVTC_PUBLIC_KEY) its signature is checked, and `require_signature` (default
    $KVTC_REQUIRE_SIGNATURE=1) refuses unsigned versions. Files the manifest does not list are ignored.
    Raises ArtifactNotFoundError (unknown name/ref) or IntegrityError naming what was tampered with.
    The result is the verified private copy (`.digest`: its manifest digest; `.signed_by`: the key id
    that signed it, None when no signature was checked).
    """
    reg = as_registry(registry)
    public_key = public_key or os.environ.get(PUBLIC_KEY_ENV) or None
    if require_signature is None:
        require_signature = env_flag(REQUIRE_SIGNATURE_ENV)
    name, ref = split_ref(name, ref)
    version, digest = reg.resolve_pinned(name, ref)
    manifest_bytes, manifest = reg.read_manifest_bytes(name, version, digest)
    signature = reg.read_signature(name, version)
    signer = check_signature(reg, name, version, manifest_bytes, public_key, require_signature, signature)
    where = os.path.realpath(reg.root) if reg.local else reg.uri
    key = hashlib.sha256(where.encode()).hexdigest()[:16]
    root = cache_root(cache_dir)
    dest = _within(root, root / key / name / version)
    dest.parent.mkdir(parents=True, exist_ok=True)
    artifact = None
    if (dest / MANIFEST).is_file():
        try:
            if read_limited(None, True, str(dest / MANIFEST), MANIFEST_LIMIT, "cached manifest") != manifest_bytes:
                raise IntegrityError(f"cached manifest of {name}@{version} differs from the registry's")
            artifact = Artifact(dest, manifest, verify=verify)
        except IntegrityError:
            shutil.rmtree(dest, ignore_errors=True)
    if artifact is None:
        if dest.is_symlink() or (os.path.lexists(dest) and not dest.is_dir()):
            dest.unlink()
        elif dest.exists():  # a cache entry without its manifest (or with a special one): fetched again
            shutil.rmtree(dest, ignore_errors=True)
        damaged = _download(reg, name, version, manifest_bytes, manifest, dest, signature)
        artifact = Artifact(dest, manifest, verify=False)
        artifact.damaged = damaged
        if damaged:
            warnings.warn(f"{name}@{version}: optional files fail their checks and are refused: {', '.join(damaged)} "
                          "(decoding does not need them)", stacklevel=2)
    artifact.signed_by = signer
    artifact.digest = manifest_digest(manifest_bytes)
    return artifact


def copy_to(artifact: Artifact, directory: str | os.PathLike) -> Path:
    """Copy a verified version's listed files, manifest, digest and signature to `directory`
    (created; must not already hold an artifact, and must not be a file)."""
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} exists and is not a directory; choose a new or empty directory")
    if (target / MANIFEST).exists():
        raise ValueError(f"{target} already holds an artifact; choose an empty directory")
    target.mkdir(parents=True, exist_ok=True)
    files = {}
    for rel in [*artifact.manifest["files"], DIGEST_FILE, SIGNATURE_FILE, MANIFEST]:
        source = artifact.path / rel
        if rel in artifact.damaged or not source.is_file():
            continue
        size = artifact.manifest["files"].get(rel, {}).get("size", SMALL_FILE) if rel != MANIFEST else MANIFEST_LIMIT
        files[rel] = read_limited(None, True, str(source), size, f"cached file of {artifact.name}@{artifact.version}")
    write_outputs(target, files)  # the whole copy or nothing, never through a planted link
    return target
