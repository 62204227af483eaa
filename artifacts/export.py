"""Export one ratio of an artifact in the form NVIDIA Dynamo's KVBM KVTC kernels take (`KvtcConfig`).

For each stream and group, in DIR:
  <stream>-g<group>.mean.f32        float32 little-endian, shape (features,)
  <stream>-g<group>.projection.f32  float32 little-endian, row-major (features, pca_components)
  dynamo_kvtc.json                  shapes, sha256 of each array file, and the ordered range list
                                    {"start_idx", "end_idx", "quant_type": "Fp8"|"IntX", "int_bits"}
Only components that get bits are exported: components of "none" blocks are dropped from the
projection (they reconstruct as the mean), so ranges are contiguous from 0 to pca_components.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from kvtc.artifacts.artifact import Artifact
from kvtc.artifacts.schema import STREAMS

FORMAT = "kvtc-dynamo/1"
DYNAMO_INT_BITS = (1, 2, 4, 8)


def _ranges(blocks: list, where: str) -> tuple[list[int], list[dict]]:
    """Blocks -> (kept component indices, contiguous Dynamo ranges over them)."""
    columns: list[int] = []
    ranges: list[dict] = []
    for block in blocks:
        if block.type == "none":
            continue
        if block.type == "fp8":
            quant, bits = "Fp8", 0
        elif block.bits in DYNAMO_INT_BITS:
            quant, bits = "IntX", block.bits
        else:
            raise ValueError(f"{where}: block {tuple(block)} uses {block.type}, but Dynamo's IntX takes "
                             f"{DYNAMO_INT_BITS} bits only; recalibrate with allocator types among int1/int2/int4/int8/fp8")
        start = len(columns)
        columns.extend(range(block.start, block.start + block.size))
        # one range per block, never merged: IntX takes its min/max per range, as the allocator assumed per block
        ranges.append({"start_idx": start, "end_idx": len(columns), "quant_type": quant, "int_bits": bits})
    return columns, ranges


def _write(path: Path, array: np.ndarray) -> dict:
    data = np.ascontiguousarray(array, dtype="<f4").tobytes()
    path.write_bytes(data)
    return {"file": path.name, "shape": list(array.shape), "dtype": "float32", "byte_order": "little",
            "order": "row-major", "sha256": hashlib.sha256(data).hexdigest()}


def export_dynamo(artifact: Artifact, ratio: float, directory: str | Path) -> Path:
    """Write the Dynamo form of `ratio` for every stream and group into `directory`; -> the JSON path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    configs = []
    for entry in artifact.manifest["bases"]["entries"]:
        stream, group = entry["stream"], entry["group"]
        where = f"{artifact.name}@{artifact.version} ratio {ratio} {stream} group {group}"
        columns, ranges = _ranges(artifact.allocation(ratio, stream, group), where)
        mean, _, components = artifact.basis(stream, group)
        stem = f"{stream}-g{group}"
        configs.append({
            "stream": stream, "group": group, "layers": entry["layers"],
            "features": int(mean.shape[0]), "pca_components": len(columns),
            "budget_bits": artifact.allocation_info(ratio, stream, group)["budget_bits"],
            "rope_removed": stream == "keys",
            "mean": _write(out / f"{stem}.mean.f32", mean),
            "projection": _write(out / f"{stem}.projection.f32", components[:, columns]),
            "ranges": ranges,
        })
    model = artifact.manifest["model"]
    calibration = artifact.manifest["calibration"]
    doc = {"format": FORMAT, "artifact": artifact.name, "version": artifact.version, "ratio": float(ratio),
           "streams": list(STREAMS), "feature_order": ["layer", "kv_head", "head_dim"],
           "num_kv_heads": model["num_kv_heads"], "head_dim": model["head_dim"], "rope": model["rope"],
           "sinks": calibration["sinks"], "window": calibration["window"],
           "kernel_bundle_hash": artifact.manifest.get("kernel_bundle_hash"), "configs": configs}
    path = out / "dynamo_kvtc.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
