"""`MPObject`: a value that lives at a set of parties, known by its type and holders.

Tracing and clusters subclass it; a bare MPObject is a placeholder for compiling programs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mpplug.core.dtypes import DType
from mpplug.core.parties import PartySet, format_parties
from mpplug.core.types import TensorType


class MPObject:
    """A party value: the same `TensorType` at each party in `parties`."""

    __slots__ = ("parties", "type")

    def __init__(self, type: Any, parties: int | Iterable[int]) -> None:
        self.type = type if isinstance(type, TensorType) else TensorType.of(type)
        ranks = (parties,) if isinstance(parties, int) else tuple(parties)
        if not ranks:
            raise ValueError("an MPObject must be held by at least one party")
        self.parties: PartySet = frozenset(ranks)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.type} @ {format_parties(self.parties)})"
