"""Publish a version atomically and move `latest` to it.

Local disk: write everything (manifest last) into <name>/.staging/<unique>/, then os.rename it to
versions/<version>; the rename fails if the version exists, so versions are never overwritten.
Object stores (no atomic rename): claim the version with a create-exclusive .claim object, write the
files under the version prefix, then the manifest (create-exclusive where the store supports it);
readers ignore a version without manifest. A claim left by a killed publisher expires after
CLAIM_STALE_S; auto-generated ids are unique, so the next publish never waits for it.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass

from kvtc.artifacts.errors import ArtifactNotFoundError, VersionExistsError
from kvtc.artifacts.manifest import (DIGEST_FILE, MANIFEST, SIGNATURE_FILE, build_files, build_manifest,
                                     encode_manifest, manifest_digest)
from kvtc.artifacts.names import split_ref
from kvtc.artifacts.registry import RESERVED_ALIASES, Registry, as_registry
from kvtc.artifacts.local_files import stage_folder, write_outputs
from kvtc.artifacts.safe_io import SMALL_FILE
from kvtc.artifacts.schema import ArtifactContent
from kvtc.artifacts.signing import load_private_key, sign_manifest

CLAIM_STALE_S = 600.0
STAGING_STALE_S = 86400.0
PAUSE_ENV = "KVTC_TEST_PAUSE_AT"  # test hook: sleep at this point so a test can kill the publisher
SIGNING_KEY_ENV = "KVTC_SIGNING_KEY"  # default Ed25519 private key (PEM path) every publish signs with


@dataclass(frozen=True)
class ArtifactRef:
    """A published version: registry URI, name, version id, its folder there, and the manifest."""

    registry: str
    name: str
    version: str
    path: str
    manifest: dict = dataclasses.field(repr=False)

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


def _pause(point: str) -> None:
    if os.environ.get(PAUSE_ENV) == point:
        print(f"KVTC_PAUSED {point}", flush=True)
        time.sleep(3600)


def _write_local(path: str, data: bytes) -> None:
    write_outputs(os.path.dirname(path), {os.path.basename(path): data})  # temp + rename, never through a link


def _sweep_staging(directory: str) -> None:
    """Remove staging folders that killed publishers left behind more than STAGING_STALE_S ago."""
    if not os.path.isdir(directory):
        return
    for entry in os.scandir(directory):
        try:
            if time.time() - entry.stat().st_mtime > STAGING_STALE_S:
                shutil.rmtree(entry.path, ignore_errors=True)
        except FileNotFoundError:
            continue


def _sidecars(manifest: bytes, signing_key: str | None) -> dict[str, bytes]:
    """The digest file (always) and the signature (with a key), written just before the manifest."""
    out = {DIGEST_FILE: (manifest_digest(manifest) + "\n").encode()}
    if signing_key:
        out[SIGNATURE_FILE] = sign_manifest(manifest, signing_key)
    return out


def _commit_local(reg: Registry, name: str, version: str, files: dict[str, bytes], manifest: bytes) -> None:
    _sweep_staging(reg.path(name, ".staging"))
    target = reg.version_path(name, version)
    if os.path.exists(target):
        raise VersionExistsError(f"{name}@{version} already exists in {reg.uri}; versions are immutable")
    def fill(staging) -> None:
        for rel, data in files.items():
            _write_local(os.path.join(staging, rel), data)
        _pause("before_commit")
        _write_local(os.path.join(staging, MANIFEST), manifest)

    def taken(exc: OSError) -> bool:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise VersionExistsError(f"{name}@{version} was published concurrently; versions are immutable") from None
        return False

    stage_folder(target, fill, reg.path(name, ".staging", f"{version}.{uuid.uuid4().hex}"), taken)


def _create(reg: Registry, path: str, data: bytes) -> bool:
    """Create-exclusive write; False if the object exists. Stores without 'xb' fall back to check-then-write."""
    try:
        with reg.fs.open(path, "xb") as handle:
            handle.write(data)
        return True
    except FileExistsError:
        return False
    except (NotImplementedError, ValueError, TypeError):
        reg.fs.invalidate_cache()
        if reg.fs.exists(path):
            return False
        reg.fs.pipe_file(path, data)
        return True


def _commit_object(reg: Registry, name: str, version: str, files: dict[str, bytes], manifest: bytes) -> None:
    prefix = reg.version_path(name, version)
    exists = VersionExistsError(f"{name}@{version} already exists in {reg.uri}; versions are immutable")
    token = json.dumps({"token": uuid.uuid4().hex, "time": time.time()}).encode()
    claim = f"{prefix}/.claim"
    reg.fs.invalidate_cache()
    if reg.fs.exists(f"{prefix}/{MANIFEST}"):
        raise exists
    if not _create(reg, claim, token):
        held = json.loads(reg.read(claim, SMALL_FILE, "publish claim"))
        if time.time() - float(held.get("time", 0)) < CLAIM_STALE_S:
            raise VersionExistsError(f"{name}@{version} is being published by another process (or one died less "
                                     f"than {CLAIM_STALE_S:.0f} s ago); pick another version id or retry later")
        reg.fs.pipe_file(claim, token)
    reg.fs.invalidate_cache()
    if reg.fs.exists(f"{prefix}/{MANIFEST}"):
        raise exists
    for rel, data in files.items():
        reg.fs.pipe_file(f"{prefix}/{rel}", data)
    _pause("before_commit")
    if reg.read(claim, SMALL_FILE, "publish claim") != token:
        raise VersionExistsError(f"{name}@{version}: another publisher took over the claim; this publish is abandoned")
    if not _create(reg, f"{prefix}/{MANIFEST}", manifest):
        raise exists


def publish(content: ArtifactContent, registry: "Registry | str | None" = None, version: str | None = None,
            alias_latest: bool = True, signing_key: "str | os.PathLike | None" = None) -> ArtifactRef:
    """Write `content` as a new immutable version of `content.name`; move `latest` to the newest version.

    version: explicit id (letters, digits, '.', '_', '-'); default UTC time + content hash (sortable).
    signing_key: Ed25519 private key (PEM path) to sign the manifest with; default $KVTC_SIGNING_KEY.
    Raises VersionExistsError for an explicit id that exists; retries a fresh auto id on a collision.
    """
    reg = as_registry(registry)
    signing_key = signing_key or os.environ.get(SIGNING_KEY_ENV) or None
    if signing_key:
        load_private_key(signing_key)  # a bad key fails before anything is written
    parent = content.parent
    if parent is not None:
        pname, pref = split_ref(parent if "@" in parent else f"{content.name}@{parent}")
        try:
            parent = f"{pname}@{reg.resolve(pname, pref)}" if pname != content.name else reg.resolve(pname, pref)
        except ArtifactNotFoundError as exc:
            raise ValueError(f"parent {content.parent!r} does not exist: {exc}") from None
    if version is not None and (version in RESERVED_ALIASES or reg.exists(reg.path(content.name, "aliases", version))):
        raise ValueError(f"version id {version!r} is an alias of {content.name}; a version id always means that "
                         "version: choose another id")
    files, parts = build_files(content)
    commit = _commit_local if reg.local else _commit_object
    for attempt in range(5):
        manifest = build_manifest(content, version, files, parts, parent)
        manifest_bytes = encode_manifest(manifest)
        try:
            commit(reg, content.name, manifest["version"], {**files, **_sidecars(manifest_bytes, signing_key)},
                   manifest_bytes)
            break
        except VersionExistsError:
            if version is not None or attempt == 4:
                raise
            print(f"kvtc: version id {manifest['version']} collided; retrying", file=sys.stderr)
    if alias_latest:
        reg.move_latest(content.name, manifest["version"])
    path = reg.version_path(content.name, manifest["version"])
    return ArtifactRef(reg.uri, content.name, manifest["version"], path if reg.local else reg.fs.unstrip_protocol(path),
                       manifest)
