"""`MPObject`: a value that lives at a set of parties, known by its type and holders.

Tracing and clusters subclass it; a bare MPObject is a placeholder for compiling programs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mpplug.core.dtypes import DType
from mpplug.core.parties import PartySet, format_parties
from mpplug.core.types import TableType, TensorType, ValueType


class MPObject:
    """A party value: the same type (a `TensorType`, or a `TableType`) at each party in
    `parties`."""

    __slots__ = ("parties", "type")

    def __init__(self, type: Any, parties: int | Iterable[int]) -> None:
        self.type: ValueType = (
            type if isinstance(type, TensorType | TableType) else TensorType.of(type)
        )
        ranks = (parties,) if isinstance(parties, int) else tuple(parties)
        if not ranks:
            raise ValueError("an MPObject must be held by at least one party")
        self.parties: PartySet = frozenset(ranks)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._tensor_type("shape").shape

    @property
    def dtype(self) -> DType:
        return self._tensor_type("dtype").dtype

    def _tensor_type(self, what: str) -> TensorType:
        if isinstance(self.type, TableType):
            raise AttributeError(f"a table has no {what}; its type is {self.type}")
        return self.type

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.type} @ {format_parties(self.parties)})"
