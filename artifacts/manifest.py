"""Turn an `ArtifactContent` into a version folder's files and its manifest.json; version ids; checks."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import subprocess
from importlib import metadata
from pathlib import Path

import numpy as np

from kvtc.artifacts import bundle
from kvtc.artifacts.bit_split import check_bit_split
from kvtc.artifacts.errors import IntegrityError
from kvtc.artifacts.names import check_name
from kvtc.artifacts.schema import SCHEMA_VERSION, ArtifactContent, normalize_block, to_json

MANIFEST = "manifest.json"
DIGEST_FILE = "manifest.sha256"   # "sha256:HEX\n" of manifest.json, written with it
SIGNATURE_FILE = "manifest.sig"   # optional Ed25519 signature of manifest.json (see signing.py)
SIDECARS = (MANIFEST, DIGEST_FILE, SIGNATURE_FILE, ".claim")
_HEX64 = set("0123456789abcdef")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def new_version_id(content_hash: str, now: dt.datetime | None = None) -> str:
    """Sortable, unique id: UTC time to the microsecond, then 8 hex digits of the content hash."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return f"{now:%Y%m%dT%H%M%S%f}Z-{content_hash[:8]}"


def code_version() -> str:
    """Installed package version, plus the git commit when the source is a checkout."""
    try:
        version = metadata.version("kvtc-calibration")
    except metadata.PackageNotFoundError:
        version = "unknown"
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=Path(__file__).parent,
                                capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return version
    return f"{version}+g{commit}" if commit else version


def kept_components(content: ArtifactContent, stream: str, group: int) -> int:
    """Components worth storing: up to the last block with bits over every ratio; all without allocations."""
    ends = [0]
    found = False
    for (_, s, g), alloc in content.allocations.items():
        if (s, g) == (stream, group):
            found = True
            blocks = [normalize_block(b, "block") for b in alloc["blocks"]]
            ends += [start + size for start, size, qtype, _, _ in blocks if qtype != "none"]
    for (_, s, g), table in content.ecsq.items():  # ECSQ mode may code more components than any allocation
        if (s, g) == (stream, group):
            found = True
            ends.append(int(table["kept"]))
    return max(ends) if found else np.asarray(content.bases[(stream, group)][2]).shape[1]


def build_files(content: ArtifactContent, codec_dir: Path | None = None) -> tuple[dict[str, bytes], dict]:
    """-> ({relative path: bytes}, manifest without name/version/created/files); the codec folder
    `codec_dir` (default: the installed one) is shipped under kernels/ and hashed (artifacts.bundle)."""
    from kvtc.artifacts import ecsq_tables, tables  # noqa: PLC0415 - Parquet only to write: reading a manifest needs none

    files: dict[str, bytes] = {}
    entries = []
    layers = content.group_layers()
    for stream, group in sorted(content.bases, key=lambda sg: (sg[0], int(sg[1]))):
        mean, eig, comp = (np.asarray(a) for a in content.bases[(stream, group)])
        k = kept_components(content, stream, group)
        stem = f"bases/{stream}-g{int(group)}"
        files[f"{stem}.components.parquet"], files[f"{stem}.mean.parquet"] = tables.encode_basis(
            mean, eig[:k], comp[:, :k], content.bases_dtype)
        entry = {"stream": stream, "group": int(group), "layers": layers[int(group)].to_json(),
                 "p": int(mean.shape[0]), "k": int(k), "components": f"{stem}.components.parquet",
                 "mean": f"{stem}.mean.parquet"}
        if (stream, group) in content.decoders:  # not orthonormal: decoded with its own matrix
            decoder = np.asarray(content.decoders[(stream, group)])
            files[f"{stem}.decoder.parquet"] = tables.encode_decoder(decoder[:, :k], content.bases_dtype)
            entry["decoder"] = f"{stem}.decoder.parquet"
        entries.append(entry)
    parts: dict = {"bases": {"dtype": content.bases_dtype, "mean_dtype": "float32", "eigenvalue_dtype": "float32",
                             "entries": entries}}
    parts["allocations"] = None
    if content.allocations:
        files["allocations.parquet"] = tables.encode_allocations(content.allocations)
        parts["allocations"] = {"file": "allocations.parquet",
                                "ratios": sorted({float(r) for r, _, _ in content.allocations})}
    parts["ecsq"] = None
    if content.ecsq:
        files["ecsq.parquet"] = ecsq_tables.encode_ecsq(content.ecsq)
        parts["ecsq"] = {"file": "ecsq.parquet", "ratios": sorted({float(r) for r, _, _ in content.ecsq})}
    parts["metrics"] = None
    if content.metrics:
        files["metrics.parquet"] = tables.encode_rows(content.metrics, tables.METRIC_TYPES)
        parts["metrics"] = "metrics.parquet"
    parts["curves"] = {}
    for name, rows in sorted(content.curves.items()):
        files[f"curves/{name}.parquet"] = tables.encode_rows(rows)
        parts["curves"][name] = f"curves/{name}.parquet"
    for rel, data in sorted(content.extra_files.items()):
        files[str(rel)] = bytes(data)
    parts["extras"] = sorted(str(rel) for rel in content.extra_files)
    sources = bundle.kernel_sources(codec_dir)
    files.update({f"kernels/{rel}": data for rel, data in sources.items()})
    parts["kernels"] = {"bundle_sha256": bundle.bundle_hash(sources), "files": sorted(sources)}
    return files, parts


def build_manifest(content: ArtifactContent, version: str | None, files: dict[str, bytes], parts: dict,
                   parent: str | None) -> dict:
    """The full manifest; `version` None -> a fresh sortable id from the content hash."""
    listing = {rel: {"sha256": sha256(data), "size": len(data)} for rel, data in sorted(files.items())}
    content_hash = listing_hash(listing)
    now = dt.datetime.now(dt.timezone.utc)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "name": content.name,
        "version": check_name("version", version) if version else new_version_id(content_hash, now),
        "created": now.isoformat().replace("+00:00", "Z"),
        "model": to_json(content.model, "model"),
        "calibration": to_json(content.calibration, "calibration"),
        "corpus": to_json(content.corpus, "corpus"),
        "code_version": content.code_version or code_version(),
        "kernel_bundle_hash": parts["kernels"]["bundle_sha256"],
        "parent": parent,
        "content_sha256": content_hash,
    }
    manifest.update(parts)
    manifest["files"] = listing
    return manifest


def encode_manifest(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def manifest_digest(data: bytes) -> str:
    """The content address of a version: "sha256:" + hex digest of its manifest.json bytes."""
    return "sha256:" + sha256(data)


def listing_hash(files: dict) -> str:
    """content_sha256: hash of the sorted "<path> <sha256>" lines of the file listing."""
    return sha256("".join(f"{rel} {files[rel]['sha256']}\n" for rel in sorted(files)).encode())


def _is_hex64(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX64


def _shape_errors(m: dict) -> list[str]:
    errors = []
    if not isinstance(m.get("schema_version"), int) or isinstance(m.get("schema_version"), bool):
        errors.append("schema_version is not an integer")
    for key in ("name", "version"):
        try:
            check_name(key, m.get(key))
        except ValueError as exc:
            errors.append(str(exc))
    files = m.get("files")
    if not isinstance(files, dict):
        errors.append("files is not an object {path: {sha256, size}}")
    else:
        for rel, entry in files.items():
            if not (isinstance(entry, dict) and _is_hex64(entry.get("sha256")) and isinstance(entry.get("size"), int)
                    and not isinstance(entry.get("size"), bool) and entry["size"] >= 0):
                errors.append(f"files[{rel!r}] is not {{sha256: 64 hex digits, size: int >= 0}}")
                break
    for key in ("model", "calibration", "bases", "corpus"):
        if not isinstance(m.get(key), dict):
            errors.append(f"section {key!r} is missing or not an object")
    if isinstance(m.get("bases"), dict) and not isinstance(m["bases"].get("entries"), list):
        errors.append("bases.entries is not a list")
    elif isinstance(m.get("bases"), dict):
        objective = m["calibration"].get("objective") if isinstance(m.get("calibration"), dict) else None
        errors += _entry_errors(m["bases"]["entries"], files if isinstance(files, dict) else {}, objective)
    for key in ("allocations", "kernels"):
        if m.get(key) is not None and not isinstance(m[key], dict):
            errors.append(f"section {key!r} is not an object")
    if not isinstance(m.get("curves", {}), dict) or not isinstance(m.get("extras", []), list):
        errors.append("curves must be an object and extras a list")
    return errors


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_errors(entries: list, files: dict, objective: object = None) -> list[str]:
    """Basis entries must be objects naming their files and their shape (p, k ints, k <= p); an optional
    "decoder" must be a listed file, and an attention artifact (not orthonormal) needs one for every basis."""
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            return [f"bases.entries[{i}] is not an object"]
        where = f"bases.entries[{i}] ({entry.get('stream')!r}, group {entry.get('group')!r})"
        if not (_count(entry.get("p")) and _count(entry.get("k")) and entry["k"] <= entry["p"]):
            return [f"{where} declares p {entry.get('p')!r}, k {entry.get('k')!r}, not integers with 0 <= k <= p"]
        decoder = entry.get("decoder")
        if "decoder" in entry and not (isinstance(decoder, str) and decoder in files):
            return [f"{where} names decoder {decoder!r}, which is not a file the manifest lists"]
        if objective == "attention" and "decoder" not in entry:
            return [f"{where} has no decoder, but the calibration's objective is attention (its encoder does not "
                    "reconstruct)"]
    return []


def decode_manifest(data: bytes, where: str, name: str | None = None, version: str | None = None) -> dict:
    """Parse and check a manifest.json: JSON shape, its listing hash and, when given, that it names
    `name` and `version` (the folder it was read from). Errors name `where`; tampering is an IntegrityError."""
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as exc:
        raise IntegrityError(f"{where}: manifest.json is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise IntegrityError(f"{where}: manifest.json is not a JSON object")
    if isinstance(manifest.get("schema_version"), int) and manifest["schema_version"] > SCHEMA_VERSION:
        raise ValueError(f"{where}: schema version {manifest['schema_version']} is newer than this reader "
                         f"({SCHEMA_VERSION}); upgrade kvtc-calibration")
    errors = _shape_errors(manifest)
    if errors:
        raise IntegrityError(f"{where}: manifest.json is malformed: {'; '.join(errors)}")
    if manifest.get("content_sha256") != listing_hash(manifest["files"]):
        raise IntegrityError(f"{where}: manifest's content_sha256 does not match its file listing (tampered)")
    for key, want in (("name", name), ("version", version)):
        if want is not None and manifest[key] != want:
            raise IntegrityError(f"{where}: manifest says {key} {manifest[key]!r} but was stored as {want!r} "
                                 "(a version folder copied or renamed); refusing it")
    check_bit_split(manifest, where)  # the joint split, wherever a manifest is read (CorruptArtifactError)
    return manifest


def check_digest(data: bytes, recorded: bytes | None, expected: str | None, where: str) -> str:
    """Compare manifest bytes with the digest file stored beside them and with a pinned `expected`
    digest (a NAME@sha256:HEX ref or an alias's record); return the digest."""
    digest = manifest_digest(data)
    if recorded is None:
        raise IntegrityError(f"{where}: {DIGEST_FILE} is missing; the version was not published by this kvtc "
                             "(republish it) or was tampered with")
    if recorded.decode(errors="replace").strip() != digest:
        raise IntegrityError(f"{where}: manifest.json does not match its recorded digest (tampered); refusing it")
    if expected is not None and expected != digest:
        raise IntegrityError(f"{where}: manifest digest is {digest}, expected {expected} (tampered or another "
                             "version); refusing it")
    return digest
