"""The `jax.exec` kernel: runs a PFunction whose body is a serialized `jax.export` artifact.

Each runtime deserializes and jit-compiles a body once per digest (a bounded cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend
from jax import export as jax_export
from jax.sharding import SingleDeviceSharding

from mpplug.core import PFunction, TensorType
from mpplug.errors import InvalidPFunctionError
from mpplug.kernels.devices import default_export_platform, export_platform
from mpplug.kernels.module_check import ModuleChecker, ModuleRefused
from mpplug.kernels.runtime import DEFAULT_CACHE_SIZE, DirectCall, KernelRuntime, LRUCache

FN_TYPE = "jax.exec"
CACHE_NAMESPACE = "jax.exec"

ATTR_JAX_VERSION = "jax.version"
ATTR_CALLING_CONVENTION = "jax.calling_convention_version"
ATTR_PLATFORMS = "jax.platforms"
ATTR_KEPT_INPUTS = "jax.kept_inputs"
ATTR_X64 = "jax.x64"

# Private JAX modules, for a cheap structural check of the flatbuffer before JAX walks it;
# without them (a future JAX) the check is skipped and deserialization errors still apply.
_flatbuf: Any
_readable_version: int | None
try:
    from jax._src.export import serialization_generated as _flatbuf
    from jax._src.export.serialization import _SERIALIZATION_VERSION as _readable_version
except ImportError:  # pragma: no cover - layout of a future JAX
    _flatbuf, _readable_version = None, None


@dataclass(frozen=True)
class CompiledExport:
    """A deserialized artifact ready to call on one runtime's device.

    `call(*args)` returns the flat tuple of outputs: the jitted function flattens them when it
    is traced, and enables x64 around the call when the artifact needs it.
    """

    call: Callable[..., tuple[Any, ...]]
    exported: jax_export.Exported


def supported_calling_conventions() -> range:
    return range(
        jax_export.minimum_supported_calling_convention_version,
        jax_export.maximum_supported_calling_convention_version + 1,
    )


def _where(pfunc: PFunction) -> str:
    return f"PFunction {pfunc.fn_name!r} ({pfunc.digest[:12]})"


def _check_version(pfunc: PFunction, version: int, what: str) -> None:
    supported = supported_calling_conventions()
    if version not in supported:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: {what} calling convention version {version}, but JAX "
            f"{jax.__version__} runs versions {supported.start}..{supported.stop - 1}; "
            f"re-export it with a compatible JAX"
        )


def _precheck_flatbuffer(pfunc: PFunction, body: bytearray) -> None:
    if _flatbuf is None:
        return
    try:
        root = _flatbuf.Exported.GetRootAsExported(body, 0)
        lengths = {name: getattr(root, name)() for name in dir(root) if name.endswith("Length")}
        version = root.SerializationVersion()
    except Exception as exc:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: fn_body ({len(body)} bytes) is not a jax.export artifact "
            f"({type(exc).__name__}: {exc})"
        ) from None
    too_long = {k: v for k, v in lengths.items() if not 0 <= v <= len(body)}
    if too_long:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: fn_body ({len(body)} bytes) is not a jax.export artifact "
            f"(vector lengths {too_long} exceed the buffer)"
        )
    if _readable_version is not None and not 1 <= version <= _readable_version:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: serialization version {version}, but JAX {jax.__version__} "
            f"reads versions 1..{_readable_version}"
        )


def _check_types(pfunc: PFunction, exported: jax_export.Exported) -> None:
    for where, declared, avals in (
        ("ins_info", pfunc.ins_info, exported.in_avals),
        ("outs_info", pfunc.outs_info, exported.out_avals),
    ):
        try:
            actual = tuple(TensorType(a.dtype, a.shape) for a in avals)
        except Exception as exc:  # symbolic shapes, unsupported dtypes
            raise InvalidPFunctionError(f"{_where(pfunc)}: unsupported {where}: {exc}") from None
        if actual != declared:
            raise InvalidPFunctionError(
                f"{_where(pfunc)}: {where} declares ({', '.join(map(str, declared))}) but the "
                f"artifact has ({', '.join(map(str, actual))})"
            )


def load(pfunc: PFunction, runtime: KernelRuntime) -> CompiledExport:
    """Validate and deserialize a `jax.exec` PFunction for this runtime's platform."""
    if pfunc.fn_type != FN_TYPE:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: expected fn_type {FN_TYPE!r}, got {pfunc.fn_type!r}"
        )
    if not pfunc.fn_body:
        raise InvalidPFunctionError(f"{_where(pfunc)}: fn_body is empty")
    declared = pfunc.attrs.get(ATTR_CALLING_CONVENTION)
    if isinstance(declared, int):
        _check_version(pfunc, declared, "declares")
    body = bytearray(pfunc.fn_body)
    _precheck_flatbuffer(pfunc, body)
    try:
        exported = jax_export.deserialize(body)
    except Exception as exc:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: fn_body ({len(body)} bytes) does not deserialize as a "
            f"jax.export artifact ({type(exc).__name__}: {exc})"
        ) from None
    _check_version(pfunc, exported.calling_convention_version, "has")
    device = runtime.resolved_device()
    platform = export_platform(device) if device is not None else default_export_platform()
    if platform not in exported.platforms:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: exported for platforms {list(exported.platforms)}, but this "
            f"party runs on {platform!r}; export with platforms=(..., {platform!r})"
        )
    _check_types(pfunc, exported)
    if runtime.untrusted_artifacts:
        exported = _checked_module(pfunc, exported)
    x64 = bool(pfunc.attrs.get(ATTR_X64, False)) or any(
        t.dtype.is_64bit for t in (*pfunc.ins_info, *pfunc.outs_info)
    )
    jitted = _jit(exported, device, len(pfunc.ins_info))
    _lower_now(pfunc, jitted, exported, x64)
    return CompiledExport(_with_x64(jitted) if x64 else jitted, exported)


_CHECKER = ModuleChecker()
"""Its helper process starts when a party first loads an artifact, and stops at exit."""


def _serialize_with_sdy() -> bool:
    """How JAX writes modules for this process's backend (what `jax.export` would do here)."""
    return bool(jax.extend.backend.get_backend().serialize_with_sdy)


def _checked_module(pfunc: PFunction, exported: jax_export.Exported) -> jax_export.Exported:
    """`exported` with its StableHLO module as a fresh helper process parsed and wrote it
    again, so this process never parses bytes that could crash it (see module_check)."""
    try:
        checked = _CHECKER.check(exported.mlir_module_serialized, with_sdy=_serialize_with_sdy())
    except ModuleRefused as exc:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: fn_body ({len(pfunc.fn_body)} bytes) holds a StableHLO module "
            f"this party does not load: {exc}"
        ) from None
    return dataclasses.replace(exported, mlir_module_serialized=checked.bytecode)


def _jit(exported: jax_export.Exported, device: Any, n_ins: int) -> Any:
    """`exported.call` jitted to return its outputs as one flat tuple, flattened at trace time
    so that a warm call runs no Python of ours between the arguments and the executable."""

    def flat_call(*args: Any) -> tuple[Any, ...]:
        return tuple(jax.tree.leaves(exported.call(*args)))

    if device is None:
        return jax.jit(flat_call)
    sharding = SingleDeviceSharding(device)  # inputs (numpy, or on another device) move there
    return jax.jit(flat_call, in_shardings=(sharding,) * n_ins, out_shardings=sharding)


def _with_x64(call: Callable[..., tuple[Any, ...]]) -> Callable[..., tuple[Any, ...]]:
    def call_x64(*args: Any) -> tuple[Any, ...]:
        with jax.enable_x64(True):
            return call(*args)

    return call_x64


def _lower_now(pfunc: PFunction, jitted: Any, exported: jax_export.Exported, x64: bool) -> None:
    """Lower once at load: the StableHLO module inside the artifact is only decoded then, so a
    corrupt module fails here as an InvalidPFunctionError rather than at every call."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals]
    try:
        with jax.enable_x64(True) if x64 else contextlib.nullcontext():
            jitted.lower(*specs)
    except Exception as exc:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: fn_body ({len(pfunc.fn_body)} bytes) holds a module that does "
            f"not load ({type(exc).__name__}: {_first_line(exc)})"
        ) from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no detail"


_PROCESS_CACHE: LRUCache[tuple[str, Any, bool], CompiledExport] = LRUCache(DEFAULT_CACHE_SIZE)


def _shared_load(pfunc: PFunction, runtime: KernelRuntime) -> CompiledExport:
    """Runtimes of one process bound to the same device (simulated parties) share one
    compiled executable per digest instead of compiling it once each."""
    key = (pfunc.digest, runtime.resolved_device(), runtime.untrusted_artifacts)
    return _PROCESS_CACHE.get_or_create(key, lambda: load(pfunc, runtime))


def run_jax_exec(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> tuple[Any, ...]:
    """The kernel: outputs stay on the runtime's device as JAX arrays. It offers `invoke` the
    jitted function as the PFunction's direct call on this runtime."""
    cache = runtime.cache(CACHE_NAMESPACE)
    compiled: CompiledExport = cache.get_or_create(
        pfunc.digest, lambda: _shared_load(pfunc, runtime)
    )
    if pfunc.digest not in runtime.direct_calls:
        runtime.direct_calls[pfunc.digest] = DirectCall(
            compiled.call, len(pfunc.ins_info), cache.touch
        )
        if pfunc.digest not in cache:  # evicted by another thread just before: none stale
            runtime.direct_calls.pop(pfunc.digest, None)
    return compiled.call(*args)
