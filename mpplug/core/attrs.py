"""`Attrs`: an immutable, hashable mapping of str to plain values.

Values are bool, int, float, str, bytes, or tuples of those (nested).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

AttrScalar = bool | int | float | str | bytes
AttrValue = AttrScalar | tuple[Any, ...]


INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # attr ints travel as protobuf sint64


def _freeze(key: str, value: Any) -> AttrValue:
    if isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
        raise ValueError(f"attr {key!r}: expected an int in the signed 64-bit range, got {value}")
    if isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, tuple | list):
        return tuple(_freeze(key, v) for v in value)
    raise TypeError(
        f"attr {key!r}: expected bool, int, float, str, bytes or a tuple of those, "
        f"got {type(value).__name__}"
    )


class Attrs(Mapping[str, AttrValue]):
    """An immutable mapping with keys kept sorted, so equal attrs compare and hash equal."""

    __slots__ = ("_hash", "_items")

    def __init__(self, items: Mapping[str, Any] | None = None) -> None:
        pairs = []
        for key, value in (items or {}).items():
            if not isinstance(key, str):
                raise TypeError(f"attr keys must be str, got {type(key).__name__}")
            pairs.append((key, _freeze(key, value)))
        self._items: dict[str, AttrValue] = dict(sorted(pairs))
        self._hash: int | None = None

    def __getitem__(self, key: str) -> AttrValue:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self._items.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Attrs):
            return self._items == other._items
        if isinstance(other, Mapping):
            return self._items == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"Attrs({self._items!r})"
