"""The registry: `<root>/<name>/versions/<version>/...` and `<root>/<name>/aliases/<alias>` on a local
path or any fsspec URI. A version is visible once its manifest.json exists (written last, or the
staged folder renamed into place on a local disk); an alias is one small JSON object
{"version": ...} replaced in a single write.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

from kvtc.artifacts.errors import ArtifactNotFoundError, RegistryNotWritableError
from kvtc.artifacts.manifest import MANIFEST, decode_manifest
from kvtc.artifacts.schema import check_name

DEFAULT_ROOT = "registry"


def split_ref(spec: str, ref: str | None = None) -> tuple[str, str]:
    """"name", "name@version" or "name@alias" (+ optional explicit ref) -> (name, ref); default ref "latest"."""
    name, _, inline = spec.partition("@")
    if inline and ref not in (None, "latest", inline):
        raise ValueError(f"{spec!r} already names a ref; do not also pass ref={ref!r}")
    return check_name("artifact name", name), check_name("ref", inline or ref or "latest")


class Registry:
    """One registry root. `root`: local path or fsspec URI; default $KVTC_REGISTRY or ./registry."""

    def __init__(self, root: str | os.PathLike | None = None, storage_options: dict | None = None) -> None:
        self.uri = str(root or os.environ.get("KVTC_REGISTRY") or DEFAULT_ROOT)
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, **(storage_options or {}))
        self.root = self.root.rstrip("/") or "/"
        self.local = isinstance(self.fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"Registry({self.uri!r})"

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts]) if self.root != "/" else "/" + "/".join(parts)

    def version_path(self, name: str, version: str) -> str:
        return self.path(name, "versions", version)

    def _fresh(self) -> None:
        if not self.local:
            self.fs.invalidate_cache()

    def exists(self, path: str) -> bool:
        return os.path.exists(path) if self.local else self.fs.exists(path)

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
            if not parts[-2].startswith("."):
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
                out[alias] = self._read_alias(path)
        return out

    def _read_alias(self, path: str) -> str:
        try:
            return json.loads(self.fs.cat_file(path))["version"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"alias file {path} is unreadable ({exc}); re-set it with `kvtc alias`") from None

    def resolve(self, name: str, ref: str = "latest") -> str:
        """Alias or version id -> committed version id (aliases win over versions of the same spelling)."""
        name, ref = split_ref(name, ref)
        self._fresh()
        alias_path = self.path(name, "aliases", ref)
        version = self._read_alias(alias_path) if self.exists(alias_path) else ref
        if not self.exists(self.path(name, "versions", version, MANIFEST)):
            known = self.versions(name)
            if not known:
                raise ArtifactNotFoundError(f"no artifact named {name!r} in registry {self.uri}")
            what = f"alias {ref!r} -> version {version!r}" if version != ref else f"version or alias {ref!r}"
            raise ArtifactNotFoundError(f"{name}: {what} not found in {self.uri}; versions: {', '.join(known[-5:])}")
        return version

    def read_manifest(self, name: str, version: str) -> dict:
        data = self.fs.cat_file(self.path(name, "versions", version, MANIFEST))
        return decode_manifest(data, f"{self.uri}/{name}/versions/{version}")

    def set_alias(self, name: str, alias: str, version: str) -> None:
        """Point `alias` at a committed `version`, atomically (temp file + rename, or one PUT)."""
        check_name("alias", alias)
        version = self.resolve(name, version)
        data = json.dumps({"version": version, "set": dt.datetime.now(dt.timezone.utc).isoformat()}).encode()
        target = self.path(name, "aliases", alias)
        if self.local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-")
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        else:
            self.fs.pipe_file(target, data)

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


def as_registry(registry: "Registry | str | os.PathLike | None") -> Registry:
    return registry if isinstance(registry, Registry) else Registry(registry)


def check_writable(registry: "Registry | str | os.PathLike | None" = None) -> None:
    """Raise RegistryNotWritableError (a PermissionError) unless `registry` can be published to."""
    as_registry(registry).check_writable()
