"""The wire codec for values: arrays <-> a `TensorType` header (dtype, shape) and raw bytes;
tables <-> a `uint8[n]` header carrying their schema and n bytes of Arrow IPC stream.

Decoding validates the dtype, the rank, the byte length, a size limit and (for a table) every
Arrow buffer and the schema; nothing is unpickled.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from mpplug.core import DType, TableType, TensorType, ValueType
from mpplug.core.serde import (
    table_schema_from_proto,
    table_schema_to_proto,
    tensor_type_from_proto,
    tensor_type_to_proto,
    value_type_from_proto,
)
from mpplug.errors import UnsupportedDTypeError, WireError
from mpplug.protos import values_pb2 as pb

DEFAULT_MAX_BYTES = 16 * 2**30


def is_table(value: Any) -> bool:
    """Whether `value` is a `pyarrow.Table` (without importing pyarrow for arrays)."""
    pa = sys.modules.get("pyarrow")
    return pa is not None and isinstance(value, pa.Table)


def encode(value: Any) -> tuple[pb.TensorType, np.ndarray[Any, Any]]:
    """A value's wire header and the host bytes that follow it: an array's own, or a table's
    Arrow IPC stream as a `uint8` array (its schema in the header's `table`)."""
    if is_table(value):
        from mpplug.tables import arrow

        data = np.frombuffer(arrow.to_ipc(value), dtype=np.uint8)
        header = encode_type(data)
        header.table.CopyFrom(table_schema_to_proto(arrow.table_type(value, "a table", rows=False)))
        return header, data
    array = as_host_array(value)
    return encode_type(array), array


def decode(msg: pb.TensorType, data: Any, where: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """A received value from its header and bytes: an array over the bytes (no copy), or a
    fully validated `pyarrow.Table`."""
    return finish(msg, from_buffer(decode_type(msg, where, max_bytes), data, where), where)


def finish(msg: pb.TensorType, array: np.ndarray[Any, Any], where: str) -> Any:
    """The value a received header and its bytes (already checked against each other) make:
    the array itself, or, when the header carries a table's schema, the validated table."""
    if not msg.HasField("table"):
        return array
    if array.dtype != np.uint8 or array.ndim != 1:
        raise WireError(f"{where}: a table travels as uint8[n] bytes, got {array.dtype}")
    from mpplug.tables import arrow

    try:
        return arrow.from_ipc(array, table_schema_from_proto(msg.table, f"{where}.table"), where)
    except ValueError as exc:  # a bad schema, or a TableError
        raise WireError(str(exc)) from None


def received_table(value: Any, expected: TableType, source: str) -> Any:
    """A table received from `source`, checked against the type the program declares."""
    from mpplug.tables import arrow

    if not is_table(value):
        raise WireError(f"received {TensorType.of(value)} from {source}, expected {expected}")
    try:
        return arrow.conform(value, expected, f"received from {source}")
    except ValueError as exc:
        raise WireError(str(exc)) from None


def payload_nbytes(value: Any) -> int:
    """The bytes a value takes: an array's, or a table's Arrow buffers."""
    return int(value.nbytes) if is_table(value) else int(np.asarray(value).nbytes)


def as_host_array(value: Any) -> np.ndarray[Any, Any]:
    """A C-contiguous little-endian numpy array of a supported dtype."""
    array = np.asarray(value)
    dtype = DType.from_any(array.dtype)
    return np.asarray(array, dtype=dtype.numpy, order="C")


def encode_type(array: np.ndarray[Any, Any]) -> pb.TensorType:
    return tensor_type_to_proto(TensorType(array.dtype, array.shape))


def decode_type(msg: pb.TensorType, where: str, max_bytes: int = DEFAULT_MAX_BYTES) -> TensorType:
    """Validate a received type: supported dtype, sane rank, size within `max_bytes`."""
    try:
        ttype = tensor_type_from_proto(msg, where)
    except (UnsupportedDTypeError, ValueError) as exc:
        raise WireError(str(exc)) from None
    if ttype.nbytes > max_bytes:
        raise WireError(f"{where}: {ttype} is {ttype.nbytes} bytes, over the limit of {max_bytes}")
    return ttype


def decode_declared_type(msg: pb.TensorType, where: str) -> ValueType:
    """A type a party declares (a dataset's): a tensor's, size-checked, or a table's."""
    if msg.HasField("table"):
        try:
            return value_type_from_proto(msg, where)
        except ValueError as exc:
            raise WireError(str(exc)) from None
    return decode_type(msg, where)


def from_buffer(ttype: TensorType, data: Any, where: str) -> np.ndarray[Any, Any]:
    """An array over `data` (no copy), after checking its length against the type."""
    if len(data) != ttype.nbytes:
        raise WireError(f"{where}: {ttype} needs {ttype.nbytes} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=ttype.dtype.numpy).reshape(ttype.shape)


@dataclass(frozen=True, slots=True)
class WireValue:
    """A value as it crosses a wire: its serialized `TensorType` and its raw bytes.

    Real parties stream exactly this (the header first, then the bytes in chunks); the
    simulator hands it over in memory.
    """

    header: bytes
    data: bytes | bytearray


def to_wire(value: Any) -> WireValue:
    """Encode a value: one copy of its bytes, into a buffer the receiver may write to."""
    header, array = encode(value)
    data = bytearray(array.nbytes)
    np.frombuffer(data, dtype=np.uint8)[:] = array.reshape(-1).view(np.uint8)
    return WireValue(header.SerializeToString(), data)


def from_wire(wire: WireValue, where: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Decode and validate a received value: an array over its bytes (no copy), or a table."""
    msg = pb.TensorType()
    try:
        msg.ParseFromString(wire.header)
    except DecodeError as exc:
        raise WireError(f"{where}: header does not decode as a TensorType: {exc}") from None
    return decode(msg, wire.data, where, max_bytes)
