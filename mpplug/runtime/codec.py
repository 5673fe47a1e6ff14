"""The wire codec for values: arrays <-> a `TensorType` header (dtype, shape) and raw bytes.

Decoding validates the dtype, the rank, the byte length and a size limit; nothing is unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from mpplug.core import DType, TensorType
from mpplug.core.serde import tensor_type_from_proto, tensor_type_to_proto
from mpplug.errors import UnsupportedDTypeError, WireError
from mpplug.protos import values_pb2 as pb

DEFAULT_MAX_BYTES = 16 * 2**30


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
    array = as_host_array(value)
    data = bytearray(array.nbytes)
    np.frombuffer(data, dtype=np.uint8)[:] = array.reshape(-1).view(np.uint8)
    return WireValue(encode_type(array).SerializeToString(), data)


def from_wire(wire: WireValue, where: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Decode and validate a received value: an array over its bytes (no copy)."""
    msg = pb.TensorType()
    try:
        msg.ParseFromString(wire.header)
    except DecodeError as exc:
        raise WireError(f"{where}: header does not decode as a TensorType: {exc}") from None
    return from_buffer(decode_type(msg, where, max_bytes), wire.data, where)
