"""`PFunction`: a portable, serializable record of one function a party can run.

The body is opaque bytes interpreted by the kernel registered for `fn_type`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from mpplug.core.attrs import Attrs
from mpplug.core.types import TableType, TensorType, ValueType
from mpplug.errors import InvalidPFunctionError


@dataclass(frozen=True, eq=False)
class PFunction:
    """A function record: kernel name, body bytes, input/output types and attrs.

    Guarantees: immutable; `to_bytes()` is canonical (equal records give equal bytes), so
    `digest` (sha256 hex of those bytes) identifies the function; `from_bytes(to_bytes())`
    gives an equal record. Two records are equal exactly when their canonical bytes are, so
    equality agrees with `hash` and `digest` (attrs `True` and `1`, or `0.0` and `-0.0`, differ).
    """

    fn_type: str
    fn_name: str
    fn_body: bytes
    ins_info: tuple[ValueType, ...]
    outs_info: tuple[ValueType, ...]
    attrs: Attrs

    def __init__(
        self,
        fn_type: str,
        fn_name: str,
        fn_body: bytes,
        ins_info: Iterable[ValueType],
        outs_info: Iterable[ValueType],
        attrs: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(fn_type, str) or not fn_type:
            raise InvalidPFunctionError(f"expected a non-empty str fn_type, got {fn_type!r}")
        if not isinstance(fn_body, bytes | bytearray | memoryview):
            raise InvalidPFunctionError(f"expected fn_body as bytes, got {type(fn_body).__name__}")
        ins = tuple(ins_info)
        outs = tuple(outs_info)
        for where, types in (("ins_info", ins), ("outs_info", outs)):
            for i, t in enumerate(types):
                if not isinstance(t, TensorType | TableType):
                    raise InvalidPFunctionError(
                        f"{where}[{i}]: expected TensorType or TableType, got {type(t).__name__}"
                    )
        object.__setattr__(self, "fn_type", fn_type)
        object.__setattr__(self, "fn_name", str(fn_name))
        object.__setattr__(self, "fn_body", bytes(fn_body))
        object.__setattr__(self, "ins_info", ins)
        object.__setattr__(self, "outs_info", outs)
        if not isinstance(attrs, Attrs):
            try:
                attrs = Attrs(attrs)
            except (TypeError, ValueError) as exc:
                raise InvalidPFunctionError(f"attrs: {exc}") from None
        object.__setattr__(self, "attrs", attrs)

    def to_bytes(self) -> bytes:
        """Canonical protobuf bytes of this record."""
        return self._bytes

    @classmethod
    def from_bytes(cls, data: bytes) -> PFunction:
        """Decode bytes from `to_bytes()`; raises `InvalidPFunctionError` on bad input."""
        from mpplug.core import serde

        return serde.pfunction_from_bytes(data)

    @cached_property
    def _bytes(self) -> bytes:
        from mpplug.core import serde

        return serde.pfunction_to_proto(self).SerializeToString(deterministic=True)

    @cached_property
    def digest(self) -> str:
        """sha256 hex digest of the canonical bytes."""
        return hashlib.sha256(self._bytes).hexdigest()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PFunction):
            return NotImplemented
        return self is other or self._bytes == other._bytes

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        ins = ", ".join(map(str, self.ins_info))
        outs = ", ".join(map(str, self.outs_info))
        return (
            f"PFunction({self.fn_type}:{self.fn_name}({ins}) -> ({outs}), "
            f"body={len(self.fn_body)} bytes, digest={self.digest[:12]})"
        )
