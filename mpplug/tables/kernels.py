"""The `table.*` kernels (SQL, tensor conversions, row counts) and the PFunctions that call
them; registered through the `mpplug.kernels` entry points, as `jax.exec` is.

A table is a `pyarrow.Table` at one party; its type is a `TableType`. Every kernel checks what
it is given against the PFunction's declared types and raises a typed error naming the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from mpplug.core import DType, PFunction, TableType, TensorType
from mpplug.errors import InvalidPFunctionError, TableError
from mpplug.kernels.runtime import KernelRuntime
from mpplug.tables import arrow, sql

SQL = "table.sql"
TO_TENSOR = "table.to_tensor"
FROM_TENSOR = "table.from_tensor"
NUM_ROWS = "table.num_rows"
WITH_ROWS = "table.with_rows"

ROWS_TYPE = TensorType(DType.INT64, ())


def sql_pfunction(
    query: str, names: Sequence[str], ins: Sequence[TableType], out: TableType
) -> PFunction:
    """(tables named `names`) -> the table `query` returns."""
    return PFunction(SQL, "sql", b"", tuple(ins), (out,), {"query": query, "names": tuple(names)})


def to_tensor_pfunction(table: TableType, columns: Sequence[str], out: TensorType) -> PFunction:
    """table -> `out` (rows x columns, or rows for one column given as a str)."""
    return PFunction(TO_TENSOR, "to_tensor", b"", (table,), (out,), {"columns": tuple(columns)})


def from_tensor_pfunction(x: TensorType, out: TableType) -> PFunction:
    """array of (rows,) or (rows, columns) -> a table with `out`'s columns."""
    return PFunction(FROM_TENSOR, "from_tensor", b"", (x,), (out,))


def num_rows_pfunction(table: TableType) -> PFunction:
    return PFunction(NUM_ROWS, "num_rows", b"", (table,), (ROWS_TYPE,))


def with_rows_pfunction(table: TableType, rows: int) -> PFunction:
    """table -> the same table, typed with `rows` rows (checked at the party)."""
    return PFunction(WITH_ROWS, "with_rows", b"", (table,), (table.with_rows(rows),))


def _output(pfunc: PFunction, kind: type) -> Any:
    if len(pfunc.outs_info) != 1 or not isinstance(pfunc.outs_info[0], kind):
        raise InvalidPFunctionError(
            f"{pfunc.fn_type}: expected one {kind.__name__} output, got {pfunc.outs_info}"
        )
    return pfunc.outs_info[0]


def _str_tuple(pfunc: PFunction, name: str) -> tuple[str, ...]:
    value = pfunc.attrs.get(name)
    if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
        raise InvalidPFunctionError(
            f"{pfunc.fn_type}: expected a list of str attribute {name!r}, got {value!r}"
        )
    return value


def run_sql(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    query, names = pfunc.attrs.get("query"), _str_tuple(pfunc, "names")
    out = _output(pfunc, TableType)
    if not isinstance(query, str) or len(names) != len(args):
        raise InvalidPFunctionError(f"{SQL}: expected a str 'query' and one name per input")
    where = f"party {runtime.rank}, mp.sql"
    result = sql.run(query, dict(zip(names, args, strict=True)), where)
    return [arrow.conform(result, out, where)]


def run_to_tensor(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    columns = _str_tuple(pfunc, "columns")
    out = _output(pfunc, TensorType)
    table: pa.Table = args[0]
    where = f"party {runtime.rank}, mp.to_tensor"
    rows = out.shape[0] if out.shape else -1
    if table.num_rows != rows:
        raise TableError(
            f"{where}: the table has {table.num_rows} rows here, the program declared {rows}"
        )
    parts = []
    for name in columns:
        column = table.column(name)
        if column.null_count:
            raise TableError(
                f"{where}: column {name!r} holds {column.null_count} nulls; fill them in SQL "
                f"(COALESCE) first"
            )
        parts.append(column.to_numpy().astype(out.dtype.numpy, copy=False))
    if len(out.shape) == 1:
        return [parts[0]]
    stacked = np.stack(parts, axis=1) if parts else np.empty(out.shape, out.dtype.numpy)
    return [np.ascontiguousarray(stacked, dtype=out.dtype.numpy)]


def run_from_tensor(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    out = _output(pfunc, TableType)
    x = np.asarray(args[0])
    matrix = x.reshape(x.shape[0], -1)
    if matrix.shape[1] != len(out.columns):
        raise InvalidPFunctionError(
            f"{FROM_TENSOR}: {matrix.shape[1]} columns in the array, {len(out.columns)} named"
        )
    table = pa.table({name: pa.array(matrix[:, i]) for i, (name, _) in enumerate(out.columns)})
    return [arrow.conform(table, out, f"party {runtime.rank}, mp.from_tensor")]


def run_num_rows(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    if pfunc.outs_info != (ROWS_TYPE,):
        raise InvalidPFunctionError(f"{NUM_ROWS}: expected the output {ROWS_TYPE}")
    return [np.asarray(args[0].num_rows, dtype=np.int64)]


def run_with_rows(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    out = _output(pfunc, TableType)
    if out.rows is None or args[0].num_rows != out.rows:
        raise TableError(
            f"party {runtime.rank}, mp.with_rows: the table has {args[0].num_rows} rows here, "
            f"the program declared {out.rows}"
        )
    return [args[0]]
