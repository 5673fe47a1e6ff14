"""`TensorType`: the element type and static shape of one array.

Frozen and hashable; prints compactly as `f32[2,3]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mpplug.core.dtypes import DType
from mpplug.errors import UnsupportedDTypeError


@dataclass(frozen=True, slots=True)
class TensorType:
    """An array's dtype and static shape (every dimension a non-negative int)."""

    dtype: DType
    shape: tuple[int, ...]

    def __init__(self, dtype: Any, shape: Any = ()) -> None:
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"expected non-negative dimensions, got shape {dims}")
        object.__setattr__(self, "dtype", DType.from_any(dtype))
        object.__setattr__(self, "shape", dims)

    @classmethod
    def of(cls, value: Any) -> TensorType:
        """The type of anything with `.shape` and `.dtype`, or of a Python/numpy scalar."""
        if isinstance(value, TensorType):
            return value
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            return cls(value.dtype, value.shape)
        if isinstance(value, bool | int | float | complex):
            import numpy as np

            arr = np.asarray(value)
            return cls(arr.dtype, arr.shape)
        raise UnsupportedDTypeError(
            f"expected an array-like value with .shape and .dtype, got {type(value).__name__}"
        )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{self.dtype.value}[{','.join(map(str, self.shape))}]"

    def __repr__(self) -> str:
        return f"TensorType({self})"
