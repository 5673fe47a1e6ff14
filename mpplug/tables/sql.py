"""SQL at a party: one DuckDB query over Arrow tables, on a connection that cannot reach files,
extensions, settings, other Python objects or the network.

Each query gets a fresh in-memory connection with no temporary folder (DuckDB would otherwise
let queries reach it), external access disabled, Python replacement scans off, extension
loading off, and the configuration locked: a query that tries any of those gets an `SQLError`.
Without a temporary folder nothing spills to disk: a query must fit in memory. The output
schema is found by running the query on empty inputs.
"""

from __future__ import annotations

from collections.abc import Mapping

import duckdb
import pyarrow as pa

from mpplug.core import TableType
from mpplug.errors import SQLError
from mpplug.tables import arrow

LOCKED_SETTINGS = (
    ("enable_external_access", "false"),
    ("python_enable_replacements", "false"),
    ("autoload_known_extensions", "false"),
    ("autoinstall_known_extensions", "false"),
    ("allow_community_extensions", "false"),
    ("lock_configuration", "true"),
)
"""Set on every connection in this order, after `temp_directory` is emptied at connect (it
cannot be changed once external access is off); `lock_configuration` last locks the rest."""


def connect() -> duckdb.DuckDBPyConnection:
    """A fresh in-memory DuckDB connection that reaches nothing outside its own tables."""
    con = duckdb.connect(":memory:", config={"temp_directory": ""})
    for name, value in LOCKED_SETTINGS:
        con.execute(f"SET {name} = {value}")
    return con


MAX_QUERY_CHARS = 1 << 20


def run(query: str, tables: Mapping[str, pa.Table], where: str) -> pa.Table:
    """The result of `query` over `tables` (each registered under its name)."""
    if not isinstance(query, str) or not query.strip() or len(query) > MAX_QUERY_CHARS:
        raise SQLError(f"{where}: expected a query of 1..{MAX_QUERY_CHARS} characters")
    con = connect()
    try:
        for name, table in tables.items():
            con.register(name, table)
        try:
            relation = con.sql(query)
            result = None if relation is None else relation.to_arrow_table()
        except duckdb.Error as exc:
            raise SQLError(f"{where}: DuckDB refused the query: {exc}") from None
    finally:
        con.close()
    if result is None:
        raise SQLError(f"{where}: expected a query that returns rows (its last statement)")
    return result


def result_type(query: str, inputs: Mapping[str, TableType], where: str) -> TableType:
    """The columns `query` returns over tables of the `inputs` types (rows: unknown)."""
    empty = {
        name: arrow.arrow_schema(ttype.with_rows(None)).empty_table()
        for name, ttype in inputs.items()
    }
    return arrow.table_type(run(query, empty, where), where, rows=False)
