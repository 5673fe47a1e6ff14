"""The kernels of ECDH private set intersection (`psi.*`): blind a table's keys, blind a
peer's points again, match the twice-blinded sets at the hub, and select the matched rows.

Protocol (Huberman, Franklin, Hogg, ACM EC 1999; semi-honest), with the first party as hub
h and each other party j, scalars a_h and a_j fresh per execution:

1. every party hashes its keys to points, shuffles them and blinds them: U = a·H(k);
2. h sends U_h to each j; j sends U_j to h and W_j = T(a_j·U_h) back (T: the first 12 bytes);
3. h computes Z_j = T(a_h·U_j): its row r is shared with j exactly when W_j[r] is in Z_j;
4. h keeps the rows shared with every j, orders them by W_1 (pseudorandom, so the order says
   nothing about keys), and sends each j the positions of those rows in U_j's order; every
   party takes its matching rows in that common order.

Bytes per key: j sends 32 + 12, h sends 32 per other party, then 8 per intersecting row.
What each learns: j, the intersection (its output) and the sizes of the inputs; h, that and,
with three or more parties, which of its rows each other party holds.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mpplug.core import DType, PFunction, TableType, TensorType
from mpplug.errors import InvalidPFunctionError, PSIError
from mpplug.kernels.runtime import KernelRuntime
from mpplug.tables import ecdh

BLIND = "psi.blind"
REBLIND = "psi.reblind"
MATCH = "psi.match"
SELECT = "psi.select"

DOMAIN = b"mpplug.psi.ecdh-x25519.v1"
COMPARE_BYTES = 12
"""Bytes of a twice-blinded point compared (96 bits, as SPU's kFinalCompareBytes): a false
match among n keys has probability about n^2 / 2^97."""
SCALAR_TYPE = TensorType(DType.UINT64, (4,))
POSITIONS = TableType([("row", "i64")])
KEY_KINDS = {
    "str": b"s",
    **{k: b"i" for k in ("i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64")},
}


def points_type(rows: int, width: int = ecdh.POINT_BYTES) -> TensorType:
    return TensorType(DType.UINT8, (rows, width))


def blind_pfunction(table: TableType, key: str) -> PFunction:
    """(table, scalar) -> (its keys' points blinded, shuffled; the shuffle as row indices)."""
    assert table.rows is not None
    outs = (points_type(table.rows), TensorType(DType.INT64, (table.rows,)))
    return PFunction(BLIND, "blind", b"", (table, SCALAR_TYPE), outs, {"key": key})


def reblind_pfunction(rows: int) -> PFunction:
    """(points, scalar) -> the points blinded again, cut to COMPARE_BYTES."""
    return PFunction(
        REBLIND,
        "reblind",
        b"",
        (points_type(rows), SCALAR_TYPE),
        (points_type(rows, COMPARE_BYTES),),
    )


def match_pfunction(hub_rows: int, rows: Sequence[int]) -> PFunction:
    """(W_j for each j, then Z_j for each j) -> positions of the intersection, in one common
    order: into the hub's shuffled rows, then into each j's."""
    ins = [points_type(hub_rows, COMPARE_BYTES)] * len(rows)
    ins += [points_type(n, COMPARE_BYTES) for n in rows]
    return PFunction(MATCH, "match", b"", tuple(ins), (POSITIONS,) * (len(rows) + 1))


def select_pfunction(table: TableType) -> PFunction:
    """(table, shuffle, positions) -> the table's rows at those shuffled positions."""
    assert table.rows is not None
    ins = (table, TensorType(DType.INT64, (table.rows,)), POSITIONS)
    return PFunction(SELECT, "select", b"", ins, (table.with_rows(None),))


def key_bytes(column: pa.ChunkedArray, kind: str, where: str) -> list[bytes]:
    """Each key as bytes: its kind's tag (text or integer), then its UTF-8 or decimal text, so
    an integer key matches across integer widths; nulls and duplicates are refused."""
    if column.null_count:
        raise PSIError(f"{where}: the key column holds nulls ({column.null_count})")
    if pc.count_distinct(column).as_py() != len(column):
        raise PSIError(f"{where}: the key column holds duplicates; PSI takes distinct keys")
    tag = KEY_KINDS[kind]
    return [tag + text.encode() for text in column.cast(pa.string()).to_pylist()]


def _scalar(value: Any) -> np.ndarray:
    return np.ascontiguousarray(value, dtype="<u8").view(np.uint8)


def run_blind(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    table, scalar = args
    key = pfunc.attrs.get("key")
    ttype = pfunc.ins_info[0]
    if (
        not isinstance(key, str)
        or not isinstance(ttype, TableType)
        or ttype.kind(key) not in KEY_KINDS
    ):
        raise InvalidPFunctionError(f"{BLIND}: expected a str or integer key column attribute")
    where = f"party {runtime.rank}, mp.psi key {key!r}"
    keys = key_bytes(table.column(key), ttype.kind(key), where)
    order = np.argsort(np.frombuffer(secrets.token_bytes(8 * len(keys)), dtype=np.uint64))
    points = ecdh.hash_to_points([keys[i] for i in order], DOMAIN)
    return [ecdh.multiply(points, _scalar(scalar)), order.astype(np.int64)]


def run_reblind(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    points, scalar = args
    try:
        blinded = ecdh.multiply(np.asarray(points), _scalar(scalar))
    except ValueError as exc:
        raise PSIError(f"party {runtime.rank}, mp.psi: {exc}") from None
    return [np.ascontiguousarray(blinded[:, :COMPARE_BYTES])]


_COMPARED = np.dtype([("high", ">u8"), ("low", ">u4")])


def _compared(values: Any) -> np.ndarray:
    """Twice-blinded points as sortable records (their 12 bytes, big-endian: byte order)."""
    return np.ascontiguousarray(values).view(_COMPARED).reshape(-1)


def _repeats(values: np.ndarray) -> bool:
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def _matches(w: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions (in w, in z) of the records both hold, the records of each side distinct:
    matched on the first 8 bytes as one uint64 (a fast sort), then the last 4 compared; if two
    records of one side share their first 8 bytes (about n^2 / 2^65), on all 12 instead."""
    high_w, high_z = w["high"].astype(np.uint64), z["high"].astype(np.uint64)
    _, in_w, in_z = np.intersect1d(high_w, high_z, assume_unique=True, return_indices=True)
    if _repeats(high_w) or _repeats(high_z):
        _, in_w, in_z = np.intersect1d(w, z, assume_unique=True, return_indices=True)
        return in_w, in_z
    same = w["low"][in_w] == z["low"][in_z]
    return in_w[same], in_z[same]


def run_match(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    others = len(args) // 2
    if others < 1 or len(args) != 2 * others:
        raise InvalidPFunctionError(f"{MATCH}: expected W_j and Z_j for each other party")
    w = [_compared(v) for v in args[:others]]
    z = [_compared(v) for v in args[others:]]
    at_peer = []  # for each j: hub position -> position in U_j, or -1
    for w_j, z_j in zip(w, z, strict=True):
        in_w, in_z = _matches(w_j, z_j)
        found = np.full(len(w_j), -1, dtype=np.int64)
        found[in_w] = in_z
        at_peer.append(found)
    kept = np.flatnonzero(np.all([found >= 0 for found in at_peer], axis=0))
    first = w[0][kept]
    kept = kept[np.lexsort((first["low"], first["high"]))]  # the common order: by W_1
    tables = [kept, *(found[kept] for found in at_peer)]
    return [pa.table({"row": pa.array(t.astype(np.int64))}) for t in tables]


def run_select(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    table, order, positions = args
    rows = positions.column("row").to_numpy()
    if len(rows) and (rows.min() < 0 or rows.max() >= len(order)):
        raise PSIError(
            f"party {runtime.rank}, mp.psi: positions must lie in 0..{len(order) - 1}, got "
            f"{rows.min()}..{rows.max()}"
        )
    return [table.take(pa.array(np.asarray(order)[rows]))]
