"""Tables in programs: `mp.sql`, `mp.to_tensor`, `mp.from_tensor`, `mp.num_rows` and
`mp.psi`, each a call of a `table.*` or `psi.*` kernel at the party holding the table.

The driver learns tables' schemas (and row counts where the program knows them), never rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from mpplug.core import DType, TableType, TensorType
from mpplug.core.parties import format_parties
from mpplug.errors import TableError, TraceError
from mpplug.frontend.primitives import Party, _call, p2p, prand
from mpplug.frontend.tracer import GraphBuilder, TracedValue, current_builder

_IDENTIFIER = "a letter or '_' then letters, digits or '_'"


def _table(builder: GraphBuilder, x: Any, where: str) -> TracedValue:
    value = builder.value(x, where)
    if not isinstance(value.type, TableType):
        raise TraceError(f"{where}: expected a table, got {value.type}")
    return value


def _holder(value: TracedValue, where: str) -> int:
    if len(value.parties) != 1:
        raise TraceError(
            f"{where}: a table is held by one party, this one by {format_parties(value.parties)}"
        )
    return next(iter(value.parties))


def sql(party: Party, query: str, *, schema: TableType | None = None, **tables: Any) -> TracedValue:
    """Run a DuckDB `query` at `party` over the tables it holds, each named by its keyword:
    `mp.sql("alice", "SELECT id, x FROM t WHERE x > 0", t=table)`. The result's columns are
    found while tracing (DuckDB runs the query on empty inputs) or given as `schema=`; its row
    count is decided at the party and never told to the driver."""
    builder = current_builder("sql")
    where = f"mp.sql({party!r}, ...)"
    rank = builder.resolve_party(party, where)
    if not tables:
        raise TraceError(f"{where}: name at least one table: mp.sql(party, query, t=table)")
    values = []
    for name, x in tables.items():
        if not name.isidentifier():
            raise TraceError(f"{where}: table name {name!r} must be {_IDENTIFIER}")
        value = _table(builder, x, f"{where} table {name!r}")
        if rank not in value.parties:
            raise TraceError(
                f"{where}: table {name!r} is held by {format_parties(value.parties)}, not by "
                f"party {rank}"
            )
        values.append(value)
    ins = [cast(TableType, v.type) for v in values]
    if schema is None:
        from mpplug.tables import sql as duck

        try:
            out = duck.result_type(query, dict(zip(tables, ins, strict=True)), where)
        except TableError as exc:  # SQLError too
            raise TraceError(str(exc)) from None
    elif isinstance(schema, TableType):
        out = schema.with_rows(None)
    else:
        raise TraceError(f"{where}: schema= takes a TableType, got {type(schema).__name__}")
    from mpplug.tables import kernels

    pfunc = kernels.sql_pfunction(query, list(tables), ins, out)
    return _call(builder, pfunc, values, frozenset({rank}))[0]


def to_tensor(
    table: Any,
    columns: str | Sequence[str] | None = None,
    *,
    dtype: Any = "float32",
    rows: int | None = None,
) -> TracedValue:
    """The table's numeric `columns` as an array of `dtype` at its party: (rows, columns), or
    (rows,) for one column named as a str. A shape must be known while tracing: the table's
    row count if the program knows it, else `rows=` (a count revealed earlier, for example by
    fetching `mp.num_rows(table)`); the party checks it."""
    builder = current_builder("to_tensor")
    where = "mp.to_tensor(table)"
    value = _table(builder, table, where)
    ttype: TableType = value.type  # type: ignore[assignment]
    names = (
        list(ttype.names)
        if columns is None
        else [columns]
        if isinstance(columns, str)
        else list(columns)
    )
    for name in names:
        try:
            kind = ttype.kind(name)
        except KeyError as exc:
            raise TraceError(f"{where}: {exc.args[0]}") from None
        if kind == "str":
            raise TraceError(f"{where}: column {name!r} holds text; select numeric columns")
    count = ttype.rows if rows is None else rows
    if count is None:
        raise TraceError(
            f"{where}: the program does not know the table's row count ({ttype}); give rows= "
            f"(reveal it first with mp.num_rows)"
        )
    if ttype.rows is not None and count != ttype.rows:
        raise TraceError(f"{where}: rows={rows}, but the table has {ttype.rows}")
    shape = (count,) if isinstance(columns, str) else (count, len(names))
    try:
        out = TensorType(DType.from_any(dtype), shape)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: {exc}") from None
    from mpplug.tables import kernels

    pfunc = kernels.to_tensor_pfunction(ttype, names, out)
    return _call(builder, pfunc, [value], value.parties)[0]


def from_tensor(x: Any, names: Sequence[str]) -> TracedValue:
    """A table at the party holding `x`, an array of shape (rows,) or (rows, len(names)),
    with one column per name; its row count is known."""
    builder = current_builder("from_tensor")
    where = "mp.from_tensor(x, names)"
    value = builder.value(x, where)
    ttype = value.type
    if not isinstance(ttype, TensorType) or ttype.ndim not in (1, 2):
        raise TraceError(f"{where}: expected an array of rank 1 or 2, got {ttype}")
    width = 1 if ttype.ndim == 1 else ttype.shape[1]
    if isinstance(names, str) or len(names) != width:
        raise TraceError(f"{where}: expected {width} column names, got {names!r}")
    kind = ttype.dtype.value
    if ttype.dtype in (DType.FLOAT16, DType.BFLOAT16, DType.COMPLEX64, DType.COMPLEX128):
        raise TraceError(f"{where}: a table column cannot hold {kind}; cast to float32 first")
    try:
        out = TableType([(n, kind) for n in names], ttype.shape[0])
    except ValueError as exc:
        raise TraceError(f"{where}: {exc}") from None
    from mpplug.tables import kernels

    return _call(builder, kernels.from_tensor_pfunction(ttype, out), [value], value.parties)[0]


def num_rows(table: Any) -> TracedValue:
    """The table's row count, an int64[] at its party: fetching or moving it is what reveals
    it."""
    builder = current_builder("num_rows")
    value = _table(builder, table, "mp.num_rows(table)")
    from mpplug.tables import kernels

    pfunc = kernels.num_rows_pfunction(value.type)  # type: ignore[arg-type]
    return _call(builder, pfunc, [value], value.parties)[0]


def with_rows(table: Any, rows: int) -> TracedValue:
    """The table, typed with `rows` rows: a count revealed earlier (by fetching
    `mp.num_rows`), declared so that what needs a known count (`mp.psi`, `mp.to_tensor`)
    takes the table. The party checks it."""
    builder = current_builder("with_rows")
    where = f"mp.with_rows(table, {rows!r})"
    value = _table(builder, table, where)
    ttype = cast(TableType, value.type)
    if isinstance(rows, bool) or not isinstance(rows, int | np.integer) or rows < 0:
        raise TraceError(f"{where}: expected a non-negative row count")
    if ttype.rows is not None and ttype.rows != rows:
        raise TraceError(f"{where}: the program knows the table has {ttype.rows} rows")
    from mpplug.tables import kernels

    pfunc = kernels.with_rows_pfunction(ttype, int(rows))
    return _call(builder, pfunc, [value], value.parties)[0]


def psi(
    *tables: Any, key: str = "id", to: Sequence[Party] | None = None
) -> list[TracedValue | None]:
    """Private set intersection (ECDH over Curve25519) of tables held by two or more
    different parties: one table per input, at its party, holding only the rows whose `key`
    (a text or integer column) every party has, in one order common to all.

    `to` names the parties that learn the result (default: all). The first table's party,
    the protocol's hub, always does; a party left out gets None in its place and is sent
    nothing after the blinded points, so it learns no more than the other set's size."""
    builder = current_builder("psi")
    where = f"mp.psi(..., key={key!r})"
    if len(tables) < 2:
        raise TraceError(f"{where}: expected tables of two or more parties, got {len(tables)}")
    values = [_table(builder, t, f"{where} table {i}") for i, t in enumerate(tables)]
    ranks = [_holder(v, f"{where} table {i}") for i, v in enumerate(values)]
    if len(set(ranks)) != len(ranks):
        raise TraceError(f"{where}: each table must be at a different party, got {ranks}")
    learners = frozenset(ranks) if to is None else builder.resolve_parties(list(to), where)
    if ranks[0] not in learners or not learners <= set(ranks):
        raise TraceError(
            f"{where}: to= names parties holding the tables, the first (the hub, {ranks[0]}) "
            f"among them; got {format_parties(learners)}"
        )
    from mpplug.tables import psi as protocol

    types: list[TableType] = []
    rows: list[int] = []
    families = set()
    for i, v in enumerate(values):
        ttype = cast(TableType, v.type)
        try:
            kind = ttype.kind(key)
        except KeyError as exc:
            raise TraceError(f"{where} table {i}: {exc.args[0]}") from None
        if kind not in protocol.KEY_KINDS:
            raise TraceError(f"{where} table {i}: key {key!r} is {kind}; expected text or integers")
        if ttype.rows is None:
            raise TraceError(
                f"{where} table {i}: the program does not know its row count ({ttype}); "
                f"reveal it (mp.num_rows) and declare it with mp.with_rows"
            )
        families.add(protocol.KEY_KINDS[kind])
        types.append(ttype)
        rows.append(ttype.rows)
    if len(families) != 1:
        raise TraceError(f"{where}: the key columns mix text and integers; cast them to one kind")
    scalars, points, orders = [], [], []
    for v, ttype, rank in zip(values, types, ranks, strict=True):
        scalar = prand((4,), parties=[rank], dtype="uint64")
        blind = protocol.blind_pfunction(ttype, key)
        blinded, order = _call(builder, blind, [v, scalar], frozenset({rank}))
        scalars.append(scalar)
        points.append(blinded)
        orders.append(order)
    hub, peers = ranks[0], range(1, len(values))
    # every blinded set moves before any is blinded again, so the hub's and the peers'
    # second blindings run at the same time
    hub_points_at = {j: p2p(hub, ranks[j], points[0]) for j in peers}
    points_at_hub = {j: p2p(ranks[j], hub, points[j]) for j in peers}
    seen_by_peers, seen_by_hub = [], []
    for j in peers:
        at_peer = [hub_points_at[j], scalars[j]]
        twice = _call(builder, protocol.reblind_pfunction(rows[0]), at_peer, frozenset({ranks[j]}))
        seen_by_peers.append(p2p(ranks[j], hub, twice[0]))
        at_hub = [points_at_hub[j], scalars[0]]
        seen_by_hub += _call(builder, protocol.reblind_pfunction(rows[j]), at_hub, frozenset({hub}))
    match = protocol.match_pfunction(rows[0], rows[1:])
    positions = _call(builder, match, [*seen_by_peers, *seen_by_hub], frozenset({hub}))
    outputs: list[TracedValue | None] = []
    for j, (v, ttype, rank) in enumerate(zip(values, types, ranks, strict=True)):
        if rank not in learners:
            outputs.append(None)
            continue
        at = positions[0] if j == 0 else p2p(hub, rank, positions[j])
        select = protocol.select_pfunction(ttype)
        outputs.append(_call(builder, select, [v, orders[j], at], frozenset({rank}))[0])
    return outputs
