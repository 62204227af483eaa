"""A verified local copy of one version, as inference servers and the codec read it."""
from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np

from kvtc.artifacts import bundle, ecsq_tables, tables
from kvtc.artifacts.errors import ArtifactNotFoundError, IntegrityError
from kvtc.artifacts.manifest import MANIFEST, decode_manifest
from kvtc.artifacts.schema import STREAMS, Block


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def safe_relpath(rel: str) -> str:
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise IntegrityError(f"manifest lists an unsafe file path {rel!r}")
    return rel


def verify_folder(folder: Path, manifest: dict, where: str) -> None:
    """Check every file listed in the manifest exists with its size and sha256; raise IntegrityError naming it."""
    for rel, expected in manifest["files"].items():
        path = folder / safe_relpath(rel)
        if not path.is_file():
            raise IntegrityError(f"{where}: file {rel} is missing")
        size = path.stat().st_size
        if size != expected["size"]:
            raise IntegrityError(f"{where}: file {rel} has {size} bytes, manifest says {expected['size']} "
                                 "(truncated or replaced); refusing it")
        if file_sha256(path) != expected["sha256"]:
            raise IntegrityError(f"{where}: file {rel} fails its sha256 check (tampered or corrupt); refusing it")


class Artifact:
    """One version on local disk. `.manifest` (dict), `.path`, `.name`, `.version`.

    basis(stream, group) -> (mean (p,), eigenvalues (k,), components (p, k)) float32, components as
    columns, features ordered layer, kv head, head_dim; keys in RoPE-removed space.
    allocation(ratio, stream, group) -> [Block(start, size, type, bits)] in component order.
    """

    def __init__(self, path: str | os.PathLike, manifest: dict | None = None, verify: bool = True) -> None:
        self.path = Path(path)
        if manifest is None:
            manifest_path = self.path / MANIFEST
            if not manifest_path.is_file():
                raise ArtifactNotFoundError(f"{self.path} holds no {MANIFEST}; is it an artifact version folder?")
            manifest = decode_manifest(manifest_path.read_bytes(), str(self.path))
        self.manifest = manifest
        self.name: str = manifest["name"]
        self.version: str = manifest["version"]
        self._bases: dict = {}
        self._allocations: dict | None = None
        self._ecsq: dict | None = None
        if verify:
            self.verify()

    def __repr__(self) -> str:
        return f"Artifact({self.name}@{self.version}, path={str(self.path)!r})"

    def verify(self) -> None:
        """Re-check every file's size and sha256 against the manifest."""
        verify_folder(self.path, self.manifest, f"{self.name}@{self.version}")

    def file(self, rel: str) -> Path:
        """Local path of a listed file (charts, report.md, kernels/...)."""
        if rel not in self.manifest["files"]:
            raise ArtifactNotFoundError(f"{self.name}@{self.version} has no file {rel!r}")
        return self.path / safe_relpath(rel)

    def groups(self) -> list[tuple[int, int]]:
        return [tuple(g) for g in self.manifest["calibration"]["groups"]]

    def ratios(self) -> list[float]:
        allocations = self.manifest.get("allocations") or {}
        return list(allocations.get("ratios", []))

    def basis(self, stream: str, group: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if (stream, group) not in self._bases:
            entries = self.manifest["bases"]["entries"]
            entry = next((e for e in entries if e["stream"] == stream and e["group"] == group), None)
            if entry is None:
                have = ", ".join(f"({e['stream']}, {e['group']})" for e in entries)
                raise ValueError(f"{self.name}@{self.version} has no basis for stream {stream!r} group {group}; "
                                 f"streams are {STREAMS}, available: {have}")
            mean, eig, comp = tables.decode_basis(str(self.file(entry["components"])), str(self.file(entry["mean"])))
            self._bases[(stream, group)] = (mean, eig, comp.astype(np.float32, copy=False))
        return self._bases[(stream, group)]

    def allocations(self) -> dict:
        """{(ratio, stream, group): {"budget_bits", "cost_bits", "kept", "blocks": [(start, size, type, bits, scale_bits)], ...}}."""
        if self._allocations is None:
            section = self.manifest.get("allocations")
            self._allocations = tables.decode_allocations(str(self.file(section["file"]))) if section else {}
        return self._allocations

    def ecsq_tables(self) -> dict:
        """{(ratio, stream, group): ECSQ table} ({} for an artifact calibrated before the ECSQ mode)."""
        if self._ecsq is None:
            section = self.manifest.get("ecsq")
            self._ecsq = ecsq_tables.decode_ecsq(str(self.file(section["file"]))) if section else {}
        return self._ecsq

    def ecsq_ratios(self) -> list[float]:
        return list((self.manifest.get("ecsq") or {}).get("ratios", []))

    def ecsq(self, ratio: float, stream: str, group: int = 0) -> dict | None:
        """The ECSQ table (step, kept, scales, model, offsets, models) or None when the artifact has none."""
        for (r, s, g), table in self.ecsq_tables().items():
            if math.isclose(r, float(ratio)) and s == stream and g == group:
                return table
        return None

    def allocation_info(self, ratio: float, stream: str, group: int = 0) -> dict:
        for (r, s, g), alloc in self.allocations().items():
            if math.isclose(r, float(ratio)) and s == stream and g == group:
                return alloc
        raise ValueError(f"{self.name}@{self.version} has no allocation for ratio {ratio}, stream {stream!r}, "
                         f"group {group}; ratios: {self.ratios()}, streams: {STREAMS}")

    def allocation(self, ratio: float, stream: str, group: int = 0) -> list[Block]:
        return [Block(*b[:4]) for b in self.allocation_info(ratio, stream, group)["blocks"]]

    def metrics(self) -> list[dict]:
        rel = self.manifest.get("metrics")
        return tables.decode_rows(str(self.file(rel))) if rel else []

    def curves(self) -> list[str]:
        return sorted(self.manifest.get("curves", {}))

    def curve(self, name: str) -> list[dict]:
        curves = self.manifest.get("curves", {})
        if name not in curves:
            raise ValueError(f"{self.name}@{self.version} has no curve {name!r}; curves: {', '.join(sorted(curves)) or 'none'}")
        return tables.decode_rows(str(self.file(curves[name])))

    def kernels_match(self, directory: str | os.PathLike | None = None) -> bool:
        """True when the installed kernels (or those in `directory`) are the bundle this artifact was made for."""
        return bundle.kernel_bundle_hash(directory) == self.manifest.get("kernel_bundle_hash")
