"""Export one ratio of an artifact in the form NVIDIA Dynamo's KVBM KVTC kernels take (`KvtcConfig`).

Dynamo's kernels compute, per row x of `features` float elements read from a block pointer,
c = (x - mean) @ P, quantize each range of c, and decode x_hat = c_hat @ P.T + mean. Ranges are
`IntX` (1, 2, 4 or 8 bits, min/max affine per row per range, both float32: 64 bits of metadata per
range per row) or `Fp8` (a plain e4m3 cast, no scale). They apply to rows exactly as stored: no
RoPE removal, and a row is contiguous memory.

What this export does about it:
- this project's fp8 blocks carry a per-token scale; an unscaled e4m3 cast of PCA coefficients
  would clip or flush them, so they are exported as 8-bit IntX (`fp8="int8"`) or refused
  (`fp8="refuse"`); intB with B not in {1, 2, 4, 8} is exported at the next Dynamo width;
- the real cost is what Dynamo's kernels write: per range, each row's codes padded to whole bytes
  (the quantize kernel packs rows apart), 8 bytes of min/max per row, and a 40-byte range header
  per compress call (`KvtcRangeHeader`), amortised over `batch` rows; the real ratio is reported;
- Dynamo's buffer sizing (`kvtc_range_packed_size`) rounds the packed bytes over the whole batch
  while its kernel pads every row, so a range whose width x bits is not a multiple of 8 would
  overrun the buffer: such a range is padded with zero projection columns up to the next
  multiple (`ranges="pad"`, the default: the same bytes the kernel writes anyway, the same
  reconstruction, since a zero column codes 0 and adds nothing back) or refused (`ranges="refuse"`);
- a group spanning several layers is not contiguous in a paged KV layout (each layer's pages are
  stored apart), so with `layout="paged"` only per-layer groups export (recalibrate with
  `--groups layer`); `layout="token-major"` accepts any group, for layouts that keep all layers of
  a token contiguous;
- a basis of RoPE-removed keys needs a consumer that removes RoPE itself: refused unless
  `allow_rope_removed=True` (or calibrate with `--keys rope-kept`).

For each stream and group, in DIR:
  <stream>-g<group>.mean.f32        float32 little-endian, shape (features,)
  <stream>-g<group>.projection.f32  float32 little-endian, row-major (features, pca_components)
  dynamo_kvtc.json                  shapes, sha256 of each array file, the ordered ranges
                                    {"start_idx", "end_idx", "quant_type": "IntX", "int_bits"},
                                    bits per row and the real ratio
Components of "none" blocks are dropped from the projection (they reconstruct as the mean).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtc.artifacts.artifact import Artifact
from kvtc.artifacts.calibration import CalibrationRecord
from kvtc.artifacts.schema import STREAMS
from kvtc.artifacts.local_files import Outputs

FORMAT = "kvtc-dynamo/3"
DYNAMO_INT_BITS = (1, 2, 4, 8)
DYNAMO_RANGE_METADATA_BITS = 64  # float32 min and max per row per IntX range
DYNAMO_RANGE_HEADER_BYTES = 40  # KvtcRangeHeader (i32, i32, 4 x u64), once per range per compress call
FP8_CHOICES = ("int8", "refuse")
LAYOUTS = ("paged", "token-major")
RANGE_CHOICES = ("pad", "refuse")


class ExportError(ValueError):
    """The artifact cannot be expressed in the target runtime's terms as asked."""


@dataclass(frozen=True)
class DynamoExportOptions:
    """fp8: how scaled fp8 blocks map ("int8" or "refuse"); layout: "paged" (per-layer groups only) or
    "token-major"; allow_rope_removed: export a RoPE-removed key basis for a consumer that removes RoPE."""

    fp8: str = "int8"
    layout: str = "paged"
    allow_rope_removed: bool = False
    ranges: str = "pad"
    batch: int = 256

    def __post_init__(self) -> None:
        if self.fp8 not in FP8_CHOICES:
            raise ValueError(f"fp8 must be one of {FP8_CHOICES}, got {self.fp8!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.ranges not in RANGE_CHOICES:
            raise ValueError(f"ranges must be one of {RANGE_CHOICES}, got {self.ranges!r}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch (rows per compress call) must be an integer >= 1, got {self.batch!r}")


def _dynamo_bits(block_type: str, bits: int, fp8: str, where: str) -> int:
    if block_type == "fp8":
        if fp8 == "refuse":
            raise ExportError(f"{where}: the allocation uses scaled fp8 blocks; Dynamo's Fp8 is an unscaled e4m3 "
                              "cast that would clip or flush PCA coefficients. Export them as 8-bit IntX "
                              "(--fp8 int8) or recalibrate with --types none,int2,int4,int8")
        return 8
    wider = [b for b in DYNAMO_INT_BITS if b >= bits]
    if not wider:
        raise ExportError(f"{where}: block type {block_type} has no Dynamo IntX width")
    return wider[0]


def dynamo_ranges(blocks: list, fp8: str, where: str) -> tuple[list[int], list[dict]]:
    """Allocation blocks -> (kept component indices, contiguous IntX ranges over them), one range per block."""
    columns: list[int] = []
    ranges: list[dict] = []
    for block in blocks:
        start, size, block_type, bits = block[0], block[1], block[2], block[3]
        if block_type == "none":
            continue
        int_bits = _dynamo_bits(block_type, bits, fp8, where)
        first = len(columns)
        columns.extend(range(start, start + size))
        # never merged: IntX takes one min/max per range, as the allocator assumed per block
        ranges.append({"start_idx": first, "end_idx": len(columns), "quant_type": "IntX", "int_bits": int_bits,
                       "from": block_type})
    return columns, ranges


def pad_ranges(columns: list[int], ranges: list[dict], how: str, where: str) -> tuple[list[int | None], list[dict]]:
    """Widen every range whose width x bits is not a multiple of 8 with zero columns (None in the returned
    columns) up to the next multiple, or raise ExportError (how="refuse")."""
    out_columns: list[int | None] = []
    out_ranges = []
    for r in ranges:
        width, slots = r["end_idx"] - r["start_idx"], 8 // r["int_bits"]
        pad = -width % slots
        if pad and how == "refuse":
            raise ExportError(f"{where}: range [{r['start_idx']}, {r['end_idx']}) of {width} x {r['int_bits']} bits is "
                              "not a whole number of bytes per row; Dynamo's buffer sizing rounds over the batch while "
                              "its kernel pads every row, so it would write past the buffer. Export with --ranges pad")
        start = len(out_columns)
        out_columns += columns[r["start_idx"]:r["end_idx"]] + [None] * pad
        out_ranges.append({**r, "start_idx": start, "end_idx": len(out_columns), "zero_columns": pad})
    return out_columns, out_ranges


def row_bytes(ranges: list[dict]) -> int:
    """Bytes Dynamo writes per row: each range's codes padded to whole bytes, plus float32 min and max."""
    return sum(-(-(r["end_idx"] - r["start_idx"]) // (8 // r["int_bits"])) + DYNAMO_RANGE_METADATA_BITS // 8
               for r in ranges)


def row_bits(ranges: list[dict]) -> int:
    """Bits one row costs in Dynamo: packed codes padded to whole bytes per range, plus 64 bits of min/max."""
    return 8 * row_bytes(ranges)


def buffer_bytes(ranges: list[dict], batch: int) -> int:
    """Dynamo's `kvtc_compressed_size` for `batch` rows (what it allocates)."""
    return sum(DYNAMO_RANGE_HEADER_BYTES + batch * 8 + -(-batch * (r["end_idx"] - r["start_idx"]) // (8 // r["int_bits"]))
               for r in ranges)


def _write(out: Outputs, name: str, array: np.ndarray) -> dict:
    data = np.ascontiguousarray(array, dtype="<f4").tobytes()
    path = out.add(name, data)  # all files or none, never through a link or FIFO planted in the folder
    return {"file": path.name, "shape": list(array.shape), "dtype": "float32", "byte_order": "little",
            "order": "row-major", "sha256": hashlib.sha256(data).hexdigest()}


def _check(artifact: Artifact, options: DynamoExportOptions) -> str:
    """-> the key form; raises ExportError for what Dynamo cannot run as asked."""
    cal = CalibrationRecord.from_manifest(artifact.manifest)
    keys = cal.keys
    if keys == "rope-removed" and not options.allow_rope_removed:
        raise ExportError(f"{artifact.name}@{artifact.version} holds a basis of RoPE-removed keys, but Dynamo applies "
                          "the projection to keys as stored, with RoPE. Recalibrate with --keys rope-kept, or pass "
                          "--allow-rope-removed if your consumer removes RoPE before compressing and re-applies it")
    if options.layout == "paged":
        wide = [g.to_json() for g in cal.groups if len(g.layers) > 1]
        if wide:
            raise ExportError(f"{artifact.name}@{artifact.version} has groups spanning several layers {wide}: in a "
                              "paged KV layout each layer's pages are stored apart, so such a row is not contiguous. "
                              "Recalibrate with --groups layer, or export with --layout token-major if your layout "
                              "keeps all layers of a token contiguous")
    return keys


def export_dynamo(artifact: Artifact, ratio: float, directory: str | Path,
                  options: DynamoExportOptions = DynamoExportOptions()) -> Path:
    """Write the Dynamo form of `ratio` for every stream and group into `directory`; -> the JSON path.
    Checks everything before writing anything."""
    keys = _check(artifact, options)
    plans = []
    for entry in artifact.manifest["bases"]["entries"]:
        stream, group = entry["stream"], entry["group"]
        where = f"{artifact.name}@{artifact.version} ratio {ratio:g} {stream} group {group}"
        columns, ranges = dynamo_ranges(artifact.allocation(ratio, stream, group), options.fp8, where)
        plans.append((entry, *pad_ranges(columns, ranges, options.ranges, where)))
    out = Outputs(directory)
    configs = []
    for entry, columns, ranges in plans:
        stream, group = entry["stream"], entry["group"]
        mean, _, components = artifact.basis(stream, group)
        stem = f"{stream}-g{group}"
        features = int(mean.shape[0])
        per_row = row_bytes(ranges)
        per_call = per_row * options.batch + DYNAMO_RANGE_HEADER_BYTES * len(ranges)
        assert buffer_bytes(ranges, options.batch) == per_call  # padded: Dynamo's sizing matches its kernel
        projection = np.zeros((features, len(columns)), dtype=np.float32)
        kept = [i for i, c in enumerate(columns) if c is not None]
        projection[:, kept] = components[:, [columns[i] for i in kept]]
        info = artifact.allocation_info(ratio, stream, group)
        configs.append({
            "stream": stream, "group": group, "layers": entry["layers"],
            "features": features, "pca_components": len(columns), "zero_columns": len(columns) - len(kept),
            "budget_bits": info["budget_bits"], "dynamo_bits_per_row": 8 * per_row,
            "dynamo_header_bytes": DYNAMO_RANGE_HEADER_BYTES * len(ranges),
            "dynamo_bytes_per_call": per_call,
            "dynamo_ratio": round(2 * features * options.batch / per_call, 3) if ranges else None,
            "rope_removed": stream == "keys" and keys == "rope-removed",
            "mean": _write(out, f"{stem}.mean.f32", mean),
            "projection": _write(out, f"{stem}.projection.f32", projection),
            "ranges": ranges,
        })
    model = artifact.manifest["model"]
    calibration = CalibrationRecord.from_manifest(artifact.manifest)
    total_features = sum(c["features"] for c in configs)
    total_bytes = sum(c["dynamo_bytes_per_call"] for c in configs)
    doc = {"format": FORMAT, "artifact": artifact.name, "version": artifact.version, "ratio": float(ratio),
           "batch": options.batch,
           "dynamo_bytes_per_token": round(total_bytes / options.batch, 3) if configs else None,
           "dynamo_ratio": round(2 * total_features * options.batch / total_bytes, 3) if total_bytes else None,
           "streams": list(STREAMS), "feature_order": ["layer", "kv_head", "head_dim"], "layout": options.layout,
           "keys": keys, "fp8_blocks": options.fp8,
           "num_kv_heads": model["num_kv_heads"], "head_dim": model["head_dim"], "rope": model["rope"],
           **({"layers": model["layers"]} if model.get("layers") else {}),  # per-layer kinds and RoPE
           "sinks": calibration.sinks, "window": calibration.window,
           "kernel_bundle_hash": artifact.manifest.get("kernel_bundle_hash"), "configs": configs}
    path = out.add("dynamo_kvtc.json", (json.dumps(doc, indent=2) + "\n").encode())
    out.commit()
    return path
