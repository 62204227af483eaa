"""KVTC artifacts: versioned, verified calibration results (bases, allocations, metrics) in a registry.

Light on purpose: importing this package loads numpy, pyarrow and fsspec, never torch, Ray or transformers.

    from artifacts import pull
    art = pull("smollm2-135m", ref="production", registry="s3://bucket/kvtc")
    mean, eigenvalues, components = art.basis("keys", group=0)
    blocks = art.allocation(16, "keys", group=0)
"""
from artifacts.artifact import Artifact
from artifacts.bundle import kernel_bundle_hash
from artifacts.errors import ArtifactNotFoundError, IntegrityError, RegistryNotWritableError, VersionExistsError
from artifacts.publish import ArtifactRef, publish
from artifacts.pull import pull
from artifacts.registry import Registry, check_writable
from artifacts.schema import SCHEMA_VERSION, STREAMS, ArtifactContent, Block

__all__ = [
    "Artifact", "ArtifactContent", "ArtifactNotFoundError", "ArtifactRef", "Block", "IntegrityError",
    "Registry", "RegistryNotWritableError", "SCHEMA_VERSION", "STREAMS", "VersionExistsError",
    "check_writable", "kernel_bundle_hash", "publish", "pull",
]
