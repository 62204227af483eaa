"""What the calibration pipeline hands to `publish`: `ArtifactContent`, validated on construction.

Feature layout of a group (the unit with one basis, kvtc.artifacts.groups): its layers in order,
each layer's KV heads [h0, h1), then head_dim, so p = layers * (h1 - h0) * head_dim.
Keys are in RoPE-removed space. Components are columns: components (p, k), k <= p.
A basis may carry a decoder (p, k) distinct from its components (the encoder): coefficients are
z = (x - mean) @ components and the reconstruction is mean + z @ decoder.T (a whitened basis,
decoder.T @ components = I_k); without one the basis is orthonormal and decodes with the components.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtc.artifacts.bit_split import check_table_budgets
from kvtc.artifacts.blocks import normalize_block
from kvtc.artifacts.names import check_name
from kvtc.artifacts.groups import FeatureGroup, parse_groups, stream_dims

SCHEMA_VERSION = 1
STREAMS = ("keys", "values")
BASES_DTYPES = ("float32", "float16")
REQUIRED_MODEL_KEYS = ("spec", "num_layers", "num_kv_heads", "head_dim", "rope")
REQUIRED_CALIBRATION_KEYS = ("sinks", "window", "seq_len", "tokens", "groups", "seed", "allocator", "ratios")
RESERVED_TOP_LEVEL = ("manifest.json", "bases", "allocations.parquet", "ecsq.parquet", "metrics.parquet", "curves",
                      "kernels")


def to_json(value: Any, where: str) -> Any:
    """Convert tuples and numpy scalars to plain JSON values; refuse anything else with its location."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: non-finite number {value!r} cannot go into the manifest")
        return value
    if isinstance(value, np.generic):
        return to_json(value.item(), where)
    if isinstance(value, dict):
        return {str(k): to_json(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"{where}: {type(value).__name__} is not JSON-serialisable; pass plain numbers, strings, lists, dicts")


@dataclass(frozen=True)
class ArtifactContent:
    """A calibration result, ready to publish.

    bases: {(stream, group): (mean (p,), eigenvalues (k,), components (p, k))}, numpy, stored as
      `bases_dtype` (components; mean and eigenvalues always float32); trimmed on publish to the
      components some allocation gives bits to (all of them when no allocation names the basis).
    allocations: {(ratio, stream, group): {"budget_bits", "blocks", "cost_bits", "kept", ...}}, blocks in
      component order as (start, size, type, bits, scale_bits); other scalar keys are kept as extras.
    metrics: rows {"ratio", "stream", "group", "split", "metric", "value"} (missing keys stored as null).
    curves: {name: rows of scalars}, e.g. "error_by_position": {"position", "stream", "ratio", "rel_error"}.
    extra_files: {relative path: bytes}, e.g. charts PNG and "report.md".
    parent: version id (same name) or "name@version" this recalibrates; code_version defaults to the package's.
    ecsq: {(ratio, stream, group): table} of the entropy-coded codec mode (artifacts/ecsq_tables.py).
    decoders: {(stream, group): decoder (p, k)}, numpy, the same shape as that basis' components, for a
      basis that is not orthonormal (decode x = mean + z @ decoder.T); stored and trimmed as its components.
    """

    name: str
    model: dict
    calibration: dict
    corpus: dict
    bases: dict
    allocations: dict = field(default_factory=dict)
    metrics: list = field(default_factory=list)
    curves: dict = field(default_factory=dict)
    extra_files: dict = field(default_factory=dict)
    parent: str | None = None
    code_version: str | None = None
    bases_dtype: str = "float32"
    ecsq: dict = field(default_factory=dict)
    decoders: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_name("artifact name", self.name)
        if self.bases_dtype not in BASES_DTYPES:
            raise ValueError(f"bases_dtype must be one of {BASES_DTYPES}, got {self.bases_dtype!r}")
        for label, value, keys in (("model", self.model, REQUIRED_MODEL_KEYS),
                                   ("calibration", self.calibration, REQUIRED_CALIBRATION_KEYS)):
            missing = [k for k in keys if k not in value] if isinstance(value, dict) else list(keys)
            if missing:
                raise ValueError(f"{label} fingerprint lacks {', '.join(missing)}")
            to_json(value, label)
        if not isinstance(self.corpus, dict) or "spec" not in self.corpus:
            raise ValueError("corpus fingerprint must be a dict with at least 'spec'")
        to_json(self.corpus, "corpus")
        self._check_bases()
        for key, decoder in self.decoders.items():
            self._check_decoder(key, decoder)
        for key, alloc in self.allocations.items():
            self._check_allocation(key, alloc)
        for key, table in self.ecsq.items():  # ECSQ mode hook
            self._check_ecsq(key, table)
        sections = {"calibration": self.calibration, "model": self.model, "bases": list(self.bases)}
        for what, tables_ in (("allocation", self.allocations), ("ECSQ table", self.ecsq)):
            check_table_budgets(sections, tables_, what, f"artifact {self.name!r}")
        for name, rows in self.curves.items():
            check_name("curve name", name)
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise ValueError(f"curve {name!r} must be a list of dict rows")
        for rel, data in self.extra_files.items():
            parts = str(rel).split("/")
            if not isinstance(data, (bytes, bytearray)) or any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"extra file {rel!r}: give a relative path without '..' and bytes content")
            if parts[0] in RESERVED_TOP_LEVEL:
                raise ValueError(f"extra file {rel!r} collides with a reserved name ({', '.join(RESERVED_TOP_LEVEL)})")

    def group_layers(self) -> list[FeatureGroup]:
        """The calibration's groups (layers x KV heads), one per basis; old manifests' [a, b) ranges load too."""
        return parse_groups(self.calibration["groups"])

    def group_dim(self, group: int, stream: str = "keys") -> int:
        """p of a group in `stream`: layers x its KV heads x the stream's head width (see groups.stream_dims)."""
        return self.group_layers()[group].dim(*stream_dims(self.model)[stream])

    def _check_bases(self) -> None:
        groups = self.group_layers()
        if not self.bases:
            raise ValueError("bases is empty: pass {(stream, group): (mean, eigenvalues, components)}")
        for key, arrays in self.bases.items():
            stream, group = key
            if stream not in STREAMS or not (0 <= int(group) < len(groups)):
                raise ValueError(f"basis key {key!r}: stream must be one of {STREAMS}, group in [0, {len(groups)})")
            mean, eig, comp = (np.asarray(a) for a in arrays)
            p = self.group_dim(int(group), stream)
            if mean.shape != (p,) or comp.ndim != 2 or comp.shape[0] != p or eig.shape != (comp.shape[1],):
                raise ValueError(f"basis {key!r}: expected mean ({p},), eigenvalues (k,), components ({p}, k); "
                                 f"got {mean.shape}, {eig.shape}, {comp.shape}")

    def _check_decoder(self, key: tuple, decoder: Any) -> None:
        if key not in self.bases:
            raise ValueError(f"decoder {key!r} has no basis: key decoders by an existing basis (stream, group), "
                             f"one of {sorted(self.bases)}")
        comp = np.asarray(self.bases[key][2])
        dec = np.asarray(decoder)
        if dec.shape != comp.shape:
            raise ValueError(f"decoder of basis {key!r} has shape {dec.shape}; it must be the components' shape "
                             f"{comp.shape} (p, k), column j decoding component j")
        if not np.issubdtype(dec.dtype, np.floating) or not np.isfinite(dec).all():
            raise ValueError(f"decoder of basis {key!r} must hold finite floating-point numbers; fix the fit that made it")
        limit = float(np.finfo(np.float16).max)
        if self.bases_dtype == "float16" and max(np.abs(dec).max(initial=0.0), np.abs(comp).max(initial=0.0)) > limit:
            raise ValueError(f"basis {key!r}: its encoder or decoder holds values beyond float16's range ({limit:g}), "
                             "which bases_dtype='float16' would store as inf; publish it with bases_dtype='float32'")

    def _check_ecsq(self, key: tuple, table: dict) -> None:
        ratio, stream, group = key
        if (stream, group) not in self.bases:
            raise ValueError(f"ECSQ table {key!r} has no basis ({stream!r}, {group})")
        if not any(math.isclose(float(ratio), float(r)) for r in self.calibration["ratios"]):
            raise ValueError(f"ECSQ table {key!r}: ratio {ratio} is not in calibration ratios {self.calibration['ratios']}")
        from kvtc.artifacts.ecsq_tables import check_table  # noqa: PLC0415 - pyarrow: only for content with tables

        check_table(key, table)
        if int(table["kept"]) > np.asarray(self.bases[(stream, group)][2]).shape[1]:
            raise ValueError(f"ECSQ table {key!r} codes {table['kept']} components, the basis has fewer")

    def _check_allocation(self, key: tuple, alloc: dict) -> None:
        ratio, stream, group = key
        if (stream, group) not in self.bases:
            raise ValueError(f"allocation {key!r} has no basis ({stream!r}, {group})")
        if not any(math.isclose(float(ratio), float(r)) for r in self.calibration["ratios"]):
            raise ValueError(f"allocation {key!r}: ratio {ratio} is not in calibration ratios {self.calibration['ratios']}")
        missing = [k for k in ("budget_bits", "blocks") if k not in alloc]
        if missing:
            raise ValueError(f"allocation {key!r} lacks {', '.join(missing)}")
        k = np.asarray(self.bases[(stream, group)][2]).shape[1]
        end = 0
        for i, block in enumerate(alloc["blocks"]):
            start, size, qtype, _, _ = normalize_block(block, f"allocation {key!r} block {i}")
            if start != end:
                raise ValueError(f"allocation {key!r} block {i} starts at {start}, expected {end} (blocks are contiguous)")
            end = start + size
            if qtype != "none" and end > k:
                raise ValueError(f"allocation {key!r} block {i} needs components up to {end}, basis has {k}")
        for extra, value in alloc.items():
            if extra != "blocks" and not isinstance(value, (int, float, str, bool, np.generic, type(None))):
                raise ValueError(f"allocation {key!r} field {extra!r} must be a scalar")
