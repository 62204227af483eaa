"""Errors raised by the artifact registry; each subclasses a built-in the `kvtc` CLI reports cleanly."""
from __future__ import annotations


class ArtifactNotFoundError(FileNotFoundError):
    """A name, version, alias or file that the registry does not hold."""


class IntegrityError(RuntimeError):
    """A stored file whose size or sha256 does not match the manifest (tampered or truncated)."""


class VersionExistsError(RuntimeError):
    """Publishing a version id that already exists (versions are immutable)."""


class RegistryNotWritableError(PermissionError):
    """The registry root cannot be written (checked before any model work)."""
