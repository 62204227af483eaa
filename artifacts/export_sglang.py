"""Export one ratio of an artifact in the form SGLang's KVTC loader takes (`KVTCArtifactLoader`,
file version "v3-worker-quant", HiCache host pool).

What that loader reads (`torch.load(..., weights_only=True)`): a dict {"version", "keys", "values"};
under each stream one entry per worker, `tp_<tp_rank>_pp_<pp_rank>` (the key each HiCache host pool
builds from its own ranks), holding `mu` (float32, (p,)), `basis` (float32, (p, rank), columns in PCA
order; the runtime keeps the prefix the schema codes) and `quant`, schemas keyed by the integer ratio
as a string: an ordered list of (feature_count, dtype) groups covering the kept prefix, dtype in
float32 / bfloat16 / int8 / int4, precision non-increasing, int4 groups a multiple of 8 wide. Each
int8/int4 group carries a float16 scale and offset per token (asymmetric min/max, reconstructed as
(q + offset) * scale); float groups are stored as cast. p is the worker's own features: its device
pool's layer_num x head_num x head_dim (the layers of its pipeline stage, the KV heads of its
tensor-parallel rank: one head on each of tp / kv_heads ranks when the heads are replicated), in
(layer, kv head, head_dim) order; a worker whose entry is missing, or whose mu is not (p,), fails
to start. Keys are projected with RoPE removed (SGLang removes NeoX-style RoPE over the whole head
itself at each token's position, and re-applies it after decoding).

- allocation blocks map to the narrowest SGLang dtype that holds them: fp8 (scaled) -> int8, int4 and
  int2 -> int4 where the block is a multiple of 8 wide, else int8; an earlier group narrower than a
  later one is widened (SGLang requires non-increasing precision); the real bytes per token and the
  real ratio are reported;
- one entry per worker: for every rank r of the artifact's tensor-parallel layout (`kvtc calibrate
  --tp N`; a single-rank artifact is rank 0 of TP 1) and every pipeline stage s (`pp`, layers split as
  SGLang's `get_pp_indices` splits them, or `pp_partition` as its SGLANG_PP_LAYER_PARTITION), worker
  tp_<r>_pp_<s> gets the one group over exactly the stage's layers and the rank's KV heads (ranks
  holding the same heads share one stored copy); an artifact without such a group for some worker is
  refused, naming the worker, its layers and heads, and the groups the artifact has;
- `tp`, if given, must equal the artifact's TP size: a TP 1 basis spans every KV head and cannot be
  cut to one rank's (serving it at TP 2 would hand rank 0 a basis of the wrong p);
- refused: keys calibrated with RoPE kept (SGLang removes RoPE before projecting), a RoPE that is
  not NeoX-style over the full head, a ratio that is not an integer.

A basis that is not orthonormal (the artifact carries a decoder for it, `Artifact.decoder`) reconstructs
x = mu + z @ decoder.T rather than z @ basis.T: its worker entry then also holds `decoder` (float32,
(p, rank), the same shape and columns as `basis`), and its JSON stream rows say "decoder": true. A
loader that reads only `basis` would decode such an entry wrongly; it must use `decoder` when present.

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
from kvtc.artifacts.export import ExportError, refuse_latent
from kvtc.artifacts.local_files import Outputs
from kvtc.artifacts.schema import STREAMS
from kvtc.artifacts.tensor_parallel import TensorParallelLayout

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


def pp_stages(num_layers: int, pp: int, partition: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """Each pipeline stage's layers [a, b), as SGLang's `get_pp_indices` splits them: `partition` (its
    SGLANG_PP_LAYER_PARTITION, layers per stage) when given, else evenly with the remainder on the last stages."""
    if not isinstance(pp, int) or pp < 1:
        raise ExportError(f"--pp must be an integer >= 1, got {pp!r}")
    if partition is not None:
        if len(partition) != pp or sum(partition) != num_layers or min(partition) < 1:
            raise ExportError(f"--pp-partition {','.join(map(str, partition))} must give {pp} stages of >= 1 layer "
                              f"summing to the model's {num_layers} layers")
        sizes = list(partition)
    else:
        if pp > num_layers:
            raise ExportError(f"--pp {pp} is more stages than the model's {num_layers} layers")
        base, extra = divmod(num_layers, pp)
        sizes = [base + (1 if s >= pp - extra else 0) for s in range(pp)]
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [(a, a + n) for a, n in zip(starts, sizes)]


def _check(artifact: Artifact, ratio: float, tp: int | None) -> tuple[int, CalibrationRecord, TensorParallelLayout | None]:
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
    layout = TensorParallelLayout.from_dict(cal.tensor_parallel, cal.groups)
    if tp is not None and tp != cal.tp:
        kv = int(artifact.manifest["model"]["num_kv_heads"])
        have = "one basis over all its KV heads per group" if cal.tp == 1 else f"bases for TP {cal.tp}"
        raise ExportError(f"{where} was calibrated for TP {cal.tp} ({have}); an SGLang worker at --tp {tp} holds "
                          f"{max(1, kv // tp)} of the model's {kv} KV heads, so its p differs: recalibrate with "
                          f"kvtc calibrate --tp {tp} --groups model, or serve at --tp {cal.tp}")
    return int(ratio), cal, layout


def _worker_group(artifact: Artifact, cal: CalibrationRecord, layout: TensorParallelLayout | None, rank: int,
                  stages: list[tuple[int, int]], s: int) -> int:
    """The one group (basis) worker tp_<rank>_pp_<stage> loads: over exactly the stage's layers, in order, and
    the rank's KV heads; ExportError naming what the artifact has instead."""
    kv = int(artifact.manifest["model"]["num_kv_heads"])
    heads = layout.heads(rank) if layout else (0, kv)
    stage, pp = stages[s], len(stages)
    wanted = tuple(range(*stage))
    candidates = [i for i, g in enumerate(cal.groups) if g.head_range(kv) == heads]
    match = [i for i in candidates if cal.groups[i].layers == wanted]
    if len(match) == 1:
        return match[0]
    have = [cal.groups[i].to_json() for i in candidates]
    need = "--groups model" if pp == 1 else f"groups matching the {pp} stages (e.g. --groups layers:{len(wanted)})"
    tp_hint = "" if layout is None else f" --tp {layout.tp}"
    raise ExportError(f"{artifact.name}@{artifact.version}: SGLang worker tp_{rank}_pp_{s} loads one basis "
                      f"over its layers [{stage[0]}, {stage[1]}) and KV heads [{heads[0]}, {heads[1]}); the artifact's "
                      f"groups for those heads are {have}: calibrate with {need}{tp_hint}")


def export_sglang(artifact: Artifact, ratio: float, directory: str | Path, *, tp: int | None = None, pp: int = 1,
                  pp_partition: tuple[int, ...] | None = None) -> Path:
    """Write `kvtc_sglang.pt` (+ `kvtc_sglang.json`) for `ratio` into `directory`: one worker entry
    `tp_<r>_pp_<s>` per tensor-parallel rank r of the artifact (its `--tp`) and pipeline stage s (`pp`,
    split as SGLang splits layers); `tp`, if given, must be the artifact's. -> the .pt path.
    Checks everything before writing anything."""
    import torch  # noqa: PLC0415 - kvtc.artifacts stays torch-free; torch loads only to write the .pt

    refuse_latent(artifact, "SGLang's KVTC loader")
    key, cal, layout = _check(artifact, ratio, tp)
    stages = pp_stages(int(artifact.manifest["model"]["num_layers"]), pp, pp_partition)
    ranks = layout.tp if layout else 1
    plan = []  # (worker, rank, stage index, group)
    for rank in range(ranks):
        for s in range(len(stages)):
            plan.append((f"tp_{rank}_pp_{s}", rank, s, _worker_group(artifact, cal, layout, rank, stages, s)))
    tensors: dict[tuple[str, int], tuple] = {}  # one copy per (stream, group): replicated ranks share it
    for stream in STREAMS:
        for group in sorted({g for *_, g in plan}):
            where = f"{artifact.name}@{artifact.version} ratio {ratio:g} {stream} group {group}"
            schema = sglang_schema(artifact.allocation(ratio, stream, group), where)
            mean, _, components = artifact.basis(stream, group)
            decoder = artifact.decoder(stream, group)
            kept = sum(size for size, _ in schema)
            tensors[(stream, group)] = (torch.from_numpy(np.ascontiguousarray(mean, dtype=np.float32)),
                                        torch.from_numpy(np.ascontiguousarray(components[:, :kept], dtype=np.float32)),
                                        schema,
                                        None if decoder is None else
                                        torch.from_numpy(np.ascontiguousarray(decoder[:, :kept], dtype=np.float32)))
    payload: dict = {"version": SGLANG_FILE_VERSION}
    summary = []
    for stream in STREAMS:
        payload[stream] = {}
        for worker, rank, s, group in plan:
            mu, basis, schema, decoder = tensors[(stream, group)]
            payload[stream][worker] = {"mu": mu, "basis": basis, "quant": {str(key): schema},
                                       **({} if decoder is None else {"decoder": decoder})}
            bits = sum(group_bits(size, dtype) for size, dtype in schema)
            features = int(mu.shape[0])
            summary.append({"stream": stream, "worker": worker, "tp_rank": rank, "pp_rank": s,
                            "layers": list(stages[s]), "heads": list(layout.heads(rank) if layout else
                                                                     (0, artifact.manifest["model"]["num_kv_heads"])),
                            "group": group, "features": features, "retained": int(basis.shape[1]),
                            "schema": [list(g) for g in schema], "bits_per_token": bits,
                            "sglang_ratio": round(16 * features / bits, 3),
                            **({} if decoder is None else {"decoder": True})})
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    outputs = Outputs(out)  # both files or neither, never through a planted link or FIFO
    path = outputs.add(SGLANG_FILE, buffer.getvalue())
    workers = []
    for worker, rank, s, _ in plan:
        rows = [r for r in summary if r["worker"] == worker]
        features, bits = sum(r["features"] for r in rows), sum(r["bits_per_token"] for r in rows)
        workers.append({"worker": worker, "tp_rank": rank, "pp_rank": s, "bytes_per_token": bits / 8,
                        "sglang_ratio": round(16 * features / bits, 3)})
    features = sum(s["features"] for s in summary)
    total_bits = sum(s["bits_per_token"] for s in summary)
    doc = {"format": "kvtc-sglang/2", "file": SGLANG_FILE, "file_version": SGLANG_FILE_VERSION,
           "sha256": hashlib.sha256(outputs.files[SGLANG_FILE]).hexdigest(), "artifact": artifact.name,
           "version": artifact.version, "ratio": float(ratio), "tp": ranks, "pp": len(stages),
           "pp_layers": [list(s) for s in stages], "keys": cal.keys, "sinks": cal.sinks,
           "window": cal.window, "rope": artifact.manifest["model"].get("rope"),
           "bytes_per_token": total_bits / 8, "sglang_ratio": round(16 * features / total_bits, 3),
           "workers": workers, "streams": summary}
    outputs.add(path.with_suffix(".json").name, (json.dumps(doc, indent=2) + "\n").encode())
    outputs.commit()
    return path
