"""Value types: `TensorType` (an array's dtype and static shape) and `TableType` (a table's
columns and, when known, its row count). Frozen and hashable; they print as `f32[2,3]` and
`table[id:str, x:f64; ?]`.
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


COLUMN_KINDS = ("bool", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64", "f32", "f64", "str")
"""What a table column may hold: a supported numeric dtype's short name, or UTF-8 text."""

MAX_COLUMNS = 4096


@dataclass(frozen=True, slots=True)
class TableType:
    """A table held by a party: its columns (name, kind) in order, and its row count when the
    program knows it (`rows=None`: decided at run time and never told to the driver)."""

    columns: tuple[tuple[str, str], ...]
    rows: int | None = None

    def __init__(self, columns: Any, rows: int | None = None) -> None:
        cols = tuple((str(name), str(kind)) for name, kind in columns)
        if not cols or len(cols) > MAX_COLUMNS:
            raise ValueError(f"expected 1..{MAX_COLUMNS} columns, got {len(cols)}")
        names = [name for name, _ in cols]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"expected distinct non-empty column names, got {names}")
        for name, kind in cols:
            if kind not in COLUMN_KINDS:
                kinds = ", ".join(COLUMN_KINDS)
                raise ValueError(f"column {name!r}: expected a kind among {kinds}, got {kind!r}")
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
            raise ValueError(f"expected a non-negative row count or None, got {rows!r}")
        object.__setattr__(self, "columns", cols)
        object.__setattr__(self, "rows", rows)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.columns)

    def kind(self, name: str) -> str:
        """The kind of column `name`; a KeyError naming the columns if there is none."""
        for column, kind in self.columns:
            if column == name:
                return kind
        raise KeyError(f"no column {name!r}; the table has {', '.join(self.names)}")

    def with_rows(self, rows: int | None) -> TableType:
        return TableType(self.columns, rows)

    def __str__(self) -> str:
        body = ", ".join(f"{name}:{kind}" for name, kind in self.columns)
        return f"table[{body}; {'?' if self.rows is None else self.rows}]"

    def __repr__(self) -> str:
        return f"TableType({self})"


ValueType = TensorType | TableType
"""The type of any value a program moves: an array or a table."""
