"""ecsq.parquet: the entropy-coded (ECSQ) codec mode's tables, one row per (ratio, stream, group).

Columns: ratio float64, stream, group int32, budget_bits int64, step float64 (global quantizer
step), kept int64 (leading components coded), bits_per_token float64 (mean coded bits of held-out
tokens), heldout_rows int64, scales list<float32> (kept: held-out std per component), model
list<int32> (kept: index into models), offsets_width int32 (C), offsets list<float32> (kept x C
row-major: centroid offsets in steps), models list<struct<radius int32, counts list<int64>>>
(symbols [-radius, radius] then the escape).
"""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from kvtc.artifacts.parquet_bounds import Declared
from kvtc.artifacts.tables import from_parquet, read_checked, to_parquet

MODEL_TYPE = pa.struct([("radius", pa.int32()), ("counts", pa.list_(pa.int64()))])
ECSQ_SCHEMA = pa.schema([("ratio", pa.float64()), ("stream", pa.string()), ("group", pa.int32()),
                         ("budget_bits", pa.int64()), ("step", pa.float64()), ("kept", pa.int64()),
                         ("bits_per_token", pa.float64()), ("heldout_rows", pa.int64()),
                         ("scales", pa.list_(pa.float32())), ("model", pa.list_(pa.int32())),
                         ("offsets_width", pa.int32()), ("offsets", pa.list_(pa.float32())),
                         ("models", pa.list_(MODEL_TYPE))])


def check_table(key: tuple, table: dict) -> None:
    """Validate one (ratio, stream, group) entry; ValueError naming the key and the problem."""
    missing = [k for k in ("budget_bits", "step", "kept", "scales", "model", "offsets", "models") if k not in table]
    if missing:
        raise ValueError(f"ECSQ table {key!r} lacks {', '.join(missing)}")
    kept = int(table["kept"])
    step = float(table["step"])
    if not (step > 0 and math.isfinite(step)):
        raise ValueError(f"ECSQ table {key!r}: step must be positive and finite, got {step}")
    model, offsets = np.asarray(table["model"]), np.asarray(table["offsets"])
    if np.asarray(table["scales"]).shape != (kept,) or model.shape != (kept,) or offsets.ndim != 2 \
            or offsets.shape[0] != kept:
        raise ValueError(f"ECSQ table {key!r}: scales and model must be ({kept},), offsets ({kept}, C)")
    if kept and (model.min() < 0 or model.max() >= len(table["models"])):
        raise ValueError(f"ECSQ table {key!r}: a component names a symbol model that does not exist")
    for radius, counts in table["models"]:
        if int(radius) < 0 or np.asarray(counts).shape != (2 * int(radius) + 2,) or np.asarray(counts).min() < 1:
            raise ValueError(f"ECSQ table {key!r}: each symbol model needs 2 radius + 2 counts, all >= 1")


def encode_ecsq(entries: dict) -> bytes:
    """{(ratio, stream, group): table (see EcsqFit.to_table)} -> ecsq.parquet bytes."""
    rows = []
    for (ratio, stream, group), t in sorted(entries.items(), key=lambda kv: (float(kv[0][0]), kv[0][1], kv[0][2])):
        check_table((ratio, stream, group), t)
        offsets = np.asarray(t["offsets"], dtype=np.float32)
        rows.append({"ratio": float(ratio), "stream": stream, "group": int(group),
                     "budget_bits": int(t["budget_bits"]), "step": float(t["step"]), "kept": int(t["kept"]),
                     "bits_per_token": float(t.get("bits_per_token", float("nan"))),
                     "heldout_rows": int(t.get("heldout_rows", 0)),
                     "scales": np.asarray(t["scales"], dtype=np.float32), "model": np.asarray(t["model"], dtype=np.int32),
                     "offsets_width": int(offsets.shape[1]), "offsets": offsets.reshape(-1),
                     "models": [{"radius": int(r), "counts": np.asarray(c, dtype=np.int64)} for r, c in t["models"]]})
    return to_parquet(pa.Table.from_pylist(rows, schema=ECSQ_SCHEMA))


def decode_ecsq(data: bytes | str, declared: Declared | None = None) -> dict:
    """ecsq.parquet -> {(ratio, stream, group): table} with numpy arrays; validated. declared: the bound of a
    listed file (tables.rows_declared), checked before it is read."""
    out = {}
    table = from_parquet(data) if declared is None or isinstance(data, bytes) else read_checked(data, declared, "ECSQ file")
    for row in table.to_pylist():
        key = (row["ratio"], row["stream"], row["group"])
        width = max(int(row["offsets_width"]), 1)
        table = {k: row[k] for k in ("budget_bits", "step", "kept", "bits_per_token", "heldout_rows")}
        table["scales"] = np.asarray(row["scales"], dtype=np.float32)
        table["model"] = np.asarray(row["model"], dtype=np.int32)
        table["offsets"] = np.asarray(row["offsets"], dtype=np.float32).reshape(-1, width)
        table["models"] = [(int(m["radius"]), np.asarray(m["counts"], dtype=np.int64)) for m in row["models"]]
        check_table(key, table)
        out[key] = table
    return out
