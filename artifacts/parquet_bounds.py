"""Parquet files read only after their footer and page headers fit what the manifest declares.

A listed file's sha256 says only that it is the file the manifest's writer listed; an unsigned registry
can list a forged one (10 KB of zstd declaring 2M rows). Before any data page is read, `read_checked`
compares the footer (row count, row groups, column names and types) with the declared shape and walks
every column chunk's page headers (Thrift compact, parsed here: pyarrow trusts them), summing what the
pages decode to. A file whose pages could decode to more than its declared bytes or values is refused,
so a read costs at most about its declared size. Every refusal is a CorruptArtifactError naming the file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import BinaryIO, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from kvtc.artifacts.errors import CorruptArtifactError, IntegrityError
from kvtc.artifacts.safe_io import open_untrusted

TypeCheck = Callable[[pa.DataType], bool]
MAX_ROW_GROUPS = 4096
MAX_COLUMNS = 64
_HEADER_START = 1 << 12   # first read of a page header; doubled up to _HEADER_LIMIT
_HEADER_LIMIT = 1 << 20   # a page header (its statistics included) larger than this is refused
_THRIFT_DEPTH = 8
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3


@dataclass(frozen=True)
class Declared:
    """What a file may hold. rows: the exact row count (None: any up to max_rows); columns: {name: type
    check} in order (None: any, at most MAX_COLUMNS); max_values: values (list elements included) its
    pages may hold; max_bytes: bytes its pages may decode to."""

    max_bytes: int
    max_values: int
    rows: int | None = None
    max_rows: int = 0
    columns: dict[str, TypeCheck] | None = field(default=None)


def tensor_of(shape: tuple[int, ...], dtypes: tuple[str, ...]) -> TypeCheck:
    """A type check for fixed_shape_tensor(one of `dtypes`, `shape`)."""
    def check(t: pa.DataType) -> bool:
        return isinstance(t, pa.FixedShapeTensorType) and tuple(t.shape) == tuple(shape) \
            and str(t.value_type.to_pandas_dtype().__name__) in dtypes
    return check


def is_type(expected: pa.DataType) -> TypeCheck:
    return lambda t: t == expected


def dense_bytes(rows: int, widths: list[int]) -> int:
    """Page bytes of `rows` rows of fixed-width columns (`widths` bytes a row each), with levels' slack."""
    return rows * sum(widths) + 64 * (rows + 1) * len(widths) + (1 << 12)


class _Short(Exception):
    """A page header runs past the bytes read so far."""


class _Thrift:
    """Just enough of Thrift's compact protocol to read a Parquet page header."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def _byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Short
        self.pos += 1
        return self.data[self.pos - 1]

    def _skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.data):
            raise _Short if n >= 0 else ValueError("negative length")
        self.pos += n

    def _varint(self) -> int:
        shift = result = 0
        while True:
            b = self._byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise ValueError("varint longer than 64 bits")

    def _zigzag(self) -> int:
        n = self._varint()
        return (n >> 1) ^ -(n & 1)

    def struct(self, depth: int = 0) -> dict[int, object]:
        """{field id: int, bool, nested struct dict, or None (strings, lists, maps, doubles: skipped)}."""
        if depth > _THRIFT_DEPTH:
            raise ValueError("structs nested too deep")
        fields: dict[int, object] = {}
        last = 0
        while True:
            head = self._byte()
            if head == 0:
                return fields
            delta, kind = head >> 4, head & 0x0F
            last = last + delta if delta else self._zigzag()
            fields[last] = self._value(kind, depth)

    def _value(self, kind: int, depth: int) -> object:
        if kind in (1, 2):
            return kind == 1
        if kind == 3:
            return self._byte()
        if kind in (4, 5, 6):
            return self._zigzag()
        if kind == 7:
            self._skip(8)
            return None
        if kind == 8:
            self._skip(self._varint())
            return None
        if kind in (9, 10):
            head = self._byte()
            size, element = head >> 4, head & 0x0F
            size = self._varint() if size == 15 else size
            if size > len(self.data) - self.pos:
                raise _Short
            for _ in range(size):
                self._value(3 if element in (1, 2) else element, depth + 1)
            return None
        if kind == 11:
            size = self._varint()
            if size > len(self.data) - self.pos:
                raise _Short
            types = self._byte() if size else 0
            for _ in range(size):
                self._value(types >> 4, depth + 1)
                self._value(types & 0x0F, depth + 1)
            return None
        if kind == 12:
            return self.struct(depth + 1)
        raise ValueError(f"unknown Thrift type {kind}")


def _page_header(handle: BinaryIO, offset: int, end: int) -> tuple[int, dict[int, object]]:
    """(header length, fields) of the page header at `offset` (reading no further than `end`)."""
    want = _HEADER_START
    while True:
        handle.seek(offset)
        data = handle.read(min(want, end - offset))
        reader = _Thrift(data)
        try:
            fields = reader.struct()
            return reader.pos, fields
        except _Short:
            if len(data) < min(want, end - offset) or want >= _HEADER_LIMIT or offset + want >= end:
                raise ValueError("a page header runs past its column chunk") from None
            want *= 2


def _as_int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"page header {what} is {value!r}, not a size")
    return value


def _chunk_pages(handle: BinaryIO, size: int, column) -> tuple[int, int]:
    """(bytes, values) the pages of one column chunk decode to, from their headers."""
    start = column.dictionary_page_offset if column.has_dictionary_page and column.dictionary_page_offset \
        else column.data_page_offset
    length = column.total_compressed_size
    if start is None or start < 4 or length < 0 or start + length > size:
        raise ValueError(f"column {column.path_in_schema}'s pages lie outside the file")
    uncompressed_codec = column.compression == "UNCOMPRESSED"
    pos, end, decoded, values = start, start + length, 0, 0
    while pos < end:
        header_len, fields = _page_header(handle, pos, end)
        raw = _as_int(fields.get(2), "uncompressed_page_size")
        stored = _as_int(fields.get(3), "compressed_page_size")
        if uncompressed_codec and raw != stored:
            raise ValueError(f"column {column.path_in_schema}: an uncompressed page declares {raw} bytes and stores {stored}")
        kind = fields.get(1)
        detail = fields.get({_DATA_PAGE: 5, _DICTIONARY_PAGE: 7, _DATA_PAGE_V2: 8}.get(kind, -1))
        if isinstance(detail, dict):
            values += _as_int(detail.get(1), "num_values")
        decoded += raw
        pos += header_len + stored
    if pos != end:
        raise ValueError(f"column {column.path_in_schema}'s pages overrun its chunk")
    return decoded, values


def _check_footer(pf: pq.ParquetFile, declared: Declared) -> None:
    md = pf.metadata
    if declared.rows is not None and md.num_rows != declared.rows:
        raise ValueError(f"it holds {md.num_rows} rows, the shape the manifest declares has {declared.rows}")
    if declared.rows is None and md.num_rows > declared.max_rows:
        raise ValueError(f"it holds {md.num_rows} rows, more than the {declared.max_rows} the manifest allows")
    if md.num_row_groups > MAX_ROW_GROUPS or sum(md.row_group(i).num_rows for i in range(md.num_row_groups)) \
            != md.num_rows:
        raise ValueError(f"its {md.num_row_groups} row groups do not add up to its {md.num_rows} rows")
    schema = pf.schema_arrow
    if declared.columns is None:
        if len(schema) > MAX_COLUMNS:
            raise ValueError(f"it has {len(schema)} columns, more than {MAX_COLUMNS}")
        return
    if schema.names != list(declared.columns):
        raise ValueError(f"its columns are {schema.names}, expected {list(declared.columns)}")
    for name, check in declared.columns.items():
        if not check(schema.field(name).type):
            raise ValueError(f"column {name!r} has type {schema.field(name).type}, not the declared one")


def check_bounds(handle: BinaryIO, size: int, declared: Declared) -> pq.ParquetFile:
    """The open file's ParquetFile once its footer and page headers fit `declared`; ValueError otherwise."""
    pf = pq.ParquetFile(handle)
    _check_footer(pf, declared)
    md = pf.metadata
    decoded = values = 0
    for i in range(md.num_row_groups):
        group = md.row_group(i)
        for j in range(group.num_columns):
            b, v = _chunk_pages(handle, size, group.column(j))
            decoded, values = decoded + b, values + v
            if decoded > declared.max_bytes or values > declared.max_values:
                raise ValueError(f"its pages decode to more than the declared {declared.max_bytes} bytes or "
                                 f"{declared.max_values} values")
    return pf


def read_checked(path: str, declared: Declared, what: str) -> pa.Table:
    """The table of the Parquet file `path` (an artifact's `what`), read only once it fits `declared`.

    CorruptArtifactError naming it when it does not, or cannot be parsed."""
    try:
        handle, size = open_untrusted(None, True, path, what)
    except IntegrityError as exc:
        raise CorruptArtifactError(str(exc)) from None
    with handle:
        try:
            return check_bounds(handle, size, declared).read()
        except (ValueError, OSError, pa.ArrowException) as exc:  # ArrowInvalid is a ValueError too
            raise CorruptArtifactError(f"{what} {path} is not what the manifest declares ({exc}); the version was "
                                       "forged or damaged: republish it or pull another version") from None
