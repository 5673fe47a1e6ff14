"""SQL at a party: one DuckDB query over Arrow tables, on a connection that cannot reach files,
extensions, settings, other Python objects or the network.

Each query gets a fresh in-memory connection with external access disabled, Python replacement
scans off, extension loading off, and the configuration locked: a query that tries any of those
gets an `SQLError`. The output schema is found by running the query on empty inputs.
"""

from __future__ import annotations

from collections.abc import Mapping

import duckdb
import pyarrow as pa

from mpplug.core import TableType
from mpplug.errors import SQLError
from mpplug.tables import arrow

LOCKED_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    "enable_external_access": False,
    "python_enable_replacements": False,
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "allow_community_extensions": False,
    "lock_configuration": True,
}
"""Every party connection's settings; `lock_configuration` comes last so it locks the rest."""

MAX_QUERY_CHARS = 1 << 20


def run(query: str, tables: Mapping[str, pa.Table], where: str) -> pa.Table:
    """The result of `query` over `tables` (each registered under its name)."""
    if not isinstance(query, str) or not query.strip() or len(query) > MAX_QUERY_CHARS:
        raise SQLError(f"{where}: expected a query of 1..{MAX_QUERY_CHARS} characters")
    con = duckdb.connect(":memory:", config=LOCKED_CONFIG)
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
