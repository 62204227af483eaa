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

Reading a file listed by a manifest (`Artifact`) passes the shape the manifest declares: the file is
checked from its footer and page headers before any data is read (kvtc.artifacts.parquet_bounds), and
bases and decoders must hold finite values within MAX_ENTRY.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvtc.artifacts.blocks import normalize_block
from kvtc.artifacts.parquet_bounds import Declared, dense_bytes, is_type, read_checked, tensor_of

BLOCK_TYPE = pa.struct([("start", pa.int32()), ("size", pa.int32()), ("type", pa.string()),
                        ("bits", pa.int32()), ("scale_bits", pa.int32())])
ALLOCATION_SCHEMA = pa.schema([("ratio", pa.float64()), ("stream", pa.string()), ("group", pa.int32()),
                               ("budget_bits", pa.int64()), ("cost_bits", pa.int64()), ("kept", pa.int64()),
                               ("extra", pa.string()), ("blocks", pa.list_(BLOCK_TYPE))])
METRIC_TYPES = {"ratio": pa.float64(), "stream": pa.string(), "group": pa.int64(), "split": pa.string(),
                "metric": pa.string(), "value": pa.float64()}
MAX_ENTRY = 2.0 ** 40  # no fit gives a basis entry near it: orthonormal components are <= 1, a whitened encoder or
# decoder is bounded by its metric's condition number; past it z @ decoder.T leaves float32 for modest coefficients
_ITEM = {"float32": 4, "float16": 2}


def to_parquet(table: pa.Table, compression: str = "zstd") -> bytes:
    sink = pa.BufferOutputStream()  # grows in place; one copy out (BytesIO held two, then a third)
    dense = compression == "none"  # bases: float data that dictionaries and codecs do not shrink
    pq.write_table(table, sink, compression=compression, use_dictionary=not dense,
                   row_group_size=4096 if dense else None)
    return sink.getvalue().to_pybytes()


def from_parquet(data: bytes | str) -> pa.Table:
    return pq.read_table(io.BytesIO(data) if isinstance(data, bytes) else data)


def _tensor(rows: np.ndarray) -> pa.ExtensionArray:
    """rows (n, ...) C-ordered -> a tensor column over the same memory (a copy only when not contiguous)."""
    arr = np.ascontiguousarray(rows)
    if arr.ndim > 1 and arr.strides[0] < max(arr.strides[1:]):  # a length-1 axis may carry any stride
        arr = arr.copy()
    return pa.FixedShapeTensorArray.from_numpy_ndarray(arr)


def encode_basis(mean: np.ndarray, eigenvalues: np.ndarray, components: np.ndarray, dtype: str) -> tuple[bytes, bytes]:
    """mean (p,), eigenvalues (k,), components (p, k) -> (components file, mean file)."""
    k = components.shape[1]
    table = pa.table({"index": pa.array(np.arange(k, dtype=np.int32)),
                      "eigenvalue": pa.array(np.asarray(eigenvalues, dtype=np.float32)),
                      "component": _tensor(np.ascontiguousarray(np.asarray(components).T, dtype=dtype))})
    if k == 0:
        table = table.replace_schema_metadata({"kvtc.p": str(components.shape[0])})
    means = pa.table({"mean": _tensor(np.asarray(mean, dtype=np.float32)[None, :])})
    return to_parquet(table, "none"), to_parquet(means, "none")


def _read(source: bytes | str, declared: Declared | None, what: str) -> pa.Table:
    """A listed file (a path, with its declared shape) read once it fits it; our own bytes read as they are."""
    if declared is None or isinstance(source, bytes):
        return from_parquet(source)
    return read_checked(source, declared, what)


def basis_declared(p: int, k: int, dtype: str) -> tuple[Declared, Declared]:
    """(components file, mean file) shapes of a basis entry of p features and k components stored as `dtype`."""
    dtypes = ("float32", "float16") if dtype not in _ITEM else (dtype,)
    item = _ITEM.get(dtype, 4)
    components = Declared(dense_bytes(k, [4, 4, p * item]), k * (p + 2), rows=k,
                          columns={"index": is_type(pa.int32()), "eigenvalue": is_type(pa.float32()),
                                   "component": tensor_of((p,), dtypes)})
    mean = Declared(dense_bytes(1, [4 * p]), p, rows=1, columns={"mean": tensor_of((p,), ("float32",))})
    return components, mean


def decoder_declared(p: int, k: int, dtype: str) -> Declared:
    dtypes = ("float32", "float16") if dtype not in _ITEM else (dtype,)
    return Declared(dense_bytes(k, [4, p * _ITEM.get(dtype, 4)]), k * (p + 1), rows=k,
                    columns={"index": is_type(pa.int32()), "decoder": tensor_of((p,), dtypes)})


def check_entries(what: str, array: np.ndarray, limit: float = MAX_ENTRY) -> None:
    """ValueError naming `what` unless every value is finite and within +-limit."""
    if not np.isfinite(array).all():
        raise ValueError(f"{what} holds non-finite values (NaN or inf)")
    if array.size and float(np.abs(array).max()) > limit:
        raise ValueError(f"{what} holds {float(np.abs(array).max()):.3g}, beyond the {limit:.3g} any fit gives")


def decode_basis(components_file: bytes | str, mean_file: bytes | str, declared: tuple[Declared, Declared] | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> mean (p,) float32, eigenvalues (k,) float32, components (p, k) as stored (float32 or float16).
    declared: basis_declared(p, k, dtype) of a listed file; ValueError when its values are not finite."""
    means = _read(mean_file, declared and declared[1], "mean file").column("mean").combine_chunks().to_numpy_ndarray()
    table = _read(components_file, declared and declared[0], "components file")
    eig = table.column("eigenvalue").to_numpy()
    p = means.shape[1]
    column = table.column("component").combine_chunks()
    if len(column) == 0:
        comp = np.zeros((p, 0), dtype=column.type.value_type.to_pandas_dtype())
    else:
        comp = np.ascontiguousarray(column.to_numpy_ndarray().T)
    if means.shape[0] != 1 or comp.shape[0] != means.shape[1]:
        raise ValueError(f"mean {means.shape} and components {comp.shape} do not describe one basis")
    check_entries("mean", means, float(np.finfo(np.float32).max))
    check_entries("eigenvalues", eig, float(np.finfo(np.float32).max))
    check_entries("components", comp)
    return means[0].copy(), np.ascontiguousarray(eig), comp


def encode_decoder(decoder: np.ndarray, dtype: str) -> bytes:
    """decoder (p, k) -> its file, stored as `dtype` like the components."""
    p, k = decoder.shape
    table = pa.table({"index": pa.array(np.arange(k, dtype=np.int32)),
                      "decoder": _tensor(np.ascontiguousarray(np.asarray(decoder).T, dtype=dtype))})
    if k == 0:
        table = table.replace_schema_metadata({"kvtc.p": str(p)})
    return to_parquet(table, "none")


def decode_decoder(decoder_file: bytes | str, shape: tuple[int, int], declared: Declared | None = None) -> np.ndarray:
    """-> decoder (p, k) float32; ValueError when the file is not a decoder of `shape` (its components')
    or holds non-finite values or values beyond MAX_ENTRY. declared: decoder_declared(...) of a listed file."""
    try:
        table = _read(decoder_file, declared, "decoder file")
        column = table.column("decoder").combine_chunks()
        if len(column) == 0:
            dec = np.zeros((shape[0], 0), dtype=np.float32)
        else:
            dec = np.ascontiguousarray(column.to_numpy_ndarray().T, dtype=np.float32)
    except (KeyError, AttributeError, TypeError, pa.ArrowException) as exc:
        raise ValueError(f"not a decoder table ({type(exc).__name__}: {exc})") from None
    if dec.shape != tuple(shape):
        raise ValueError(f"decoder has shape {dec.shape}, its basis' components {tuple(shape)}")
    check_entries("decoder", dec)
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


def decode_allocations(data: bytes | str, declared: Declared | None = None) -> dict:
    """allocations.parquet -> {(ratio, stream, group): {..., "blocks": [(start, size, type, bits, scale_bits)]}}."""
    out = {}
    for row in _read(data, declared, "allocations file").to_pylist():
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


def rows_declared(manifest: dict) -> Declared:
    """The bound on a rows file (metrics, curves, allocations, ECSQ tables) of a manifest: rows and values in
    proportion to its features, sequence length and ratios (a spectrum has a row per feature, a curve by
    position one per position and ratio), with a floor for small artifacts."""
    entries = (manifest.get("bases") or {}).get("entries") or []
    features = sum(int(e.get("p", 0)) for e in entries if isinstance(e, dict) and isinstance(e.get("p"), int))
    calibration = manifest.get("calibration") or {}
    seq_len = calibration.get("seq_len") if isinstance(calibration.get("seq_len"), int) else 0
    ratios = len(calibration.get("ratios") or []) if isinstance(calibration.get("ratios"), list) else 0
    rows = 4 * (features + max(0, seq_len)) * (ratios + 1) + (1 << 14)
    return Declared(max_bytes=64 * rows, max_values=16 * rows, max_rows=rows)


def decode_rows(data: bytes | str, declared: Declared | None = None) -> list[dict]:
    return _read(data, declared, "rows file").to_pylist()
