"""Error kinds. Each subclasses a built-in; the `kvtc` CLI maps them to exit codes: bad input (a
ValueError, LookupError or OSError, and InputError for what is neither) exits 2 with one line,
IntegrityError 6; anything else is a bug (exit 1, traceback with --debug)."""
from __future__ import annotations


class InputError(ValueError):
    """Bad input or environment the user can fix (a model the project cannot calibrate, a missing
    optional package, a store another job changed); the message says what to do."""


class ArtifactNotFoundError(FileNotFoundError):
    """A name, version, alias or file that the registry does not hold."""


class IntegrityError(RuntimeError):
    """A stored file whose size or sha256 does not match the manifest (tampered or truncated)."""


class VersionExistsError(FileExistsError):
    """Publishing a version id that already exists (versions are immutable)."""


class RegistryNotWritableError(PermissionError):
    """The registry root cannot be written (checked before any model work)."""


class CorruptArtifactError(IntegrityError, ValueError):
    """A listed file that passes its sha256 but does not hold what the manifest declares (a forged or
    damaged version): exit 6 like any IntegrityError, and a ValueError for callers that catch bad content."""
