"""Export one ratio of an artifact in the form NVIDIA Dynamo's KVBM KVTC kernels take (`KvtcConfig`).

Dynamo's kernels (`kvtc_compress` / `kvtc_decompress`) take one pointer per row and read `features`
contiguous elements from it: "features = num_kv_heads * head_dim * tokens_per_block", i.e. a row is
one KV block's memory region in KVBM's layouts (layer-separate `[num_blocks, outer_dim, page_size,
inner_dim]` or fully contiguous `[num_blocks, num_layers, outer_dim, page_size, inner_dim]`: one
(block, layer, K or V) region is page_size tokens x inner_dim = the rank's KV heads x head_dim,
token-major). They compute c = (x - mean) @ P, quantize each range of c, and decode
x_hat = c_hat @ P.T + mean. Ranges are `IntX` (1, 2, 4 or 8 bits, min/max affine per row per range,
both float32: 64 bits of metadata per range per row) or `Fp8` (a plain e4m3 cast, no scale). They
apply to rows exactly as stored: no RoPE removal.

Row layouts (`layout`):
- "block" (default): one row per (block, layer, K or V) region of `tokens_per_block` tokens. This
  project's bases are per token, so the projection is the per-token one on each token of the block
  (block-diagonal, `tokens_per_block` copies) with its columns ordered range by range: range j of
  the allocation becomes one Dynamo range holding that range's components of every token of the
  block, quantized with one min/max per block (not per token: 64 bits per range per block). Needs
  per-layer groups (`kvtc calibrate --groups layer`, with `--tp N` one per layer and rank). The
  projection is tokens_per_block^2 times the per-token one (Dynamo's GEMM is dense): the JSON
  gives its bytes and a projection over `max_projection_mb` is refused (use "token" then);
- "token": one row per (token, layer, K or V): a caller that passes one pointer per token (Dynamo's
  gather reads any pointers) and the per-token projection; per-layer groups only;
- "token-major": one row per token over all layers of a group, for a layout keeping every layer of a
  token contiguous (no KVBM layout does); any group.
A fully contiguous block as one row (all layers, K and V together) is not supported: the bases are
per stream, and a row mixing keys and values would need one basis over both.

Tensor parallelism: an artifact calibrated with `--tp N` has one basis per layer group and rank
(ranks holding the same KV heads share one); each config lists the ranks that use it, and the JSON's
"tensor_parallel" maps every rank to its heads and configs. A rank's region holds only its KV heads
(inner_dim = its heads x head_dim), which is what its bases cover.

What this export does about Dynamo's kernels:
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
- a basis of RoPE-removed keys needs a consumer that removes RoPE itself: refused unless
  `allow_rope_removed=True` (or calibrate with `--keys rope-kept`).

For each stream and group, in DIR:
  <stream>-g<group>.mean.f32        float32 little-endian, shape (features,)
  <stream>-g<group>.projection.f32  float32 little-endian, row-major (features, pca_components)
  <stem>.decoder.f32                only for a basis that is not orthonormal (a whitened one): the
                                    reconstruction matrix, float32, laid out exactly as the projection
                                    (same columns, same zero padding); the config's "decoder" names it.
                                    Such a basis decodes x_hat = c_hat @ D.T + mean with D this file,
                                    not the projection: Dynamo's stock kvtc_decompress uses P.T, so a
                                    consumer must pass D to its decompress GEMM. An export with any
                                    decoder is written as format "kvtc-dynamo/5" (FORMAT_DECODER) so a
                                    reader of "kvtc-dynamo/4" that knows no decoders refuses it
  dynamo_kvtc.json                  shapes, sha256 of each array file, the ordered ranges
                                    {"start_idx", "end_idx", "quant_type": "IntX", "int_bits"},
                                    the row layout, the ranks, bits per row and the real ratio
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
from kvtc.artifacts.tensor_parallel import TensorParallelLayout

FORMAT = "kvtc-dynamo/4"
FORMAT_DECODER = "kvtc-dynamo/5"  # FORMAT plus per-config "decoder" files (bases that are not orthonormal)
DYNAMO_INT_BITS = (1, 2, 4, 8)
DYNAMO_RANGE_METADATA_BITS = 64  # float32 min and max per row per IntX range
DYNAMO_RANGE_HEADER_BYTES = 40  # KvtcRangeHeader (i32, i32, 4 x u64), once per range per compress call
FP8_CHOICES = ("int8", "refuse")
LAYOUTS = ("block", "token", "token-major")
RANGE_CHOICES = ("pad", "refuse")


def refuse_latent(artifact: Artifact, consumer: str) -> None:
    """Multi-head latent attention artifacts (a latent and a RoPE-key stream of their own widths) have no
    form in the engines' per-head KV exports."""
    model = artifact.manifest.get("model", {})
    if "value_dim" in model:
        raise ExportError(f"{artifact.name}@{artifact.version} codes a multi-head latent attention cache (latent "
                          f"{model.get('head_dim')} + RoPE key {model['value_dim']} wide); {consumer} take per-head keys "
                          "and values only. Serve it through the codec (KVTCCodec, KVTCCache)")


class ExportError(ValueError):
    """The artifact cannot be expressed in the target runtime's terms as asked."""


@dataclass(frozen=True)
class DynamoExportOptions:
    """fp8: how scaled fp8 blocks map ("int8" or "refuse"); layout: what a row is ("block", "token",
    "token-major", see the module doc); tokens_per_block: tokens of a KV block (layout "block": the
    engine's block size, KVBM's page_size); allow_rope_removed: export a RoPE-removed key basis for a
    consumer that removes RoPE; ranges: "pad" or "refuse"; batch: rows per compress call (for the
    real ratio); max_projection_mb: largest projection file (layout "block") before refusing; tp: the
    tensor-parallel size served at, checked against the artifact's (None: the artifact's)."""

    fp8: str = "int8"
    layout: str = "block"
    allow_rope_removed: bool = False
    ranges: str = "pad"
    batch: int = 256
    tokens_per_block: int = 16
    max_projection_mb: float = 1024.0
    tp: int | None = None

    def __post_init__(self) -> None:
        if self.fp8 not in FP8_CHOICES:
            raise ValueError(f"fp8 must be one of {FP8_CHOICES}, got {self.fp8!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.ranges not in RANGE_CHOICES:
            raise ValueError(f"ranges must be one of {RANGE_CHOICES}, got {self.ranges!r}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch (rows per compress call) must be an integer >= 1, got {self.batch!r}")
        if isinstance(self.tokens_per_block, bool) or not isinstance(self.tokens_per_block, int) \
                or self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be an integer >= 1, got {self.tokens_per_block!r}")
        if not self.max_projection_mb > 0:
            raise ValueError(f"max_projection_mb must be > 0, got {self.max_projection_mb!r}")


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


def buffer_bytes(ranges: list[dict], batch: int) -> int:
    """Dynamo's `kvtc_compressed_size` for `batch` rows (what it allocates)."""
    return sum(DYNAMO_RANGE_HEADER_BYTES + batch * 8 + -(-batch * (r["end_idx"] - r["start_idx"]) // (8 // r["int_bits"]))
               for r in ranges)


def _write(out: Outputs, name: str, array: np.ndarray) -> dict:
    data = np.ascontiguousarray(array, dtype="<f4").tobytes()
    path = out.add(name, data)  # all files or none, never through a link or FIFO planted in the folder
    return {"file": path.name, "shape": list(array.shape), "dtype": "float32", "byte_order": "little",
            "order": "row-major", "sha256": hashlib.sha256(data).hexdigest()}


def _check(artifact: Artifact, options: DynamoExportOptions) -> tuple[str, CalibrationRecord]:
    """-> (the key form, the calibration); raises ExportError for what Dynamo cannot run as asked."""
    cal = CalibrationRecord.from_manifest(artifact.manifest)
    refuse_latent(artifact, "Dynamo's KVBM KVTC kernels")
    keys = cal.keys
    if keys == "rope-removed" and not options.allow_rope_removed:
        raise ExportError(f"{artifact.name}@{artifact.version} holds a basis of RoPE-removed keys, but Dynamo applies "
                          "the projection to keys as stored, with RoPE. Recalibrate with --keys rope-kept, or pass "
                          "--allow-rope-removed if your consumer removes RoPE before compressing and re-applies it")
    if options.tp is not None and options.tp != cal.tp:
        raise ExportError(f"{artifact.name}@{artifact.version} was calibrated for TP {cal.tp}; its bases do not fit "
                          f"a --tp {options.tp} deployment (each rank's region holds only its KV heads): recalibrate "
                          f"with kvtc calibrate --tp {options.tp} --groups layer, or serve at --tp {cal.tp}")
    if options.layout in ("block", "token"):
        wide = [g.to_json() for g in cal.groups if len(g.layers) > 1]
        if wide:
            raise ExportError(f"{artifact.name}@{artifact.version} has groups spanning several layers {wide}: a "
                              f"Dynamo row (layout {options.layout}) is one layer's {options.layout} region of K or "
                              "V (KVBM stores each layer's region apart). Recalibrate with --groups layer (with --tp N "
                              "for per-rank bases), or export with --layout token-major if your layout keeps all "
                              "layers of a token contiguous")
    return keys, cal


def _rank_map(artifact: Artifact, cal: CalibrationRecord) -> tuple[dict[int, list[int]], dict]:
    """-> (group index -> the ranks that code it, the JSON "tensor_parallel" section)."""
    kv = int(artifact.manifest["model"]["num_kv_heads"])
    layout = TensorParallelLayout.from_dict(cal.tensor_parallel, cal.groups)
    if layout is None:
        return {g: [0] for g in range(len(cal.groups))}, {"tp": 1, "ranks": [{"rank": 0, "heads": [0, kv]}]}
    users: dict[int, list[int]] = {g: [] for g in range(len(cal.groups))}
    ranks = []
    for r in range(layout.tp):
        groups = layout.rank_groups(r, cal.groups)
        for g in groups:
            users[g].append(r)
        ranks.append({"rank": r, "heads": list(layout.heads(r)), "groups": groups})
    return users, {"tp": layout.tp, "replicas": layout.replicas, "ranks": ranks}


def block_rows(columns: list[int], ranges: list[dict], tokens: int) -> tuple[list[tuple[int, int]], list[dict]]:
    """Per-token (kept components, ranges) -> a block row's: range j holds its components of every token,
    token by token: columns (token, component), ranges over them."""
    out_columns: list[tuple[int, int]] = []
    out_ranges = []
    for r in ranges:
        start = len(out_columns)
        out_columns += [(t, columns[c]) for t in range(tokens) for c in range(r["start_idx"], r["end_idx"])]
        out_ranges.append({**r, "start_idx": start, "end_idx": len(out_columns)})
    return out_columns, out_ranges


def _projection(components: np.ndarray, columns: list, tokens: int) -> np.ndarray:
    """(features, kept columns) float32: a column is a component (per-token rows), (token, component)
    (block rows: that token's features only), or None (a zero column padding a range)."""
    p = components.shape[0]
    if tokens == 1:
        out = np.zeros((p, len(columns)), dtype=np.float32)
        kept = [i for i, c in enumerate(columns) if c is not None]
        out[:, kept] = components[:, [columns[i] for i in kept]]
        return out
    out = np.zeros((tokens * p, len(columns)), dtype=np.float32)
    for t in range(tokens):
        kept = [i for i, c in enumerate(columns) if c is not None and c[0] == t]
        out[t * p:(t + 1) * p, kept] = components[:, [columns[i][1] for i in kept]]
    return out


def export_dynamo(artifact: Artifact, ratio: float, directory: str | Path,
                  options: DynamoExportOptions = DynamoExportOptions()) -> Path:
    """Write the Dynamo form of `ratio` for every stream and group into `directory`; -> the JSON path.
    Checks everything before writing anything."""
    keys, cal = _check(artifact, options)
    users, tensor_parallel = _rank_map(artifact, cal)
    tokens = options.tokens_per_block if options.layout == "block" else 1
    plans = []
    for entry in artifact.manifest["bases"]["entries"]:
        stream, group = entry["stream"], entry["group"]
        where = f"{artifact.name}@{artifact.version} ratio {ratio:g} {stream} group {group}"
        columns, ranges = dynamo_ranges(artifact.allocation(ratio, stream, group), options.fp8, where)
        if tokens > 1:
            columns, ranges = block_rows(columns, ranges, tokens)
        columns, ranges = pad_ranges(columns, ranges, options.ranges, where)
        features = tokens * int(artifact.basis(stream, group)[0].shape[0])
        mb = 4 * features * len(columns) / 2**20
        if tokens > 1 and mb > options.max_projection_mb:
            raise ExportError(f"{where}: a block row of {tokens} tokens needs a dense {features} x {len(columns)} "
                              f"projection ({mb:.0f} MB, over --max-projection-mb {options.max_projection_mb:g}): "
                              "Dynamo's GEMM has no block-diagonal form. Export --layout token (one pointer per "
                              "token) or a smaller --tokens-per-block")
        plans.append((entry, columns, ranges))
    out = Outputs(directory)
    configs = []
    for entry, columns, ranges in plans:
        stream, group = entry["stream"], entry["group"]
        mean, _, components = artifact.basis(stream, group)
        stem = f"{stream}-g{group}"
        per_token = int(mean.shape[0])
        features = tokens * per_token
        per_row = row_bytes(ranges)
        per_call = per_row * options.batch + DYNAMO_RANGE_HEADER_BYTES * len(ranges)
        assert buffer_bytes(ranges, options.batch) == per_call  # padded: Dynamo's sizing matches its kernel
        projection = _projection(components, columns, tokens)
        decoder = artifact.decoder(stream, group)
        info = artifact.allocation_info(ratio, stream, group)
        configs.append({
            "stream": stream, "group": group, "layers": entry["layers"], "ranks": users.get(group, []),
            "features": features, "features_per_token": per_token, "tokens_per_row": tokens,
            "pca_components": len(columns), "zero_columns": sum(c is None for c in columns),
            "budget_bits": info["budget_bits"], "dynamo_bits_per_row": 8 * per_row,
            "dynamo_header_bytes": DYNAMO_RANGE_HEADER_BYTES * len(ranges),
            "dynamo_bytes_per_call": per_call,
            "dynamo_ratio": round(2 * features * options.batch / per_call, 3) if ranges else None,
            "rope_removed": stream == "keys" and keys == "rope-removed",
            "projection_bytes": 4 * projection.size,
            "mean": _write(out, f"{stem}.mean.f32", np.tile(mean, tokens)),
            "projection": _write(out, f"{stem}.projection.f32", projection),
            "ranges": ranges,
            **({} if decoder is None else
               {"decoder": _write(out, f"{stem}.decoder.f32", _projection(decoder, columns, tokens))}),
        })
    model = artifact.manifest["model"]
    # bytes per token of one rank (ranks code their own heads; replicas repeat the same bytes)
    rank0 = [c for c in configs if 0 in c["ranks"]]
    rank_features = sum(c["features"] for c in rank0)
    rank_bytes = sum(c["dynamo_bytes_per_call"] for c in rank0)
    row = {"block": {"row": "one (block, layer, K or V) region", "order": ["token", "kv_head", "head_dim"],
                     "tokens_per_block": tokens, "columns": "range by range; within a range token by token"},
           "token": {"row": "one (token, layer, K or V)", "order": ["kv_head", "head_dim"]},
           "token-major": {"row": "one token over the group's layers", "order": ["layer", "kv_head", "head_dim"]}}
    fmt = FORMAT_DECODER if any("decoder" in c for c in configs) else FORMAT
    doc = {"format": fmt, "artifact": artifact.name, "version": artifact.version, "ratio": float(ratio),
           "batch": options.batch, "layout": options.layout, "row_layout": row[options.layout],
           "dynamo_bytes_per_token": round(rank_bytes / (options.batch * tokens), 3) if rank0 else None,
           "dynamo_ratio": round(2 * rank_features * options.batch / rank_bytes, 3) if rank_bytes else None,
           "streams": list(STREAMS), "feature_order": ["layer", "kv_head", "head_dim"],
           "keys": keys, "fp8_blocks": options.fp8, "tensor_parallel": tensor_parallel,
           "num_kv_heads": model["num_kv_heads"], "head_dim": model["head_dim"], "rope": model["rope"],
           **({"layers": model["layers"]} if model.get("layers") else {}),  # per-layer kinds and RoPE
           "sinks": cal.sinks, "window": cal.window,
           "kernel_bundle_hash": artifact.manifest.get("kernel_bundle_hash"), "configs": configs}
    path = out.add("dynamo_kvtc.json", (json.dumps(doc, indent=2) + "\n").encode())
    out.commit()
    return path
