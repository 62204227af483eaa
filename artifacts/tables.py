"""Parquet encodings of an artifact's parts (no pickle): bases, allocations, metric and curve rows.

bases/<stream>-g<group>.components.parquet: k rows in component order, columns
  index int32, eigenvalue float32, component fixed_shape_tensor(float32|float16, [p]) (column j of (p, k)).
bases/<stream>-g<group>.mean.parquet: one row, column mean fixed_shape_tensor(float32, [p]).
bases/<stream>-g<group>.decoder.parquet (only a basis that is not orthonormal): k rows in component order,
  columns index int32, decoder fixed_shape_tensor(float32|float16, [p]) (column j of the decoder (p, k)).
allocations.parquet: one row per (ratio, stream, group): ratio float64, stream, group int32, budget_bits,
  cost_bits, kept int64, extra (JSON of other scalar fields), blocks list<struct<start, size, type, bits,
  scale_bits>> in component order.
metrics.parquet, curves/<name>.parquet: the rows as given, one column per key.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvtc.artifacts.blocks import normalize_block

BLOCK_TYPE = pa.struct([("start", pa.int32()), ("size", pa.int32()), ("type", pa.string()),
                        ("bits", pa.int32()), ("scale_bits", pa.int32())])
ALLOCATION_SCHEMA = pa.schema([("ratio", pa.float64()), ("stream", pa.string()), ("group", pa.int32()),
                               ("budget_bits", pa.int64()), ("cost_bits", pa.int64()), ("kept", pa.int64()),
                               ("extra", pa.string()), ("blocks", pa.list_(BLOCK_TYPE))])
METRIC_TYPES = {"ratio": pa.float64(), "stream": pa.string(), "group": pa.int64(), "split": pa.string(),
                "metric": pa.string(), "value": pa.float64()}


def to_parquet(table: pa.Table, compression: str = "zstd") -> bytes:
    sink = io.BytesIO()
    dense = compression == "none"  # bases: float data that dictionaries and codecs do not shrink
    pq.write_table(table, sink, compression=compression, use_dictionary=not dense,
                   row_group_size=4096 if dense else None)
    return sink.getvalue()


def from_parquet(data: bytes | str) -> pa.Table:
    return pq.read_table(io.BytesIO(data) if isinstance(data, bytes) else data)


def _tensor(rows: np.ndarray) -> pa.ExtensionArray:
    return pa.FixedShapeTensorArray.from_numpy_ndarray(np.array(rows, order="C", copy=True))


def encode_basis(mean: np.ndarray, eigenvalues: np.ndarray, components: np.ndarray, dtype: str) -> tuple[bytes, bytes]:
    """mean (p,), eigenvalues (k,), components (p, k) -> (components file, mean file)."""
    k = components.shape[1]
    table = pa.table({"index": pa.array(np.arange(k, dtype=np.int32)),
                      "eigenvalue": pa.array(np.asarray(eigenvalues, dtype=np.float32)),
                      "component": _tensor(np.asarray(components).T.astype(dtype))})
    if k == 0:
        table = table.replace_schema_metadata({"kvtc.p": str(components.shape[0])})
    means = pa.table({"mean": _tensor(np.asarray(mean, dtype=np.float32)[None, :])})
    return to_parquet(table, "none"), to_parquet(means, "none")


def decode_basis(components_file: bytes | str, mean_file: bytes | str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> mean (p,) float32, eigenvalues (k,) float32, components (p, k) as stored (float32 or float16)."""
    means = from_parquet(mean_file).column("mean").combine_chunks().to_numpy_ndarray()
    table = from_parquet(components_file)
    eig = table.column("eigenvalue").to_numpy()
    p = means.shape[1]
    column = table.column("component").combine_chunks()
    if len(column) == 0:
        comp = np.zeros((p, 0), dtype=column.type.value_type.to_pandas_dtype())
    else:
        comp = np.ascontiguousarray(column.to_numpy_ndarray().T)
    return means[0].copy(), np.ascontiguousarray(eig), comp


def encode_decoder(decoder: np.ndarray, dtype: str) -> bytes:
    """decoder (p, k) -> its file, stored as `dtype` like the components."""
    p, k = decoder.shape
    table = pa.table({"index": pa.array(np.arange(k, dtype=np.int32)),
                      "decoder": _tensor(np.asarray(decoder).T.astype(dtype))})
    if k == 0:
        table = table.replace_schema_metadata({"kvtc.p": str(p)})
    return to_parquet(table, "none")


def decode_decoder(decoder_file: bytes | str, shape: tuple[int, int]) -> np.ndarray:
    """-> decoder (p, k) float32; ValueError when the file is not a decoder of `shape` (its components')
    or holds non-finite values."""
    try:
        table = from_parquet(decoder_file)
        column = table.column("decoder").combine_chunks()
        if len(column) == 0:
            dec = np.zeros((shape[0], 0), dtype=np.float32)
        else:
            dec = np.ascontiguousarray(column.to_numpy_ndarray().T, dtype=np.float32)
    except (KeyError, AttributeError, TypeError, pa.ArrowException) as exc:
        raise ValueError(f"not a decoder table ({type(exc).__name__}: {exc})") from None
    if dec.shape != tuple(shape):
        raise ValueError(f"decoder has shape {dec.shape}, its basis' components {tuple(shape)}")
    if not np.isfinite(dec).all():
        raise ValueError("decoder holds non-finite values")
    return dec


def _integer(value: object, where: str) -> int | None:
    if value is None:
        return None
    if float(value) != int(value):
        raise ValueError(f"{where} must be an integer number of bits, got {value!r}")
    return int(value)


def encode_allocations(allocations: dict) -> bytes:
    """{(ratio, stream, group): {"budget_bits", "blocks", "cost_bits", "kept", ...}} -> allocations.parquet."""
    rows = []
    for (ratio, stream, group), alloc in sorted(allocations.items(), key=lambda kv: (float(kv[0][0]), kv[0][1], kv[0][2])):
        where = f"allocation ({ratio}, {stream}, {group})"
        extra = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in alloc.items()
                 if k not in ("budget_bits", "cost_bits", "kept", "blocks")}
        blocks = [dict(zip(BLOCK_TYPE.names, normalize_block(b, where))) for b in alloc["blocks"]]
        rows.append({"ratio": float(ratio), "stream": stream, "group": int(group),
                     "budget_bits": _integer(alloc["budget_bits"], f"{where} budget_bits"),
                     "cost_bits": _integer(alloc.get("cost_bits"), f"{where} cost_bits"),
                     "kept": _integer(alloc.get("kept"), f"{where} kept"),
                     "extra": json.dumps(extra, sort_keys=True, allow_nan=True), "blocks": blocks})
    return to_parquet(pa.Table.from_pylist(rows, schema=ALLOCATION_SCHEMA))


def decode_allocations(data: bytes | str) -> dict:
    """allocations.parquet -> {(ratio, stream, group): {..., "blocks": [(start, size, type, bits, scale_bits)]}}."""
    out = {}
    for row in from_parquet(data).to_pylist():
        alloc = {"budget_bits": row["budget_bits"], "cost_bits": row["cost_bits"], "kept": row["kept"]}
        alloc.update(json.loads(row["extra"]))
        alloc["blocks"] = [tuple(b[n] for n in BLOCK_TYPE.names) for b in row["blocks"]]
        out[(row["ratio"], row["stream"], row["group"])] = alloc
    return out


def encode_rows(rows: list[dict], known: dict[str, pa.DataType] | None = None) -> bytes:
    """Flat dict rows -> Parquet, one column per key (union, first-seen order); missing values are null."""
    known = known or {}
    columns = list(known) if not rows else list(dict.fromkeys(k for row in rows for k in row))
    arrays = {}
    for name in columns:
        values = [row.get(name) for row in rows]
        values = [v.item() if isinstance(v, np.generic) else v for v in values]
        try:
            arrays[name] = pa.array(values, type=known.get(name))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ValueError(f"column {name!r}: values must be scalars of one type ({exc})") from None
    return to_parquet(pa.table(arrays) if arrays else pa.table({}))


def decode_rows(data: bytes | str) -> list[dict]:
    return from_parquet(data).to_pylist()
