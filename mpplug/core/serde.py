"""Protobuf conversion for the core records: value types, Attrs and PFunction.

Decoding validates everything and raises typed errors that say what is wrong and where.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from google.protobuf.message import DecodeError

from mpplug.core.attrs import Attrs, AttrValue
from mpplug.core.dtypes import DType
from mpplug.core.pfunction import PFunction
from mpplug.core.types import COLUMN_KINDS, MAX_COLUMNS, TableType, TensorType, ValueType
from mpplug.errors import InvalidPFunctionError, UnsupportedDTypeError
from mpplug.protos import values_pb2 as pb

MAX_RANK = 32

MAX_EXTENT_BYTES = 2**63 - 1
"""The most bytes a declared shape may span, zero-size dimensions counted as 1: numpy (and so
every kernel) refuses shapes beyond it, even empty ones, so a wire type must stay within it."""


def tensor_type_to_proto(t: TensorType) -> pb.TensorType:
    return pb.TensorType(dtype=t.dtype.proto, shape=t.shape)  # type: ignore[arg-type]


def tensor_type_from_proto(msg: pb.TensorType, where: str) -> TensorType:
    """Decode a TensorType; `where` names the field for error messages."""
    try:
        return _tensor_type(msg.dtype, tuple(msg.shape))
    except UnsupportedDTypeError as exc:
        raise UnsupportedDTypeError(f"{where}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


@functools.lru_cache(maxsize=4096)
def _tensor_type(dtype_code: int, shape: tuple[int, ...]) -> TensorType:
    """The checked type of a dtype code and shape, made once (a program's thousands of values
    have few distinct types); what is wrong raises, and is not cached."""
    dtype = DType.from_proto(dtype_code)
    if len(shape) > MAX_RANK:
        raise ValueError(f"expected rank <= {MAX_RANK}, got {len(shape)}")
    if any(d < 0 for d in shape):
        raise ValueError(f"expected non-negative dimensions, got {list(shape)}")
    extent = dtype.itemsize
    for dim in shape:
        extent *= max(dim, 1)
        if extent > MAX_EXTENT_BYTES:
            raise ValueError(
                f"shape {list(shape)} of {dtype.value} spans over 2^63 bytes "
                f"(zero-size dimensions counted as 1), over the limit of any array"
            )
    return TensorType(dtype, shape)


def table_schema_to_proto(t: TableType) -> pb.TableSchema:
    return pb.TableSchema(
        columns=[pb.TableColumn(name=name, kind=kind) for name, kind in t.columns],
        rows=-1 if t.rows is None else t.rows,
    )


def table_schema_from_proto(msg: pb.TableSchema, where: str) -> TableType:
    """Decode a table's schema; a ValueError says what is wrong and where."""
    if not 1 <= len(msg.columns) <= MAX_COLUMNS:
        raise ValueError(f"{where}: expected 1..{MAX_COLUMNS} columns, got {len(msg.columns)}")
    for i, column in enumerate(msg.columns):
        if column.kind not in COLUMN_KINDS or not column.name or len(column.name) > 256:
            raise ValueError(
                f"{where}.columns[{i}]: expected a name of 1..256 characters and a kind among "
                f"{', '.join(COLUMN_KINDS)}, got {column.name[:64]!r} of kind {column.kind[:64]!r}"
            )
    if msg.rows < -1:
        raise ValueError(f"{where}.rows: expected a row count or -1 (unknown), got {msg.rows}")
    try:
        return TableType(
            [(c.name, c.kind) for c in msg.columns], None if msg.rows == -1 else msg.rows
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def value_type_to_proto(t: ValueType) -> pb.TensorType:
    """A tensor's type, or a table's (its schema in `table`, no dtype or shape)."""
    if isinstance(t, TableType):
        return pb.TensorType(table=table_schema_to_proto(t))
    return tensor_type_to_proto(t)


def value_type_from_proto(msg: pb.TensorType, where: str) -> ValueType:
    if msg.HasField("table"):
        if msg.dtype or msg.shape:
            raise ValueError(f"{where}: a table's type has no dtype or shape")
        return table_schema_from_proto(msg.table, f"{where}.table")
    return tensor_type_from_proto(msg, where)


def _attr_value_to_proto(value: AttrValue) -> pb.AttrValue:
    if isinstance(value, bool):
        return pb.AttrValue(b=value)
    if isinstance(value, int):
        return pb.AttrValue(i=value)
    if isinstance(value, float):
        return pb.AttrValue(f=value)
    if isinstance(value, str):
        return pb.AttrValue(s=value)
    if isinstance(value, bytes):
        return pb.AttrValue(raw=value)
    return pb.AttrValue(list=pb.AttrList(items=[_attr_value_to_proto(v) for v in value]))


def _attr_value_from_proto(msg: pb.AttrValue, where: str) -> AttrValue:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidPFunctionError(f"{where}: attr value has no kind set")
    if kind == "list":
        return tuple(
            _attr_value_from_proto(v, f"{where}[{i}]") for i, v in enumerate(msg.list.items)
        )
    value: AttrValue = getattr(msg, kind)
    return value


def attrs_to_proto(attrs: Attrs) -> list[pb.Attr]:
    return [pb.Attr(key=k, value=_attr_value_to_proto(v)) for k, v in attrs.items()]


def attrs_from_proto(items: Iterable[pb.Attr], where: str) -> Attrs:
    decoded: dict[str, AttrValue] = {}
    for item in items:
        if item.key in decoded:
            raise InvalidPFunctionError(f"{where}: duplicate attr key {item.key!r}")
        decoded[item.key] = _attr_value_from_proto(item.value, f"{where}[{item.key!r}]")
    return Attrs(decoded)


def pfunction_to_proto(pf: PFunction) -> pb.PFunction:
    return pb.PFunction(
        fn_type=pf.fn_type,
        fn_name=pf.fn_name,
        fn_body=pf.fn_body,
        ins_info=[value_type_to_proto(t) for t in pf.ins_info],
        outs_info=[value_type_to_proto(t) for t in pf.outs_info],
        attrs=attrs_to_proto(pf.attrs),
    )


def pfunction_from_proto(msg: pb.PFunction, where: str = "PFunction") -> PFunction:
    try:
        ins = tuple(
            value_type_from_proto(t, f"{where}.ins_info[{i}]") for i, t in enumerate(msg.ins_info)
        )
        outs = tuple(
            value_type_from_proto(t, f"{where}.outs_info[{i}]") for i, t in enumerate(msg.outs_info)
        )
    except (UnsupportedDTypeError, ValueError) as exc:
        raise InvalidPFunctionError(str(exc)) from None
    return PFunction(
        msg.fn_type, msg.fn_name, msg.fn_body, ins, outs, attrs_from_proto(msg.attrs, where)
    )


def pfunction_from_bytes(data: bytes) -> PFunction:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidPFunctionError(f"expected PFunction bytes, got {type(data).__name__}")
    msg = pb.PFunction()
    try:
        msg.ParseFromString(bytes(data))
    except DecodeError as exc:
        raise InvalidPFunctionError(
            f"bytes ({len(data)}) do not decode as a PFunction: {exc}"
        ) from None
    return pfunction_from_proto(msg)
