"""The closed set of element types mpplug moves and computes on.

`DType` converts to and from numpy, JAX and protobuf dtypes; anything else is refused.
"""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np

from mpplug.errors import UnsupportedDTypeError


class DType(enum.Enum):
    """A supported element type; the value is its canonical short name."""

    BOOL = "bool"
    INT8 = "i8"
    INT16 = "i16"
    INT32 = "i32"
    INT64 = "i64"
    UINT8 = "u8"
    UINT16 = "u16"
    UINT32 = "u32"
    UINT64 = "u64"
    FLOAT16 = "f16"
    BFLOAT16 = "bf16"
    FLOAT32 = "f32"
    FLOAT64 = "f64"
    COMPLEX64 = "c64"
    COMPLEX128 = "c128"

    _numpy: np.dtype[Any]  # set on each member below; an attribute keeps `numpy` cheap

    @property
    def numpy(self) -> np.dtype[Any]:
        """The numpy dtype (bfloat16 through ml_dtypes), always little-endian."""
        return self._numpy

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def is_64bit(self) -> bool:
        """Whether JAX needs 64-bit mode to keep this type."""
        return self in (DType.INT64, DType.UINT64, DType.FLOAT64, DType.COMPLEX128)

    @property
    def proto(self) -> int:
        """The enum number in `mpplug.protos.values.DType` (declaration order, from 1)."""
        return _MEMBERS.index(self) + 1

    @classmethod
    def from_proto(cls, number: int) -> DType:
        if not 1 <= number <= len(_MEMBERS):
            raise UnsupportedDTypeError(
                f"expected a DType enum number in 1..{len(_MEMBERS)}, got {number}"
            )
        return _MEMBERS[number - 1]

    @classmethod
    def from_any(cls, dtype: Any) -> DType:
        """Convert a DType, numpy/JAX dtype, scalar type or name such as 'float32'."""
        if isinstance(dtype, DType):
            return dtype
        if isinstance(dtype, str) and dtype in _BY_SHORT_NAME:
            return _BY_SHORT_NAME[dtype]
        if dtype is None:  # np.dtype(None) would silently mean float64
            raise UnsupportedDTypeError("expected a supported dtype, got None")
        try:
            np_dtype = np.dtype(dtype)
        except (TypeError, ValueError) as exc:
            raise UnsupportedDTypeError(f"expected a supported dtype, got {dtype!r}") from exc
        found = _FROM_NUMPY.get(np_dtype)
        if found is None:
            supported = ", ".join(d.numpy.name for d in _MEMBERS)
            raise UnsupportedDTypeError(
                f"expected one of {supported}; got dtype {np_dtype!s} ({np_dtype.str})"
            )
        return found

    def __str__(self) -> str:
        return self.value


_MEMBERS: tuple[DType, ...] = tuple(DType)
_TO_NUMPY: dict[DType, np.dtype[Any]] = {
    DType.BOOL: np.dtype(np.bool_),
    DType.INT8: np.dtype("<i1"),
    DType.INT16: np.dtype("<i2"),
    DType.INT32: np.dtype("<i4"),
    DType.INT64: np.dtype("<i8"),
    DType.UINT8: np.dtype("<u1"),
    DType.UINT16: np.dtype("<u2"),
    DType.UINT32: np.dtype("<u4"),
    DType.UINT64: np.dtype("<u8"),
    DType.FLOAT16: np.dtype("<f2"),
    DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DType.FLOAT32: np.dtype("<f4"),
    DType.FLOAT64: np.dtype("<f8"),
    DType.COMPLEX64: np.dtype("<c8"),
    DType.COMPLEX128: np.dtype("<c16"),
}
_FROM_NUMPY: dict[np.dtype[Any], DType] = {dt: d for d, dt in _TO_NUMPY.items()}
for _member, _np_dtype in _TO_NUMPY.items():
    _member._numpy = _np_dtype
_BY_SHORT_NAME: dict[str, DType] = {d.value: d for d in _MEMBERS}
