"""A verified local copy of one version, as inference servers and the codec read it."""
from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import numpy as np

from kvtc.artifacts import bundle, ecsq_tables, tables
from kvtc.artifacts.errors import ArtifactNotFoundError, CorruptArtifactError, IntegrityError
from kvtc.artifacts.bit_split import check_table_budgets
from kvtc.artifacts.blocks import Block
from kvtc.artifacts.groups import FeatureGroup, parse_groups
from kvtc.artifacts.local_files import sha256_handle
from kvtc.artifacts.manifest import DIGEST_FILE, MANIFEST, check_digest, decode_manifest
from kvtc.artifacts.safe_io import MANIFEST_LIMIT, SMALL_FILE, open_untrusted, read_limited
from kvtc.artifacts.schema import STREAMS


def file_sha256(path: Path, limit: int | None = None, what: str = "file") -> str:
    """sha256 of a regular file (safe_io.open_untrusted: no FIFO, device or symlink; at most `limit` bytes)."""
    handle, _ = open_untrusted(None, True, str(path), what, limit=limit)
    with handle:
        return sha256_handle(handle, 1 << 20)


def safe_relpath(rel: str) -> str:
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise IntegrityError(f"manifest lists an unsafe file path {rel!r}")
    return rel


def contained(folder: Path, rel: str) -> Path:
    """folder / rel, refusing unsafe paths and symlinks that resolve outside `folder`."""
    path = folder / safe_relpath(rel)
    root = os.path.realpath(folder)
    if not os.path.realpath(path).startswith(root.rstrip(os.sep) + os.sep):
        raise IntegrityError(f"file {rel!r} resolves outside {folder}; refusing it")
    return path


def check_kernel_bundle(manifest: dict, where: str) -> None:
    """The bundle hash recorded twice in the manifest must be the hash of the kernels/ files it lists."""
    section = manifest.get("kernels") or {}
    sources = {rel[len("kernels/"):]: entry["sha256"] for rel, entry in manifest["files"].items()
               if rel.startswith("kernels/")}
    actual = bundle.digests_hash(sources)
    if section.get("bundle_sha256") != actual or manifest.get("kernel_bundle_hash") != actual \
            or sorted(section.get("files") or []) != sorted(sources):
        raise IntegrityError(f"{where}: the kernel bundle hash does not match the kernels/ files listed "
                             "(tampered); refusing it")


class Damaged(list):
    """The damaged optional files (a list of their paths), with what is wrong with each (`problems`)."""

    def __init__(self, problems: dict[str, str] | None = None) -> None:
        super().__init__(problems or {})
        self.problems: dict[str, str] = dict(problems or {})

    def add(self, rel: str, problem: str) -> None:
        self.append(rel)
        self.problems[rel] = problem


def verify_folder(folder: Path, manifest: dict, where: str) -> Damaged:
    """Check every file listed in the manifest exists with its size and sha256, and the kernel bundle hash.

    Raises IntegrityError naming the first bad file needed to decode; returns the damaged optional
    files (manifest "extras": charts, report.md, metric files), which decoding does not need."""
    check_kernel_bundle(manifest, where)
    extras = set(manifest.get("extras") or [])
    damaged = Damaged()
    for rel, expected in manifest["files"].items():
        problem = None
        path = contained(folder, rel)
        try:
            size = os.lstat(path).st_size
            if size != expected["size"]:
                problem = (f"{where}: file {rel} has {size} bytes, manifest says {expected['size']} "
                           "(truncated or replaced); refusing it")
            elif file_sha256(path, expected["size"], f"{where}: file") != expected["sha256"]:
                problem = f"{where}: file {rel} fails its sha256 check (tampered or corrupt); refusing it"
        except FileNotFoundError:
            problem = f"{where}: file {rel} is missing"
        except IntegrityError as exc:
            problem = str(exc)
        if problem and rel not in extras:
            raise IntegrityError(problem)
        if problem:
            damaged.add(rel, problem)
    return damaged


class Artifact:
    """One version on local disk. `.manifest` (dict), `.path`, `.name`, `.version`.

    basis(stream, group) -> (mean (p,), eigenvalues (k,), components (p, k)) float32, components as
    columns, features ordered layer, kv head, head_dim; keys in RoPE-removed space.
    decoder(stream, group) -> decoder (p, k) float32 of a basis that is not orthonormal (reconstruct
    mean + z @ decoder.T), or None: decode with the components.
    allocation(ratio, stream, group) -> [Block(start, size, qtype, bits)] in component order.
    """

    def __init__(self, path: str | os.PathLike, manifest: dict | None = None, verify: bool = True) -> None:
        self.path = Path(path)
        if manifest is None:
            manifest_path = self.path / MANIFEST
            if not manifest_path.is_file():
                raise ArtifactNotFoundError(f"{self.path} holds no {MANIFEST}; is it an artifact version folder?")
            data = read_limited(None, True, str(manifest_path), MANIFEST_LIMIT, "manifest")
            digest_path = self.path / DIGEST_FILE
            digest = read_limited(None, True, str(digest_path), SMALL_FILE, "digest file") if digest_path.is_file() else None
            check_digest(data, digest, None, str(self.path))
            manifest = decode_manifest(data, str(self.path))
        self.manifest = manifest
        self.name: str = manifest["name"]
        self.version: str = manifest["version"]
        self._bases: dict = {}
        self._decoders: dict = {}
        self._allocations: dict | None = None
        self._ecsq: dict | None = None
        self.damaged: list[str] = []
        self.digest: str | None = None      # set by pull: the verified manifest's digest
        self.signed_by: str | None = None   # set by pull: the key id whose signature was checked
        if verify:
            self.verify()

    def __repr__(self) -> str:
        return f"Artifact({self.name}@{self.version}, path={str(self.path)!r})"

    def verify(self) -> None:
        """Re-check every file's size and sha256 and the kernel bundle hash against the manifest.

        A damaged optional file (chart, report) only warns and is listed in `.damaged`; `file()` refuses it."""
        self.damaged = verify_folder(self.path, self.manifest, f"{self.name}@{self.version}")
        if self.damaged:
            warnings.warn(f"{self.name}@{self.version}: optional files fail their checks and are refused: "
                          f"{', '.join(self.damaged)} (decoding does not need them)", stacklevel=2)

    def file(self, rel: str) -> Path:
        """Local path of a listed file (charts, report.md, kernels/...)."""
        if rel not in self.manifest["files"]:
            raise ArtifactNotFoundError(f"{self.name}@{self.version} has no file {rel!r}")
        if rel in self.damaged:
            problem = getattr(self.damaged, "problems", {}).get(rel)
            raise IntegrityError(problem or f"{self.name}@{self.version}: file {rel} fails its sha256 check; refusing it")
        return contained(self.path, rel)

    def groups(self) -> list[FeatureGroup]:
        """The basis groups (layers x KV heads); manifests written before groups had head ranges load too."""
        return parse_groups(self.manifest["calibration"]["groups"])

    def ratios(self) -> list[float]:
        allocations = self.manifest.get("allocations") or {}
        return list(allocations.get("ratios", []))

    def _entry(self, stream: str, group: int) -> dict:
        entries = self.manifest["bases"]["entries"]
        entry = next((e for e in entries if e["stream"] == stream and e["group"] == group), None)
        if entry is None:
            have = ", ".join(f"({e['stream']}, {e['group']})" for e in entries)
            raise ValueError(f"{self.name}@{self.version} has no basis for stream {stream!r} group {group}; "
                             f"streams are {STREAMS}, available: {have}")
        return entry

    def basis(self, stream: str, group: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if (stream, group) not in self._bases:
            entry = self._entry(stream, group)
            declared = tables.basis_declared(int(entry["p"]), int(entry["k"]), self._bases_dtype())
            try:
                mean, eig, comp = tables.decode_basis(str(self.file(entry["components"])), str(self.file(entry["mean"])),
                                                      declared)
            except CorruptArtifactError:
                raise  # names the file already
            except ValueError as exc:
                raise CorruptArtifactError(f"{self.name}@{self.version}: basis ({stream}, {group}) is unusable: {exc}; "
                                           "the version was forged or damaged: republish it") from None
            self._bases[(stream, group)] = (mean, eig, comp.astype(np.float32, copy=False))
        return self._bases[(stream, group)]

    def decoder(self, stream: str, group: int = 0) -> np.ndarray | None:
        """The basis' decoder (p, k) float32, the components' shape; None for an orthonormal basis (its
        entry names no decoder file). ValueError for a decoder file that is not one of that shape or
        holds non-finite values."""
        if (stream, group) not in self._decoders:
            entry = self._entry(stream, group)
            decoder = None
            if "decoder" in entry:
                shape = self.basis(stream, group)[2].shape
                try:
                    decoder = tables.decode_decoder(str(self.file(entry["decoder"])), shape,
                                                    tables.decoder_declared(*shape, self._bases_dtype()))
                except CorruptArtifactError as exc:
                    raise CorruptArtifactError(f"{self.name}@{self.version}: decoder file {entry['decoder']} of basis "
                                               f"({stream}, {group}) is unusable: {exc}") from None
                except ValueError as exc:
                    raise CorruptArtifactError(f"{self.name}@{self.version}: decoder file {entry['decoder']} of basis "
                                     f"({stream}, {group}) is unusable: {exc}; republish the version with a "
                                     "decoder of its components' shape") from None
            self._decoders[(stream, group)] = decoder
        return self._decoders[(stream, group)]

    def _bases_dtype(self) -> str:
        return str((self.manifest.get("bases") or {}).get("dtype", "float32"))

    def allocations(self) -> dict:
        """{(ratio, stream, group): {"budget_bits", "cost_bits", "kept", "blocks": [(start, size, type, bits, scale_bits)], ...}}."""
        if self._allocations is None:
            section = self.manifest.get("allocations")
            allocations = tables.decode_allocations(str(self.file(section["file"])),
                                                    tables.rows_declared(self.manifest)) if section else {}
            self._check_budgets(allocations, "allocation")
            self._allocations = allocations
        return self._allocations

    def _check_budgets(self, tables_: dict, what: str) -> None:
        """Budgets that do not add up to each ratio's total, or are not what the manifest's joint split gave each
        basis, are refused (CorruptArtifactError; `bit_split.check_table_budgets`)."""
        check_table_budgets(self.manifest, tables_, what, f"{self.name}@{self.version}")

    def ecsq_tables(self) -> dict:
        """{(ratio, stream, group): ECSQ table} ({} for an artifact calibrated before the ECSQ mode)."""
        if self._ecsq is None:
            section = self.manifest.get("ecsq")
            ecsq = ecsq_tables.decode_ecsq(str(self.file(section["file"])),
                                           tables.rows_declared(self.manifest)) if section else {}
            self._check_budgets(ecsq, "ECSQ table")
            self._ecsq = ecsq
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
        return tables.decode_rows(str(self.file(rel)), tables.rows_declared(self.manifest)) if rel else []

    def curves(self) -> list[str]:
        return sorted(self.manifest.get("curves", {}))

    def curve(self, name: str) -> list[dict]:
        curves = self.manifest.get("curves", {})
        if name not in curves:
            raise ValueError(f"{self.name}@{self.version} has no curve {name!r}; curves: {', '.join(sorted(curves)) or 'none'}")
        return tables.decode_rows(str(self.file(curves[name])), tables.rows_declared(self.manifest))

    def kernels_match(self, directory: str | os.PathLike | None = None) -> bool:
        """True when the installed codec (or the codec folder `directory`, e.g. a version folder's kernels/) is the
        bundle this artifact was made for."""
        return bundle.kernel_bundle_hash(directory) == self.manifest.get("kernel_bundle_hash")
