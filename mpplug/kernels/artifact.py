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
from dataclasses import dataclass
from typing import Any

import flatbuffers
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


def _write(exported: jax_export.Exported) -> bytes:
    """The flatbuffer JAX's serializer writes for a flat function, in the same order of
    fields, with each repeated table written once."""
    fb, module = _schema, exported.mlir_module_serialized
    builder = flatbuffers.Builder(len(module) + 1024)
    n, m = len(exported.in_avals), len(exported.out_avals)

    def vector(offsets: list[int]) -> int:
        builder.StartVector(4, len(offsets), 4)
        for offset in reversed(offsets):
            builder.PrependUOffsetTRelative(offset)
        return builder.EndVector()

    def tree(kind: int, children: list[int]) -> int:
        nodes = vector(children) if children else None
        fb.PyTreeDefStart(builder)
        fb.PyTreeDefAddKind(builder, kind)
        if nodes is not None:
            fb.PyTreeDefAddChildren(builder, nodes)
        return int(fb.PyTreeDefEnd(builder))

    fun_name = builder.CreateString(exported.fun_name)
    leaf = tree(fb.PyTreeDefKind.leaf, [])
    no_keywords = tree(fb.PyTreeDefKind.dict, [])
    in_tree = tree(fb.PyTreeDefKind.tuple, [tree(fb.PyTreeDefKind.tuple, [leaf] * n), no_keywords])
    avals: dict[tuple[Any, ...], tuple[int, int]] = {}
    dims: dict[int, int] = {}

    def aval(a: Any) -> int:
        key = (a.shape, a.dtype, a.memory_space)
        found = avals.get(key)
        if found is None:
            for d in a.shape:
                if d not in dims:
                    dims[d] = builder.CreateString(str(d))
            shape = vector([dims[d] for d in a.shape])
            fb.AbstractValueStart(builder)
            fb.AbstractValueAddShape(builder, shape)
            fb.AbstractValueAddDtype(builder, _dtype_kinds[a.dtype])
            fb.AbstractValueAddMemorySpace(builder, _memory_spaces[a.memory_space])
            found = avals[key] = (fb.AbstractValueEnd(builder), len(avals))
        return found[0]

    in_avals = vector([aval(a) for a in exported.in_avals])
    out_tree = tree(fb.PyTreeDefKind.tuple, [leaf] * m)
    out_avals = vector([aval(a) for a in exported.out_avals])
    fb.ShardingStart(builder)
    unsharded = fb.ShardingEnd(builder)
    in_shardings, out_shardings = vector([unsharded] * n), vector([unsharded] * m)
    empty = vector([])
    platforms = vector([builder.CreateString(p) for p in exported.platforms])
    mlir_module = builder.CreateByteVector(module)
    kept = builder.CreateNumpyVector(np.asarray(exported.module_kept_var_idx, np.uint16))
    unique_avals = vector([offset for offset, _ in avals.values()])

    def indices(values: Any) -> int:
        return int(builder.CreateNumpyVector(np.asarray(values, np.uint32)))

    in_idxs = indices([avals[(a.shape, a.dtype, a.memory_space)][1] for a in exported.in_avals])
    out_idxs = indices([avals[(a.shape, a.dtype, a.memory_space)][1] for a in exported.out_avals])
    in_sharding_idxs, out_sharding_idxs = indices([0] * n), indices([0] * m)
    fb.ExportedStart(builder)
    fb.ExportedAddSerializationVersion(builder, SERIALIZATION_VERSION)
    fb.ExportedAddFunctionName(builder, fun_name)
    fb.ExportedAddInTree(builder, in_tree)
    fb.ExportedAddInAvals(builder, in_avals)
    fb.ExportedAddOutTree(builder, out_tree)
    fb.ExportedAddOutAvals(builder, out_avals)
    fb.ExportedAddNrDevices(builder, exported.nr_devices)
    fb.ExportedAddInShardings(builder, in_shardings)
    fb.ExportedAddOutShardings(builder, out_shardings)
    fb.ExportedAddPlatforms(builder, platforms)
    fb.ExportedAddOrderedEffects(builder, empty)
    fb.ExportedAddUnorderedEffects(builder, empty)
    fb.ExportedAddDisabledChecks(builder, empty)
    fb.ExportedAddMlirModuleSerialized(builder, mlir_module)
    fb.ExportedAddCallingConventionVersion(builder, exported.calling_convention_version)
    fb.ExportedAddModuleKeptVarIdx(builder, kept)
    fb.ExportedAddUniqueAvals(builder, unique_avals)
    fb.ExportedAddUniqueAbstractMeshes(builder, empty)
    fb.ExportedAddUniqueNamedShardings(builder, empty)
    fb.ExportedAddInAvalsIdxs(builder, in_idxs)
    fb.ExportedAddOutAvalsIdxs(builder, out_idxs)
    fb.ExportedAddInShardingsIdxs(builder, in_sharding_idxs)
    fb.ExportedAddOutShardingsIdxs(builder, out_sharding_idxs)
    builder.Finish(fb.ExportedEnd(builder))
    return bytes(builder.Output())


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
