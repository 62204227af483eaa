"""The registry: `<root>/<name>/versions/<version>/...` and `<root>/<name>/aliases/<alias>` on a local
path or any fsspec URI. A version is visible once its manifest.json exists (written last, or the
staged folder renamed into place on a local disk); an alias is one small JSON object
{"version": ..., "digest": ...} replaced in a single write.

Every name, version and alias that becomes a path segment matches names.NAME_PATTERN in full, and
every path is checked to stay under the root. Every manifest read checks the manifest against its
digest file (and against the digest an alias recorded or a NAME@sha256:HEX ref pinned), that it
names the folder it was read from, and that its listing hash holds.

Every read refuses a file that is not a regular file (FIFO, device, directory, symlink) and reads at
most what it may hold (`safe_io`). A version id always means that version: refs resolve version ids
before aliases, and an alias may not be named like a version id.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import posixpath
import re
import uuid
import warnings
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from kvtc.artifacts.local_files import atomic_write
from kvtc.artifacts.errors import ArtifactNotFoundError, IntegrityError, RegistryNotWritableError
from kvtc.artifacts.manifest import (DIGEST_FILE, MANIFEST, SIDECARS, SIGNATURE_FILE, check_digest, decode_manifest,
                                     manifest_digest)
from kvtc.artifacts.safe_io import MANIFEST_LIMIT, SMALL_FILE, copy_limited, read_limited
from kvtc.artifacts.names import NAME_PATTERN, check_name, check_ref, split_ref
from kvtc.artifacts.signing import sign_manifest

DEFAULT_ROOT = "registry"
VERSION_ID_PATTERN = re.compile(r"[0-9]{8}T[0-9]{12}Z-[0-9a-f]{8}")  # manifest.new_version_id's form
RESERVED_ALIASES = ("latest",)


def write_local_atomic(target: str, data: bytes) -> None:
    """Temp file + fsync + rename (kvtc.artifacts.local_files.atomic_write)."""
    atomic_write(target, data)


class Registry:
    """One registry root. `root`: local path or fsspec URI; default $KVTC_REGISTRY or ./registry."""

    def __init__(self, root: str | os.PathLike | None = None, storage_options: dict | None = None) -> None:
        if root is not None and not str(root).strip():
            raise ValueError("the registry URI is empty; pass --registry PATH_OR_URI (or unset it to use "
                             "$KVTC_REGISTRY or ./registry)")
        self.uri = str(root or os.environ.get("KVTC_REGISTRY") or DEFAULT_ROOT)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.uri, **(storage_options or {}))
        except (ImportError, ValueError) as exc:
            raise ValueError(f"registry {self.uri!r} cannot be opened ({exc}); use a path or a supported fsspec URI "
                             "(s3://, gs://, ... with its package installed)") from None
        except OSError as exc:
            raise ConnectionError(f"registry {self.uri} cannot be reached ({type(exc).__name__}: {exc})") from None
        self.root = self.root.rstrip("/") or "/"
        self.local = isinstance(self.fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"Registry({self.uri!r})"

    def path(self, *parts: str) -> str:
        """Join path segments under the root; refuse any that would leave it."""
        for part in parts:
            if not isinstance(part, str) or not part or "/" in part or "\\" in part or part in (".", "..") \
                    or "\0" in part:
                raise IntegrityError(f"unsafe path segment {part!r} under registry {self.uri}; refusing it")
        joined = "/".join([self.root.rstrip("/"), *parts]) if self.root != "/" else "/" + "/".join(parts)
        self.check_under_root(joined)
        return joined

    def check_under_root(self, path: str) -> str:
        """Raise IntegrityError unless `path` (symlinks resolved on a local disk) lies under the root."""
        if self.local:
            root, real = os.path.realpath(self.root), os.path.realpath(path)
        else:
            root, real = posixpath.normpath(self.root), posixpath.normpath(path)
        if real != root and not real.startswith(root.rstrip("/") + "/"):
            raise IntegrityError(f"path {path} resolves outside registry {self.uri}; refusing it")
        return path

    def version_path(self, name: str, version: str) -> str:
        return self.path(name, "versions", version)

    def _fresh(self) -> None:
        if not self.local:
            self.fs.invalidate_cache()

    def exists(self, path: str) -> bool:
        return os.path.lexists(path) if self.local else self.fs.exists(path)

    def read(self, path: str, limit: int, what: str) -> bytes:
        """A regular file's bytes, at most `limit` of them (see safe_io); FileNotFoundError when absent."""
        return read_limited(self.fs, self.local, path, limit, what)

    def read_optional(self, path: str, limit: int, what: str) -> bytes | None:
        try:
            return self.read(path, limit, what)
        except FileNotFoundError:
            return None

    def copy_file(self, path: str, target: Path, size: int, what: str) -> None:
        """Stream a listed file into `target`, refusing more than its `size` bytes or a non-regular file."""
        copy_limited(self.fs, self.local, self.check_under_root(path), target, size, what)

    def names(self) -> list[str]:
        """Artifact names with at least one committed version."""
        return sorted({n for n, _ in self._committed("*", "*")})

    def versions(self, name: str) -> list[str]:
        """Committed version ids of `name`, sorted (auto ids sort by creation time)."""
        return sorted(v for _, v in self._committed(check_name("artifact name", name), "*"))

    def _committed(self, name: str, version: str) -> list[tuple[str, str]]:
        self._fresh()
        found = self.fs.glob(self.path(name, "versions", version, MANIFEST))
        out = []
        for path in found:
            parts = path.rstrip("/").split("/")
            if NAME_PATTERN.fullmatch(parts[-4]) and NAME_PATTERN.fullmatch(parts[-2]):
                out.append((parts[-4], parts[-2]))
        return out

    def aliases(self, name: str) -> dict[str, str]:
        """{alias: version} of `name`."""
        self._fresh()
        directory = self.path(check_name("artifact name", name), "aliases")
        if not self.exists(directory):
            return {}
        out = {}
        for path in sorted(self.fs.ls(directory, detail=False)):
            alias = path.rstrip("/").rsplit("/", 1)[-1]
            if not alias.startswith("."):
                out[alias] = self._read_alias(path)[0]
        return out

    def _read_alias(self, path: str) -> tuple[str, str | None]:
        """-> (version, recorded manifest digest or None); the version must be a valid id."""
        try:
            record = json.loads(self.read(self.check_under_root(path), SMALL_FILE, "alias file"))
            version, digest = record["version"], record.get("digest")
        except (ValueError, KeyError, TypeError, AttributeError, IsADirectoryError) as exc:
            raise ValueError(f"alias file {path} is unreadable ({type(exc).__name__}); re-set it with "
                             "`kvtc alias`") from None
        try:
            check_name("version", version)
            if digest is not None:
                check_ref(digest)
                if not digest.startswith("sha256:"):
                    raise ValueError(digest)
        except ValueError:
            raise IntegrityError(f"alias file {path} points at an invalid version or digest {version!r}; "
                                 "refusing it (re-set it with `kvtc alias`)") from None
        return version, digest

    def resolve(self, name: str, ref: str = "latest") -> str:
        """Version id, alias or sha256 digest -> committed version id (a version id always means that version)."""
        return self.resolve_pinned(name, ref)[0]

    def resolve_pinned(self, name: str, ref: str = "latest") -> tuple[str, str | None]:
        """-> (version id, the manifest digest the ref pins: a digest ref's, an alias's record, or None)."""
        name, ref = split_ref(name, ref)
        self._fresh()
        if ref.startswith("sha256:"):
            return self.find_digest(name, ref), ref
        if self.exists(self.path(name, "versions", ref, MANIFEST)):
            return ref, None  # a version id is never shadowed by an alias of the same spelling
        alias_path = self.path(name, "aliases", ref)
        version, digest = self._read_alias(alias_path) if self.exists(alias_path) else (ref, None)
        if not self.exists(self.path(name, "versions", version, MANIFEST)):
            known = self.versions(name)
            if not known:
                raise ArtifactNotFoundError(f"no artifact named {name!r} in registry {self.uri}")
            what = f"alias {ref!r} -> version {version!r}" if version != ref else f"version or alias {ref!r}"
            raise ArtifactNotFoundError(f"{name}: {what} not found in {self.uri}; versions: {', '.join(known[-5:])}")
        return version, digest

    def find_digest(self, name: str, digest: str) -> str:
        """The version whose manifest has this digest (reads the recorded digests, newest first)."""
        for version in reversed(self.versions(name)):
            try:
                recorded = self.read(self.path(name, "versions", version, DIGEST_FILE), SMALL_FILE,
                                     "digest file").decode().strip()
            except (OSError, UnicodeDecodeError, IntegrityError):
                continue
            if recorded == digest:
                return version
        raise ArtifactNotFoundError(f"{name}: no version with manifest digest {digest} in {self.uri}")

    def read_manifest_bytes(self, name: str, version: str, digest: str | None = None) -> tuple[bytes, dict]:
        """-> (manifest.json bytes, checked manifest); IntegrityError when tampered (see the module doc)."""
        where = f"{self.uri}: {name}@{version}"
        prefix = self.version_path(check_name("artifact name", name), check_name("version", version))
        try:
            data = self.read(f"{prefix}/{MANIFEST}", MANIFEST_LIMIT, f"{where}: manifest")
        except FileNotFoundError:
            raise ArtifactNotFoundError(f"{where}: no {MANIFEST}") from None
        except (IsADirectoryError, PermissionError, NotADirectoryError) as exc:
            raise IntegrityError(f"{where}: {MANIFEST} cannot be read as a file ({type(exc).__name__})") from None
        try:
            recorded = self.read_optional(f"{prefix}/{DIGEST_FILE}", SMALL_FILE, f"{where}: digest file")
        except (IsADirectoryError, PermissionError, NotADirectoryError):
            recorded = b""
        check_digest(data, recorded, digest, where)
        return data, decode_manifest(data, where, name, version)

    def read_manifest(self, name: str, version: str, digest: str | None = None) -> dict:
        return self.read_manifest_bytes(name, version, digest)[1]

    def read_signature(self, name: str, version: str) -> bytes | None:
        """manifest.sig's bytes, or None when the version is unsigned; IntegrityError for a non-regular file."""
        try:
            return self.read_optional(f"{self.version_path(name, version)}/{SIGNATURE_FILE}", SMALL_FILE,
                                      f"{self.uri}: {name}@{version}: signature")
        except (IsADirectoryError, PermissionError, NotADirectoryError) as exc:
            raise IntegrityError(f"{self.uri}: {name}@{version}: {SIGNATURE_FILE} cannot be read as a file "
                                 f"({type(exc).__name__}); refusing it") from None

    def unlisted(self, name: str, version: str, manifest: dict) -> list[str]:
        """Files in the version folder that its manifest does not list (ignored by pull)."""
        prefix = self.version_path(name, version).rstrip("/")
        self._fresh()
        found = self.fs.find(prefix)
        rels = [path[len(prefix) + 1:] if path.startswith(prefix + "/") else path for path in found]
        return sorted(rel for rel in rels if rel not in manifest["files"] and rel not in SIDECARS)

    def sign(self, name: str, version: str, private_key: str | os.PathLike) -> str:
        """Sign a committed version's manifest (adds manifest.sig; the version's files are untouched) -> key id."""
        data, _ = self.read_manifest_bytes(name, version)
        signature = sign_manifest(data, private_key)
        target = f"{self.version_path(name, version)}/{SIGNATURE_FILE}"
        if self.local:
            write_local_atomic(target, signature)
        else:
            self.fs.pipe_file(target, signature)
        return json.loads(signature)["key_id"]

    def adopt(self, name: str, version: str) -> str:
        """Write the digest file of a version published before digests existed (trust on first use:
        run `kvtc verify --adopt` where the registry is trusted); -> its digest. The caller verifies the files."""
        prefix = self.version_path(check_name("artifact name", name), check_name("version", version))
        if self.exists(f"{prefix}/{DIGEST_FILE}"):
            raise ValueError(f"{name}@{version} already has a {DIGEST_FILE}; nothing to adopt")
        data = self.read(f"{prefix}/{MANIFEST}", MANIFEST_LIMIT, f"{self.uri}: {name}@{version}: manifest")
        decode_manifest(data, f"{self.uri}: {name}@{version}", name, version)
        digest = manifest_digest(data)
        record = (digest + "\n").encode()
        if self.local:
            write_local_atomic(f"{prefix}/{DIGEST_FILE}", record)
        else:
            self.fs.pipe_file(f"{prefix}/{DIGEST_FILE}", record)
        return digest

    def set_alias(self, name: str, alias: str, version: str) -> None:
        """Point `alias` at a committed `version` (recording its manifest digest), atomically
        (temp file + rename with the process umask, or one PUT)."""
        check_alias_name(alias)
        if alias not in RESERVED_ALIASES and self.exists(self.path(check_name("artifact name", name), "versions", alias)):
            raise ValueError(f"alias {alias!r} is the id of a version of {name}; a version id always means that "
                             "version: choose another alias name")
        version = self.resolve(name, version)
        data, _ = self.read_manifest_bytes(name, version)
        record = json.dumps({"version": version, "digest": manifest_digest(data),
                             "set": dt.datetime.now(dt.timezone.utc).isoformat()}).encode()
        target = self.path(name, "aliases", alias)
        if self.local:
            write_local_atomic(target, record)
        else:
            self.fs.pipe_file(target, record)

    def move_latest(self, name: str, version: str) -> str:
        """Point `latest` at the newest version published for it (by creation time, then id), whoever writes last.

        Each such publish leaves a marker <name>/published/<created>.<version>; after its own write a
        publisher re-lists the markers and rewrites until they agree, so concurrent publishers converge on
        the newest version rather than on the last writer. Versions published without `latest` (a
        recalibration candidate) leave no marker and never become `latest` this way."""
        created = str(self.read_manifest(name, version).get("created", ""))
        stamp = "".join(ch for ch in created if ch.isalnum()) or "0"
        marker = self.path(name, "published", f"{stamp}.{version}")
        if self.local:
            write_local_atomic(marker, b"")
        else:
            self.fs.pipe_file(marker, b"")
        written = None
        for _ in range(20):
            self._fresh()
            newest = self._newest_published(name) or version
            if newest == written:
                break
            self.set_alias(name, "latest", newest)
            written = newest
        return written

    def _newest_published(self, name: str) -> str | None:
        """The newest version with a `published/` marker that still exists; stale markers (version deleted) warn."""
        found = [path.rstrip("/").rsplit("/", 1)[-1] for path in self.fs.ls(self.path(name, "published"), detail=False)]
        entries = sorted((f for f in found if "." in f and f.split(".", 1)[0].isalnum()
                          and NAME_PATTERN.fullmatch(f.split(".", 1)[1])), reverse=True)
        for entry in entries:
            version = entry.split(".", 1)[1]
            if self.exists(self.path(name, "versions", version, MANIFEST)):
                return version
            warnings.warn(f"{self.uri}: {name}/published/{entry} names version {version}, which no longer exists; "
                          "skipping it for `latest` (delete the marker to silence this)", stacklevel=3)
        return None

    def check_writable(self) -> None:
        """Write and delete a probe object under the root; raise RegistryNotWritableError if that fails."""
        probe = self.path(f".kvtc-write-probe-{uuid.uuid4().hex}")
        try:
            if self.local:
                os.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"probe")
            self.fs.rm_file(probe)
        except Exception as exc:  # any backend error means "cannot publish here"
            raise RegistryNotWritableError(
                f"registry {self.uri} is not writable ({type(exc).__name__}: {exc}); set --registry or "
                "KVTC_REGISTRY to a writable path or URI, or fix its credentials, before calibrating") from None


def check_alias_name(alias: str) -> str:
    """An alias name: a valid name that does not read as a version id (those always mean their version)."""
    check_name("alias", alias)
    if VERSION_ID_PATTERN.fullmatch(alias):
        raise ValueError(f"alias {alias!r} reads as a version id; a version id always means that version: "
                         "choose another alias name")
    return alias


def as_registry(registry: "Registry | str | os.PathLike | None") -> Registry:
    return registry if isinstance(registry, Registry) else Registry(registry)


def check_writable(registry: "Registry | str | os.PathLike | None" = None) -> None:
    """Raise RegistryNotWritableError (a PermissionError) unless `registry` can be published to."""
    as_registry(registry).check_writable()
