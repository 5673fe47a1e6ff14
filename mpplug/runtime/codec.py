"""The wire codec for values: arrays <-> protobuf `Tensor` (dtype, shape, raw bytes).

Decoding validates the dtype, the rank, the byte length and a size limit; nothing is unpickled.
"""

from __future__ import annotations

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


def encode(value: Any) -> pb.Tensor:
    array = as_host_array(value)
    return pb.Tensor(type=encode_type(array), data=array.tobytes())


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


def decode(msg: pb.Tensor, where: str = "tensor", max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    if not msg.HasField("type"):
        raise WireError(f"{where}: tensor has no type")
    return from_buffer(decode_type(msg.type, where, max_bytes), msg.data, where)


def to_bytes(value: Any) -> bytes:
    return encode(value).SerializeToString()


def from_bytes(data: bytes, where: str = "tensor", max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    msg = pb.Tensor()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise WireError(f"{where}: bytes do not decode as a Tensor: {exc}") from None
    return decode(msg, where, max_bytes)
