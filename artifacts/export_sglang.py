"""Export one ratio of an artifact in the form SGLang's KVTC loader takes (`KVTCArtifactLoader`,
file version "v3-worker-quant", HiCache host pool).

What that loader reads (`torch.load(..., weights_only=True)`): a dict {"version", "keys", "values"};
under each stream one entry per worker `tp_<tp>_pp_<pp>` holding `mu` (float32, (p,)), `basis`
(float32, (p, rank), columns in PCA order; the runtime keeps a prefix) and `quant`, schemas keyed by
the integer ratio as a string: an ordered list of (feature_count, dtype) groups covering the kept
prefix, dtype in float32 / bfloat16 / int8 / int4, precision non-increasing, int4 groups a multiple
of 8 wide. Each int8/int4 group carries a float16 scale and offset per token (asymmetric min/max,
int8 in [-128, 127], int4 in [0, 15]); float groups are stored as cast. p is one worker's features
in (layer, kv head, head_dim) order, and keys are projected with RoPE removed (SGLang removes
NeoX-style RoPE over the whole head itself, and re-applies it after decoding).

What this export does about it:
- allocation blocks map to the narrowest SGLang dtype that holds them: fp8 (scaled) -> int8, int4 and
  int2 -> int4 where the block is a multiple of 8 wide, else int8; an earlier group narrower than a
  later one is widened (SGLang requires non-increasing precision); the real bytes per token and the
  real ratio are reported;
- one basis per worker: only artifacts with one group per stream export (`--groups model`), as
  worker tp_0_pp_0 (per-rank artifacts from `kvtc calibrate --tp N` export one worker per rank);
- refused: keys calibrated with RoPE kept (SGLang removes RoPE before projecting), a RoPE that is
  not NeoX-style over the full head, a ratio that is not an integer.

The file is a torch archive because that is what the loader reads; this project never reads it
back except through the same restricted loader (`weights_only=True`). Beside it, a JSON summary.
"""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np

from kvtc.artifacts.artifact import Artifact
from kvtc.artifacts.calibration import CalibrationRecord
from kvtc.artifacts.export import ExportError
from kvtc.artifacts.local_files import Outputs
from kvtc.artifacts.schema import STREAMS

SGLANG_FILE_VERSION = "v3-worker-quant"
SGLANG_DTYPE_BITS = {"float32": 32, "bfloat16": 16, "int8": 8, "int4": 4}
SGLANG_METADATA_BITS = 32  # float16 scale and float16 offset per quantized group per token
SGLANG_QUANTIZED = ("int8", "int4")
SGLANG_FILE = "kvtc_sglang.pt"


def group_bits(size: int, dtype: str) -> int:
    """Bits per token of one schema group, as SGLang counts them (`quant_group_bits`)."""
    return size * SGLANG_DTYPE_BITS[dtype] + (SGLANG_METADATA_BITS if dtype in SGLANG_QUANTIZED else 0)


def sglang_schema(blocks: list, where: str) -> list[tuple[int, str]]:
    """Allocation blocks -> SGLang's (feature_count, dtype) groups over the kept prefix."""
    groups: list[tuple[int, str]] = []
    position = 0
    for block in blocks:
        start, size, block_type, bits = block[0], block[1], block[2], block[3]
        if block_type == "none":
            continue
        if start != position:
            raise ExportError(f"{where}: components [{position}, {start}) get no bits between coded ones; SGLang's "
                              "schema codes a contiguous prefix of the basis")
        if bits <= 4 and size % 8 == 0:
            dtype = "int4"
        elif bits <= 8:
            dtype = "int8"
        elif bits <= 16:
            dtype = "bfloat16"
        else:
            dtype = "float32"
        groups.append((size, dtype))
        position = start + size
    for i in range(len(groups) - 2, -1, -1):  # SGLang requires non-increasing precision
        if SGLANG_DTYPE_BITS[groups[i][1]] < SGLANG_DTYPE_BITS[groups[i + 1][1]]:
            groups[i] = (groups[i][0], groups[i + 1][1])
    if not groups:
        raise ExportError(f"{where}: the allocation codes no component")
    return groups


def _check(artifact: Artifact, ratio: float) -> int:
    where = f"{artifact.name}@{artifact.version}"
    if not float(ratio).is_integer() or ratio < 1:
        raise ExportError(f"{where}: SGLang keys its schemas by integer ratios; got {ratio:g}")
    cal = CalibrationRecord.from_manifest(artifact.manifest)
    if cal.keys != "rope-removed":
        raise ExportError(f"{where} holds a basis of keys with RoPE kept, but SGLang's KVTC removes RoPE from keys "
                          "before projecting: calibrate with --keys rope-removed (the default)")
    rope = artifact.manifest["model"].get("rope") or {}
    if rope and (rope.get("layout", "half") != "half" or rope.get("rotary_dim") != rope.get("head_dim")):
        raise ExportError(f"{where}: SGLang's KVTC handles NeoX-style RoPE over the whole head only; this model's RoPE "
                          f"is {rope.get('layout', 'half')} over {rope.get('rotary_dim')} of {rope.get('head_dim')} dims")
    for stream in STREAMS:
        groups = [e for e in artifact.manifest["bases"]["entries"] if e["stream"] == stream]
        if len(groups) != 1:
            raise ExportError(f"{where} has {len(groups)} {stream} groups; SGLang loads one basis per worker over all "
                              "its layers: calibrate with --groups model")
    return int(ratio)


def export_sglang(artifact: Artifact, ratio: float, directory: str | Path) -> Path:
    """Write `kvtc_sglang.pt` (+ `kvtc_sglang.json`) for `ratio` into `directory`; -> the .pt path.
    Checks everything before writing anything."""
    import torch

    key = _check(artifact, ratio)
    worker = "tp_0_pp_0"
    payload: dict = {"version": SGLANG_FILE_VERSION}
    summary = []
    for stream in STREAMS:
        where = f"{artifact.name}@{artifact.version} ratio {ratio:g} {stream}"
        schema = sglang_schema(artifact.allocation(ratio, stream, 0), where)
        mean, _, components = artifact.basis(stream, 0)
        kept = sum(size for size, _ in schema)
        bits = sum(group_bits(size, dtype) for size, dtype in schema)
        payload[stream] = {worker: {"mu": torch.from_numpy(np.ascontiguousarray(mean, dtype=np.float32)),
                                    "basis": torch.from_numpy(np.ascontiguousarray(components[:, :kept],
                                                                                   dtype=np.float32)),
                                    "quant": {str(key): schema}}}
        summary.append({"stream": stream, "worker": worker, "features": int(mean.shape[0]), "retained": kept,
                        "schema": [list(g) for g in schema], "bits_per_token": bits,
                        "sglang_ratio": round(16 * int(mean.shape[0]) / bits, 3)})
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    outputs = Outputs(out)  # both files or neither, never through a planted link or FIFO
    path = outputs.add(SGLANG_FILE, buffer.getvalue())
    features = sum(s["features"] for s in summary)
    total_bits = sum(s["bits_per_token"] for s in summary)
    cal = CalibrationRecord.from_manifest(artifact.manifest)
    doc = {"format": "kvtc-sglang/1", "file": SGLANG_FILE, "file_version": SGLANG_FILE_VERSION,
           "sha256": hashlib.sha256(outputs.files[SGLANG_FILE]).hexdigest(), "artifact": artifact.name,
           "version": artifact.version, "ratio": float(ratio), "keys": cal.keys, "sinks": cal.sinks,
           "window": cal.window, "rope": artifact.manifest["model"].get("rope"),
           "bytes_per_token": total_bits / 8, "sglang_ratio": round(16 * features / total_bits, 3),
           "streams": summary}
    outputs.add(path.with_suffix(".json").name, (json.dumps(doc, indent=2) + "\n").encode())
    outputs.commit()
    return path
