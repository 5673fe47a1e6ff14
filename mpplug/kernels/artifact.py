"""`jax.export` artifacts of flat functions written and read faster than JAX's general
serializer: the same flatbuffer schema and fields, with each repeated part (a leaf, an empty
sharding, an aval) written once and shared, as flatbuffers allow; and read as a `Header`,
what a party checks and interprets, leaving JAX's deserializer to the compiles.

A flat function takes a tuple of arrays (and no keywords), returns one, runs on one device
and has no effects: every round `mp.mpc` writes. Any other function is serialized by JAX. The
first artifact a process writes here is read back by JAX's deserializer and compared with
what it was written from; if they differ (a JAX whose schema moved on), JAX's serializer
writes every artifact from then on.
"""

from __future__ import annotations

import functools
import logging
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax import export as jax_export

log = logging.getLogger("mpplug")

_schema: Any
_dtype_kinds: dict[Any, int]
_memory_spaces: dict[Any, int]
try:  # private JAX modules: the schema's generated code, JAX's numbering of dtypes and spaces
    from jax._src.export import serialization_generated as _schema
    from jax._src.export.serialization import _dtype_to_dtype_kind as _dtype_kinds
    from jax._src.export.serialization import _memory_space_to_enum as _memory_spaces
except ImportError:  # pragma: no cover - layout of a future JAX: JAX serializes and reads
    _schema, _dtype_kinds, _memory_spaces = None, {}, {}

SERIALIZATION_VERSION = 3
"""What JAX's serializer stores in the field (see its `_serialize_exported`)."""

FIELDS = (
    "fun_name",
    "in_tree",
    "in_avals",
    "out_tree",
    "out_avals",
    "_in_named_shardings",
    "_out_named_shardings",
    "nr_devices",
    "platforms",
    "ordered_effects",
    "unordered_effects",
    "disabled_safety_checks",
    "mlir_module_serialized",
    "calling_convention_version",
    "module_kept_var_idx",
    "uses_global_constants",
)
"""What an `Exported` holds that its flatbuffer carries (JAX's vjp, never serialized for a
round, aside)."""

_checked = threading.Event()
_trusted = [_schema is not None]
"""Whether artifacts are written here; cleared for good if the first check fails."""
_check_lock = threading.Lock()


def serialize(exported: jax_export.Exported) -> bytes:
    """`exported` serialized: here where it is a flat function, else by JAX."""
    if not _trusted[0] or not _is_flat(exported):
        return bytes(exported.serialize())
    written = _write(exported)
    if not _checked.is_set():
        with _check_lock:
            if not _checked.is_set():
                _trusted[0] = _reads_back(written, exported)
                _checked.set()
        if not _trusted[0]:
            return bytes(exported.serialize())
    return written


@functools.cache
def _flat_trees(n: int, m: int) -> tuple[object, object]:
    """The trees of a flat function of `n` arguments and `m` results."""
    return jax.tree.structure((tuple(range(n)), {})), jax.tree.structure(tuple(range(m)))


def _is_flat(exported: jax_export.Exported) -> bool:
    trees: tuple[object, object] = (exported.in_tree, exported.out_tree)
    return (
        trees == _flat_trees(len(exported.in_avals), len(exported.out_avals))
        and exported.nr_devices == 1
        and exported._has_named_shardings
        and all(s is None for s in exported._in_named_shardings)
        and all(s is None for s in exported._out_named_shardings)
        and not exported.ordered_effects
        and not exported.unordered_effects
        and not exported.disabled_safety_checks
        and not exported.uses_global_constants
        and all(type(d) is int for a in (*exported.in_avals, *exported.out_avals) for d in a.shape)
        and all(
            a.dtype in _dtype_kinds and a.memory_space in _memory_spaces
            for a in (*exported.in_avals, *exported.out_avals)
        )
    )


def _reads_back(written: bytes, exported: jax_export.Exported) -> bool:
    """Whether JAX's deserializer reads `written` as `exported`."""
    try:
        again = jax_export.deserialize(bytearray(written))
        differ = [f for f in FIELDS if getattr(again, f) != getattr(exported, f)]
    except Exception as exc:
        differ = [f"{type(exc).__name__}: {exc}"]
    if differ:
        log.warning("artifacts are serialized by JAX: this JAX reads %s otherwise", differ)
    return not differ


class _Writer:
    """A flatbuffer written back to front, as flatbuffers' own builder writes one, but a whole
    part (a vector, a string, a table) at a time with `struct`, where that builder takes a
    Python call a field or an element. A part's place is its distance from the end of the
    buffer (`size` once it is written), so a reference to it is known once it is written; the
    buffer is the parts in reverse order."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def _put(self, data: bytes) -> int:
        self.parts.append(data)
        self.size += len(data)
        return self.size

    def _pad(self, ahead: int) -> None:
        """Pad so that `ahead` bytes more end 4-byte aligned (every part here starts so)."""
        pad = -(self.size + ahead) % 4
        if pad:
            self._put(bytes(pad))

    def blob(self, data: bytes, terminated: bool = False) -> int:
        """A vector of bytes (a string, where `terminated`: flatbuffers end one with a NUL)."""
        tail = data + b"\0" if terminated else data
        self._pad(len(tail) + 4)
        self._put(tail)
        return self._put(struct.pack("<I", len(data)))

    def numbers(self, code: str, values: Sequence[int]) -> int:
        """A vector of integers of `struct` type `code` (H or I)."""
        body = struct.pack(f"<{len(values)}{code}", *values)
        self._pad(len(body) + 4)
        self._put(body)
        return self._put(struct.pack("<I", len(values)))

    def offsets(self, targets: Sequence[int]) -> int:
        """A vector of references to parts already written."""
        n = len(targets)
        self._pad(4 * n + 4)
        first = self.size + 4 * n  # where element 0 will be
        body = struct.pack(f"<{n}I", *[first - 4 * i - t for i, t in enumerate(targets)])
        self._put(body)
        return self._put(struct.pack("<I", n))

    def table(self, fields: Sequence[tuple[int, str, int]]) -> int:
        """A table of `fields` (slot, `struct` type: O a reference, I, H or b, value), its
        vtable just before it; references first, then smaller fields, each aligned."""
        order = sorted(fields, key=lambda f: -_FIELD_BYTES[f[1]])
        at, place = 4, {}
        for slot, code, _ in order:
            place[slot] = at
            at += _FIELD_BYTES[code]
        self._pad(at)
        start = self.size + at  # where the table will be
        values = [start - place[slot] - v if code == "O" else v for slot, code, v in order]
        codes = "".join("I" if code == "O" else code for _, code, _ in order)
        slots = [0] * (max(place, default=-1) + 1)
        for slot, offset in place.items():
            slots[slot] = offset
        vtable = struct.pack(f"<{2 + len(slots)}H", 4 + 2 * len(slots), at, *slots)
        self._put(struct.pack(f"<i{codes}", len(vtable), *values))
        self._put(vtable)
        return start

    def finish(self, root: int) -> bytes:
        self._pad(4)
        self._put(struct.pack("<I", self.size + 4 - root))
        return b"".join(reversed(self.parts))


_FIELD_BYTES = {"O": 4, "I": 4, "H": 2, "b": 1}


def _write(exported: jax_export.Exported) -> bytes:
    """The flatbuffer JAX's serializer writes for a flat function (the same tables and
    fields, defaults left out as flatbuffers leave them), with each repeated part written
    once."""
    fb, w = _schema, _Writer()
    kinds = fb.PyTreeDefKind
    n, m = len(exported.in_avals), len(exported.out_avals)
    module = w.blob(exported.mlir_module_serialized)

    def tree(kind: int, children: list[int]) -> int:
        fields = [(0, "b", kind)] if kind else []
        return w.table(fields + ([(1, "O", w.offsets(children))] if children else []))

    leaf = tree(kinds.leaf, [])
    in_tree = tree(kinds.tuple, [tree(kinds.tuple, [leaf] * n), tree(kinds.dict, [])])
    out_tree = tree(kinds.tuple, [leaf] * m)
    avals: dict[tuple[Any, ...], tuple[int, int]] = {}
    dims: dict[int, int] = {}

    def aval(a: Any) -> int:
        key = (a.shape, a.dtype, a.memory_space)
        found = avals.get(key)
        if found is None:
            for d in a.shape:
                if d not in dims:
                    dims[d] = w.blob(str(d).encode(), terminated=True)
            fields = [(1, "O", w.offsets([dims[d] for d in a.shape]))]
            fields += [(2, "b", _dtype_kinds[a.dtype]), (3, "b", _memory_spaces[a.memory_space])]
            found = avals[key] = (w.table([f for f in fields if f[2]]), len(avals))
        return found[0]

    def index(a: Any) -> int:
        return avals[(a.shape, a.dtype, a.memory_space)][1]

    in_avals = w.offsets([aval(a) for a in exported.in_avals])
    out_avals = w.offsets([aval(a) for a in exported.out_avals])
    unsharded = w.table([])
    empty = w.offsets([])
    fields = [
        (0, "H", SERIALIZATION_VERSION),
        (1, "O", w.blob(exported.fun_name.encode(), terminated=True)),
        (2, "O", in_tree),
        (3, "O", in_avals),
        (4, "O", out_tree),
        (5, "O", out_avals),
        (7, "O", w.offsets([unsharded] * n)),
        (8, "O", w.offsets([unsharded] * m)),
        (9, "O", w.offsets([w.blob(p.encode(), terminated=True) for p in exported.platforms])),
        (10, "O", empty),
        (11, "O", empty),
        (12, "O", empty),
        (13, "O", module),
        (14, "H", exported.calling_convention_version),
        (15, "O", w.numbers("H", exported.module_kept_var_idx)),
        (18, "I", exported.nr_devices),
        (19, "O", w.offsets([offset for offset, _ in avals.values()])),
        (20, "O", empty),
        (21, "O", empty),
        (22, "O", w.numbers("I", [index(a) for a in exported.in_avals])),
        (23, "O", w.numbers("I", [index(a) for a in exported.out_avals])),
        (24, "O", w.numbers("I", [0] * n)),
        (25, "O", w.numbers("I", [0] * m)),
    ]
    return w.finish(w.table(fields))


@dataclass(frozen=True)
class Header:
    """What a party reads of an artifact to check it and run it interpreted."""

    serialization_version: int
    platforms: tuple[str, ...]
    calling_convention_version: int
    in_avals: tuple[tuple[tuple[int, ...], np.dtype[Any]], ...]
    out_avals: tuple[tuple[tuple[int, ...], np.dtype[Any]], ...]
    ordered_effects: int
    """How many: a module with any takes effect tokens before its arguments."""
    module_kept_var_idx: tuple[int, ...]
    mlir_module_serialized: bytes


def header_of(exported: jax_export.Exported) -> Header:
    """The header of a deserialized artifact (symbolic dimensions are kept as they are; its
    serialization version, read by then, is given as the one written here)."""
    return Header(
        SERIALIZATION_VERSION,
        tuple(exported.platforms),
        exported.calling_convention_version,
        tuple((tuple(a.shape), a.dtype) for a in exported.in_avals),
        tuple((tuple(a.shape), a.dtype) for a in exported.out_avals),
        len(exported.ordered_effects),
        tuple(exported.module_kept_var_idx),
        exported.mlir_module_serialized,
    )


_dtypes = {
    kind: dtype
    for dtype, kind in _dtype_kinds.items()
    if isinstance(dtype, np.dtype) and dtype != jax.dtypes.float0
}
"""The array dtypes a header reads (not float0, nor PRNG key types)."""


def read(body: bytearray) -> Header | None:
    """The header of an artifact written as `serialize` writes one (avals by index, with
    whole-number dimensions and no sharding, on one device), or None for any other, which
    JAX's deserializer reads. Raises ValueError where the buffer is not a flatbuffer of the
    schema: an offset or a length past its end, more dimensions than it could hold."""
    if _schema is None:
        return None
    try:
        return _read(_schema.Exported.GetRootAsExported(body, 0), len(body))
    except (IndexError, TypeError, UnicodeDecodeError, ValueError, struct.error) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from None


def _read(root: Any, size: int) -> Header | None:
    if (root.NrDevices() or root.NrDevicesShort()) != 1 or root.UniqueNamedShardingsLength():
        return None
    avals, dims_read = [], 0
    for i in range(_length(root.UniqueAvalsLength(), size)):
        aval = root.UniqueAvals(i)
        dims_read += _length(aval.ShapeLength(), size)
        if dims_read > size // 4:  # a valid buffer holds each aval's own shape vector
            raise ValueError(f"more dimensions than {size} bytes hold")
        dims = [aval.Shape(j) for j in range(aval.ShapeLength())]
        dtype = _dtypes.get(aval.Dtype())
        if aval.Kind() != 0 or dtype is None or not all(d.isdigit() for d in dims):
            return None  # a token, a dtype not read here, a symbolic dimension
        if aval.MemorySpace() not in (_schema.MemorySpace.Missing, _schema.MemorySpace.Device):
            return None
        avals.append((tuple(int(d) for d in dims), dtype))
    sides = {}
    for side in ("In", "Out"):
        idxs = _vector(getattr(root, f"{side}AvalsIdxsAsNumpy")())
        shardings = _vector(getattr(root, f"{side}ShardingsIdxsAsNumpy")())
        if getattr(root, f"{side}AvalsLength")() and not len(idxs):
            return None  # avals written out in full: the format before indices
        if len(shardings) != len(idxs) or shardings.any():
            return None
        sides[side] = tuple(avals[i] for i in idxs.tolist())
    platforms = range(_length(root.PlatformsLength(), size))
    return Header(
        root.SerializationVersion(),
        tuple(root.Platforms(i).decode() for i in platforms),
        root.CallingConventionVersion(),
        sides["In"],
        sides["Out"],
        root.OrderedEffectsLength(),
        tuple(_vector(root.ModuleKeptVarIdxAsNumpy()).tolist()),
        _vector(root.MlirModuleSerializedAsNumpy()).tobytes(),
    )


def _length(length: int, size: int) -> int:
    """A vector's length, if a buffer of `size` bytes can hold it (4 bytes an element)."""
    if length > size // 4:
        raise ValueError(f"a vector of {length} elements in {size} bytes")
    return length


def _vector(found: Any) -> np.ndarray:
    """A vector field as the generated code reads it: its array, or 0 where it is absent."""
    return np.zeros(0, np.uint8) if isinstance(found, int) else found
