"""KVTC artifacts: versioned, verified calibration results (bases, allocations, metrics) in a registry.

Light on purpose: importing this package loads numpy, pyarrow and fsspec, never torch, Ray or transformers.

    from kvtc.artifacts import pull
    art = pull("smollm2-135m", ref="production", registry="s3://bucket/kvtc")
    mean, eigenvalues, components = art.basis("keys", group=0)
    blocks = art.allocation(16, "keys", group=0)
"""
from kvtc.artifacts.artifact import Artifact
from kvtc.artifacts.blocks import Block
from kvtc.artifacts.bundle import kernel_bundle_hash
from kvtc.artifacts.calibration import CalibrationRecord
from kvtc.artifacts.errors import ArtifactNotFoundError, IntegrityError, RegistryNotWritableError, VersionExistsError
from kvtc.artifacts.publish import ArtifactRef, publish
from kvtc.artifacts.pull import pull
from kvtc.artifacts.registry import Registry, check_writable
from kvtc.artifacts.schema import SCHEMA_VERSION, STREAMS, ArtifactContent

__all__ = [
    "Artifact", "ArtifactContent", "ArtifactNotFoundError", "ArtifactRef", "Block", "CalibrationRecord", "IntegrityError",
    "Registry", "RegistryNotWritableError", "SCHEMA_VERSION", "STREAMS", "VersionExistsError",
    "check_writable", "kernel_bundle_hash", "publish", "pull",
]
