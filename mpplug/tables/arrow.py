"""Arrow tables as mpplug values: `TableType` <-> Arrow schema, conformance, and the Arrow IPC
bytes a table crosses a wire as (validated on receipt, never unpickled).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from mpplug.core import TableType
from mpplug.errors import TableError

_KIND_TO_ARROW: dict[str, pa.DataType] = {
    "bool": pa.bool_(),
    "i8": pa.int8(),
    "i16": pa.int16(),
    "i32": pa.int32(),
    "i64": pa.int64(),
    "u8": pa.uint8(),
    "u16": pa.uint16(),
    "u32": pa.uint32(),
    "u64": pa.uint64(),
    "f32": pa.float32(),
    "f64": pa.float64(),
    "str": pa.string(),
}
_ARROW_TO_KIND = {str(t): k for k, t in _KIND_TO_ARROW.items()}
_WIDENED = {"large_string": "str", "string_view": "str"}


def arrow_type(kind: str) -> pa.DataType:
    return _KIND_TO_ARROW[kind]


def arrow_schema(ttype: TableType) -> pa.Schema:
    return pa.schema([pa.field(name, _KIND_TO_ARROW[kind]) for name, kind in ttype.columns])


def column_kind(field: pa.Field, where: str) -> str:
    """The kind of an Arrow column; a TableError says what to do for types mpplug lacks."""
    name = str(field.type)
    kind = _ARROW_TO_KIND.get(name) or _WIDENED.get(name)
    if kind is None:
        hint = (
            " (DuckDB's HUGEINT, for example a SUM of integers, arrives as a decimal)"
            if pa.types.is_decimal(field.type)
            else ""
        )
        raise TableError(
            f"{where}: column {field.name!r} is {name}{hint}; mpplug tables hold "
            f"{', '.join(_KIND_TO_ARROW)} columns: CAST it (to BIGINT, DOUBLE or VARCHAR in SQL)"
        )
    return kind


def table_type(table: pa.Table, where: str, *, rows: bool = True) -> TableType:
    """The type of an Arrow table (its row count too, unless `rows=False`)."""
    columns = [(f.name, column_kind(f, where)) for f in table.schema]
    try:
        return TableType(columns, table.num_rows if rows else None)
    except ValueError as exc:
        raise TableError(f"{where}: {exc}") from None


def conform(table: Any, expected: TableType, where: str) -> pa.Table:
    """`table` as exactly `expected`'s Arrow schema (text widened to `string`, chunks kept);
    a TableError if its columns or row count differ."""
    if not isinstance(table, pa.Table):
        raise TableError(f"{where}: expected a pyarrow.Table, got {type(table).__name__}")
    got = table_type(table, where)
    if got.columns != expected.columns:
        raise TableError(f"{where}: expected columns {expected}, got {got}")
    if expected.rows is not None and got.rows != expected.rows:
        raise TableError(f"{where}: expected {expected.rows} rows, got {got.rows}")
    schema = arrow_schema(expected)
    if table.schema.equals(schema):
        return table
    return table.cast(schema)


def to_ipc(table: pa.Table) -> bytes:
    """The Arrow IPC stream of `table` (uncompressed)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: Any, expected: TableType, where: str) -> pa.Table:
    """Decode received Arrow IPC bytes and check them fully: every buffer and offset valid
    (`validate(full=True)`), the schema exactly `expected`'s, the row count if declared."""
    try:
        with pa.ipc.open_stream(pa.py_buffer(data)) as reader:
            table = reader.read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise TableError(f"{where}: the bytes are not a valid Arrow IPC stream: {exc}") from None
    if not table.schema.remove_metadata().equals(arrow_schema(expected.with_rows(None))):
        raise TableError(f"{where}: expected the schema {expected}, got {table.schema}")
    if expected.rows is not None and table.num_rows != expected.rows:
        raise TableError(f"{where}: expected {expected.rows} rows, got {table.num_rows}")
    return table.replace_schema_metadata(None)
