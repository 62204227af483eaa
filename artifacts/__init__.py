"""KVTC artifacts: versioned, verified calibration results (bases, allocations, metrics) in a registry.

    from kvtc.artifacts import pull
    art = pull("smollm2-135m", ref="production", registry="s3://bucket/kvtc")
    mean, eigenvalues, components = art.basis("keys", group=0)
    blocks = art.allocation(16, "keys", group=0)

Importing the package loads nothing: each public name is imported from its module on first use (numpy, pyarrow
and fsspec then, never torch, Ray or transformers), so a command line that imports one light module of it (the
ratio rule in `blocks`, the environment words in `env_values`) refuses bad input before numpy or pyarrow load.
"""
import importlib
from typing import Any

__all__ = [
    "Artifact", "ArtifactContent", "ArtifactNotFoundError", "ArtifactRef", "Block", "CalibrationRecord", "IntegrityError",
    "Registry", "RegistryNotWritableError", "SCHEMA_VERSION", "STREAMS", "VersionExistsError",
    "check_writable", "kernel_bundle_hash", "publish", "pull",
]
_HOMES = {"Artifact": "artifact", "Block": "blocks", "kernel_bundle_hash": "bundle", "CalibrationRecord": "calibration",
          "ArtifactNotFoundError": "errors", "IntegrityError": "errors", "RegistryNotWritableError": "errors",
          "VersionExistsError": "errors", "ArtifactRef": "publish", "publish": "publish", "pull": "pull",
          "Registry": "registry", "check_writable": "registry", "SCHEMA_VERSION": "schema", "STREAMS": "schema",
          "ArtifactContent": "schema"}


def __getattr__(name: str) -> Any:
    """The public names, each imported from its module on first use: importing the package loads nothing."""
    if name in _HOMES:
        value = getattr(importlib.import_module(f"kvtc.artifacts.{_HOMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvtc.artifacts' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
