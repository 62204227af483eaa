"""Forged Parquet files for the integrity tests and bench/hostile.py."""
from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def zero_rows_bomb(column: str, rows: int = 2_000_000, width: int = 1) -> bytes:
    """A few KB of zstd Parquet declaring `rows` zero rows (a column of float32 fixed-size lists when width > 1)."""
    values = pa.array(np.zeros(rows * width, np.float32))
    array = values if width == 1 else pa.FixedSizeListArray.from_arrays(values, width)
    sink = io.BytesIO()
    pq.write_table(pa.table({column: array}), sink, compression="zstd")
    return sink.getvalue()
