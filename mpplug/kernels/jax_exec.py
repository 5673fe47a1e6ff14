"""The `jax.exec` kernel: runs a PFunction whose body is a serialized `jax.export` artifact.

Each runtime compiles a body once per digest (a bounded cache), and the process keeps the
executable in the persistent compile cache (`compile_cache`) for the next process. A party
runs a program's first run on plans of the modules interpreted with numpy (`interpreted`,
no compile), and compiles them at the second (`tier_up_jax_exec`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import platform as platform_module
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import jax
import jax.extend
import numpy as np
from jax import export as jax_export
from jax.sharding import SingleDeviceSharding

from mpplug.core import PFunction, TensorType, ValueType
from mpplug.core.custom_calls import (
    CustomCall,
    CustomCallRefused,
    check_buffers,
    module_targets,
    runs_on,
)
from mpplug.errors import InvalidPFunctionError
from mpplug.kernels import artifact, interpreted
from mpplug.kernels.collection import collection_paused
from mpplug.kernels.compile_cache import cache_key, disk_cache
from mpplug.kernels.devices import export_platform
from mpplug.kernels.module_check import ModuleChecker, ModuleRefused
from mpplug.kernels.runtime import DEFAULT_CACHE_SIZE, DirectCall, KernelRuntime, LRUCache

FN_TYPE = "jax.exec"
CACHE_NAMESPACE = "jax.exec"

ATTR_JAX_VERSION = "jax.version"
ATTR_CALLING_CONVENTION = "jax.calling_convention_version"
ATTR_PLATFORMS = "jax.platforms"
ATTR_KEPT_INPUTS = "jax.kept_inputs"
ATTR_X64 = "jax.x64"
ATTR_CUSTOM_CALLS = "jax.custom_calls"
"""The custom-call targets the exporter found in the module (what a party's load-time policy
check reads; the compile checks the module itself)."""

# Private JAX modules, for a cheap structural check of the flatbuffer before JAX walks it;
# without them (a future JAX) the check is skipped and deserialization errors still apply.
log = logging.getLogger("mpplug")

_flatbuf: Any
_readable_version: int | None
try:
    from jax._src.export import serialization_generated as _flatbuf
    from jax._src.export.serialization import _SERIALIZATION_VERSION as _readable_version
except ImportError:  # pragma: no cover - layout of a future JAX
    _flatbuf, _readable_version = None, None


CACHE_FORMAT = "2"
"""Bumped when what the persistent cache stores for an artifact changes."""
_CALLS_NATIVE = b"N"
_NO_CUSTOM_CALLS = b"-"
"""The first byte of a stored executable: whether its module makes custom calls (a CPU one
may call LAPACK, whose routines must be loaded first), found when it was compiled here."""


@dataclass(frozen=True)
class CompiledExport:
    """An artifact compiled for one runtime's device (or loaded compiled from the persistent
    cache), ready to call.

    `call(*args)` returns the flat tuple of outputs, with x64 enabled around the call when the
    artifact needs it.
    """

    call: Callable[..., tuple[Any, ...]]
    size: int
    """Bytes of the serialized executable (1 where the backend cannot serialize): what the
    executable caches weigh it by, as its code and the memory maps it takes grow with it."""
    interpreted: bool = False
    """Whether `call` runs an interpreted plan of the module (the first tier), not XLA code."""


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
    _check_serialization_version(pfunc, version)


def _check_serialization_version(pfunc: PFunction, version: int) -> None:
    if _readable_version is not None and not 1 <= version <= _readable_version:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: serialization version {version}, but JAX {jax.__version__} "
            f"reads versions 1..{_readable_version}"
        )


def _check_types(pfunc: PFunction, header: artifact.Header) -> None:
    for where, declared, avals in (
        ("ins_info", pfunc.ins_info, header.in_avals),
        ("outs_info", pfunc.outs_info, header.out_avals),
    ):
        try:
            actual = tuple(TensorType(dtype, shape) for shape, dtype in avals)
        except Exception as exc:  # symbolic shapes, unsupported dtypes
            raise InvalidPFunctionError(f"{_where(pfunc)}: unsupported {where}: {exc}") from None
        if actual != declared:
            raise InvalidPFunctionError(
                f"{_where(pfunc)}: {where} declares ({', '.join(map(str, declared))}) but the "
                f"artifact has ({', '.join(map(str, actual))})"
            )


def load(pfunc: PFunction, runtime: KernelRuntime, interpret: bool = False) -> CompiledExport:
    """Validate, deserialize and compile a `jax.exec` PFunction for this runtime's device,
    or load it compiled from the persistent cache (where it was stored after the same checks
    passed for the same digest, platform and trust level). With `interpret`, a module that
    is not in the persistent cache is planned to run interpreted where it can be."""
    if pfunc.fn_type != FN_TYPE:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: expected fn_type {FN_TYPE!r}, got {pfunc.fn_type!r}"
        )
    if not pfunc.fn_body:
        raise InvalidPFunctionError(f"{_where(pfunc)}: fn_body is empty")
    tables = [str(t) for t in (*pfunc.ins_info, *pfunc.outs_info) if not isinstance(t, TensorType)]
    if tables:
        raise InvalidPFunctionError(f"{_where(pfunc)}: JAX takes and gives arrays, not {tables[0]}")
    declared = pfunc.attrs.get(ATTR_CALLING_CONVENTION)
    if isinstance(declared, int):
        _check_version(pfunc, declared, "declares")
    device = runtime.resolved_device()
    target = device if device is not None else jax.devices()[0]
    x64 = bool(pfunc.attrs.get(ATTR_X64, False)) or any(
        isinstance(t, TensorType) and t.dtype.is_64bit for t in (*pfunc.ins_info, *pfunc.outs_info)
    )
    disk = disk_cache()
    key = _disk_key(pfunc, target, runtime)
    if disk is not None:
        payload = disk.get(key)
        if payload is not None:
            cached = _from_disk(pfunc, payload, target)
            if cached is not None:
                return cached
    header = _header(pfunc)
    _check_version(pfunc, header.calling_convention_version, "has")
    platform = export_platform(target)
    if platform not in header.platforms:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: exported for platforms {list(header.platforms)}, but this "
            f"party runs on {platform!r}; export with platforms=(..., {platform!r})"
        )
    _check_types(pfunc, header)
    module = header.mlir_module_serialized
    try:
        if runtime.untrusted_artifacts:
            module, calls = _checked_module(pfunc, module)
            targets = tuple(c.target for c in calls)
            runtime.custom_calls.check(targets, platform, _where(pfunc))
            for custom in calls:
                if runs_on([custom.target], platform):
                    check_buffers(custom, _where(pfunc), runtime.custom_calls.entries)
        else:
            targets = module_targets(_exported(pfunc)) if b"custom_call" in module else ()
            runtime.custom_calls.check(targets, platform, _where(pfunc))
    except CustomCallRefused as exc:
        raise InvalidPFunctionError(str(exc)) from None
    if interpret:
        found = _interpreted(pfunc, header, module, runtime)
        if found is not None:
            return found
    exported = _exported(pfunc)
    if runtime.untrusted_artifacts:  # the module as the module check wrote it again
        exported = dataclasses.replace(exported, mlir_module_serialized=module)
    compiled = _compile(pfunc, _jit(exported, device, len(pfunc.ins_info)), exported, x64)
    size = 1
    try:
        payload = target.client.serialize_executable(compiled.runtime_executable())
    except Exception as exc:  # a backend that cannot serialize: nothing to keep
        log.debug("%s: executable not cached (%s)", _where(pfunc), exc)
    else:
        size = len(payload)
        if disk is not None:
            disk.put(key, (_CALLS_NATIVE if targets else _NO_CUSTOM_CALLS) + payload)
    call = _placing(compiled, device)
    return CompiledExport(_with_x64(call) if x64 else call, size)


def _deserialized(pfunc: PFunction) -> jax_export.Exported:
    body = bytearray(pfunc.fn_body)
    _precheck_flatbuffer(pfunc, body)
    try:
        return jax_export.deserialize(body)
    except Exception as exc:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: fn_body ({len(body)} bytes) does not deserialize as a "
            f"jax.export artifact ({type(exc).__name__}: {exc})"
        ) from None


EXPORTED_BYTES = 64 << 20
_EXPORTED: LRUCache[str, jax_export.Exported] = LRUCache(
    DEFAULT_CACHE_SIZE, weigh=lambda e: len(e.mlir_module_serialized), max_weight=EXPORTED_BYTES
)
"""Artifacts by their PFunction's digest (the sha256 of the bytes they came from), as this
process wrote them or last deserialized them: a simulated party loading one it wrote, and a
party compiling one it ran interpreted, skip deserializing it again (about 50 us a function
input or output)."""


WRITTEN_PLANS_BYTES = 64 << 20
_WRITTEN_PLANS: LRUCache[str, interpreted.Plan] = LRUCache(
    DEFAULT_CACHE_SIZE, weigh=lambda plan: plan.weight, max_weight=WRITTEN_PLANS_BYTES
)
"""Plans of functions this process wrote, made from the modules their writer parsed, by
digest, until a runtime takes each (see `planning_written`)."""
_planning_written: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "mpplug_planning_written", default=False
)


@contextlib.contextmanager
def planning_written() -> Iterator[None]:
    """While open, functions this thread writes (`mp.mpc`'s rounds) are planned as they are
    written, where first runs are interpreted: a Simulator, whose parties run them in this
    process, skips deserializing each artifact to plan it (a third of planning a round).
    Elsewhere (a Driver's process) nothing is planned that no party here would run."""
    token = _planning_written.set(True)
    try:
        yield
    finally:
        _planning_written.reset(token)


def plans_written() -> bool:
    """Whether a function written now is planned as it is written (see `planning_written`)."""
    return _planning_written.get() and interpret_first_runs()


def written_here(
    pfunc: PFunction, exported: jax_export.Exported, plan: interpreted.Plan | None = None
) -> None:
    """Note that `pfunc`'s body is `exported`, serialized by this process, and `plan` its
    plan made as it was written (if one was)."""
    _EXPORTED.put(pfunc.digest, exported)
    if plan is not None:
        _WRITTEN_PLANS.put(pfunc.digest, plan)


def _exported(pfunc: PFunction) -> jax_export.Exported:
    found = _EXPORTED.get(pfunc.digest)
    if found is None:
        found = _deserialized(pfunc)
        _EXPORTED.put(pfunc.digest, found)
    return found


def _header(pfunc: PFunction) -> artifact.Header:
    """What `load` checks and interprets: read from the flatbuffer without JAX's deserializer
    where it can be (see `artifact.read`); JAX deserializes it for the compile."""
    found = _EXPORTED.get(pfunc.digest)
    if found is not None:
        return artifact.header_of(found)
    body = bytearray(pfunc.fn_body)
    try:
        header = artifact.read(body)
    except ValueError as exc:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: fn_body ({len(body)} bytes) is not a jax.export artifact ({exc})"
        ) from None
    if header is None:
        return artifact.header_of(_exported(pfunc))
    _check_serialization_version(pfunc, header.serialization_version)
    return header


def _interpreted(
    pfunc: PFunction, header: artifact.Header, module: bytes, runtime: KernelRuntime
) -> CompiledExport | None:
    """The module as an interpreted plan, or None where a plan cannot run it (it is compiled).

    A call that meets a float sum a plan cannot make exact compiles the module then."""
    if len(header.platforms) > 1 or header.ordered_effects:
        return None  # a platform index or effect tokens before the arguments: compiled
    plan = _WRITTEN_PLANS.get(pfunc.digest)
    if plan is not None:
        _WRITTEN_PLANS.discard(pfunc.digest)  # held from now on where the process's plans are
    else:
        try:
            plan = interpreted.plan_serialized(module)
        except interpreted.Unsupported as exc:
            log.debug("%s: compiled, not interpreted (%s)", _where(pfunc), exc)
            return None
    kept = header.module_kept_var_idx
    expected = [(tuple(t.shape), np.dtype(t.dtype.numpy)) for t in _tensor_types(pfunc.ins_info)]
    where = _where(pfunc)
    device = runtime.resolved_device() or jax.devices()[0]
    # the only CPU device: numpy arrays are its memory, so the outputs stay numpy
    host = device.platform == "cpu" and len(device.client.local_devices()) == 1
    compiled: list[CompiledExport] = []

    def call(*args: Any) -> tuple[Any, ...]:
        if compiled:
            return compiled[0].call(*args)
        _check_args(where, expected, args)
        try:
            outs = interpreted.call(plan, [args[i] for i in kept])
            if host:  # a device_put would only copy them (about 20 us a value)
                return outs
            with jax.enable_x64(True):  # outputs on the runtime's device, as compiled ones are
                return tuple(jax.device_put(list(outs), device))
        except interpreted.NotExact as exc:
            log.debug("%s: compiled at its first call (%s)", where, exc)
        compiled.append(_shared_load(pfunc, runtime))
        return compiled[0].call(*args)

    return CompiledExport(call, plan.weight, interpreted=True)


def _check_args(where: str, expected: Sequence[tuple[tuple[int, ...], Any]], args: Any) -> None:
    """A TypeError unless the arguments' shapes and dtypes are the expected ones."""
    if len(args) != len(expected):
        raise TypeError(f"{where}: expected {len(expected)} arguments, got {len(args)}")
    for i, (arg, (shape, dtype)) in enumerate(zip(args, expected, strict=True)):
        if tuple(arg.shape) != shape or arg.dtype != dtype:
            raise TypeError(
                f"{where}: argument {i}: expected {dtype}{list(shape)}, "
                f"got {arg.dtype}{list(arg.shape)}"
            )


def _disk_key(pfunc: PFunction, device: Any, runtime: KernelRuntime) -> bytes:
    """What a compiled executable depends on: the artifact, the device (platform, kind, id),
    the host's CPU features (CPU code is built for them), jaxlib, the trust level and the
    custom-call targets admitted (an entry is stored only after the checks passed)."""
    return cache_key(
        CACHE_FORMAT,
        pfunc.digest,
        export_platform(device),
        str(getattr(device, "device_kind", "")),
        str(getattr(device, "id", "")),  # an executable is built for one device
        str(getattr(device.client, "platform_version", "")),
        _host_features() if device.platform == "cpu" else "",
        jax.__version__,
        jaxlib_version(),
        "untrusted" if runtime.untrusted_artifacts else "trusted",
        repr(runtime.custom_calls.entries),  # with the platform above, what it admits
    )


def jaxlib_version() -> str:
    import jaxlib

    return str(jaxlib.__version__)


@functools.cache
def _host_features() -> str:
    """The CPU's model and feature flags (Linux), so a cache folder shared between hosts never
    hands one host code built for another's instruction set."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform_module.machine() + platform_module.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("flags", "model name", "Features"))]
    return "\n".join(dict.fromkeys(lines))


def _from_disk(pfunc: PFunction, stored: bytes, device: Any) -> CompiledExport | None:
    """A cached executable loaded onto `device`, or None if the backend refuses it."""
    from jax._src.lib import xla_client

    calls, payload = stored[:1], stored[1:]
    if calls not in (_CALLS_NATIVE, _NO_CUSTOM_CALLS):
        return None  # not what this version stores: compile instead
    if device.platform == "cpu" and calls == _CALLS_NATIVE and not _lapack_ready():
        return None  # its LAPACK calls would find no routines: compile instead
    try:
        executable = device.client.deserialize_executable(
            payload, executable_devices=xla_client.DeviceList((device,))
        )
    except Exception as exc:
        log.warning("%s: cached executable not loaded (%s); compiling", _where(pfunc), exc)
        return None
    return CompiledExport(_executable_call(executable, device, pfunc), len(payload))


@functools.cache
def _lapack_ready() -> bool:
    """Load the LAPACK routines jaxlib's CPU kernels call, as JAX does when it lowers a call
    of an exported function on a CPU: an executable loaded from the cache skips that
    lowering, and its LAPACK calls would otherwise jump to routines never loaded."""
    try:
        from jax._src.lax import linalg

        linalg.initialize_lapack()
    except Exception as exc:  # a future JAX without it: cached executables are not loaded
        log.warning("LAPACK not initialized (%s); cached CPU executables are compiled again", exc)
        return False
    return True


def _tensor_types(types: Sequence[ValueType]) -> list[TensorType]:
    """A jax.exec PFunction's types, all arrays (`load` refused any table)."""
    return [cast(TensorType, t) for t in types]


def _executable_call(executable: Any, device: Any, pfunc: PFunction) -> Callable[..., Any]:
    """Calls a loaded executable as the jitted function would: arguments checked against
    `ins_info` (TypeError), moved to `device`, outputs returned as a flat tuple."""
    expected = [(tuple(t.shape), np.dtype(t.dtype.numpy)) for t in _tensor_types(pfunc.ins_info)]
    where = _where(pfunc)

    def call(*args: Any) -> tuple[Any, ...]:
        _check_args(where, expected, args)
        arrays = []
        for arg in args:
            if not isinstance(arg, jax.Array) or arg.devices() != {device}:
                with jax.enable_x64(True):
                    arg = jax.device_put(arg, device)
            arrays.append(arg)
        results = executable.execute_sharded(arrays)
        return tuple(out[0] for out in results.disassemble_into_single_device_arrays())

    return call


def _placing(call: Callable[..., Any], device: Any) -> Callable[..., Any]:
    """`call`, retried once with its JAX arguments moved to `device` when some are on
    another (a compiled function takes only arguments placed as it was compiled for)."""
    if device is None:
        return call

    def placed(*args: Any) -> Any:
        try:
            return call(*args)
        except ValueError:
            if all(not isinstance(a, jax.Array) or a.devices() == {device} for a in args):
                raise
        return call(*(jax.device_put(a, device) if isinstance(a, jax.Array) else a for a in args))

    return placed


_CHECKER = ModuleChecker()
"""Its helper process starts when a party server starts (`start_module_check`) or first loads
an artifact, and stops at exit."""


def start_module_check() -> None:
    """Start the helper that checks the modules of artifacts from the network."""
    _CHECKER.start()


def serialize_with_sdy() -> bool:
    """How JAX writes modules for this process's backend (what `jax.export` would do here)."""
    return bool(jax.extend.backend.get_backend().serialize_with_sdy)


def _checked_module(pfunc: PFunction, module: bytes) -> tuple[bytes, tuple[CustomCall, ...]]:
    """The StableHLO `module` as a fresh helper process parsed and wrote it again, so this
    process never parses bytes that could crash it (see module_check), and its custom
    calls."""
    try:
        checked = _CHECKER.check(module, with_sdy=serialize_with_sdy())
    except ModuleRefused as exc:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: fn_body ({len(pfunc.fn_body)} bytes) holds a StableHLO module "
            f"this party does not load: {exc}"
        ) from None
    return checked.bytecode, checked.custom_calls


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


def _compile(
    pfunc: PFunction, jitted: Any, exported: jax_export.Exported, x64: bool
) -> jax.stages.Compiled:
    """Lower and compile at load: the StableHLO module inside the artifact is only decoded
    then, so a corrupt module fails here as an InvalidPFunctionError, not at every call."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals]
    try:
        with jax.enable_x64(True) if x64 else contextlib.nullcontext():
            return jitted.lower(*specs).compile()
    except Exception as exc:
        raise InvalidPFunctionError(
            f"{_where(pfunc)}: fn_body ({len(pfunc.fn_body)} bytes) holds a module that does "
            f"not load ({type(exc).__name__}: {_first_line(exc)})"
        ) from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no detail"


ENV_EXECUTABLES_MB = "MPPLUG_EXECUTABLES_MB"
DEFAULT_EXECUTABLES_MB = 64
"""Compiled executables a process keeps in memory, in MiB of serialized code (about 20,000
memory maps on CPU; the kernel's default limit is 65,530)."""


def executables_budget() -> int:
    """Bytes of executables each cache keeps: `MPPLUG_EXECUTABLES_MB` (default 64 MiB)."""
    value = os.environ.get(ENV_EXECUTABLES_MB, "").strip()
    try:
        mb = float(value) if value else DEFAULT_EXECUTABLES_MB
    except ValueError:
        mb = DEFAULT_EXECUTABLES_MB
    return max(1, int(mb * 2**20))


def _weight(compiled: CompiledExport) -> int:
    return compiled.size


_PROCESS_CACHE: LRUCache[tuple[str, Any, bool], CompiledExport] = LRUCache(
    DEFAULT_CACHE_SIZE, weigh=_weight, max_weight=executables_budget()
)


_PLANS: LRUCache[tuple[str, Any, bool], CompiledExport] = LRUCache(
    DEFAULT_CACHE_SIZE, weigh=_weight, max_weight=executables_budget()
)
"""Interpreted plans, shared by the runtimes of one process as executables are."""

ENV_INTERPRET = "MPPLUG_INTERPRET"


def interpret_first_runs() -> bool:
    """Whether parties run a program's first run interpreted (`MPPLUG_INTERPRET`, default
    on; `0` compiles every function before the first run)."""
    return os.environ.get(ENV_INTERPRET, "1").strip().lower() not in ("0", "false", "no", "off")


def _shared_load(pfunc: PFunction, runtime: KernelRuntime) -> CompiledExport:
    """Runtimes of one process bound to the same device (simulated parties) share one
    compiled executable per digest instead of compiling it once each."""
    key = (pfunc.digest, runtime.resolved_device(), runtime.untrusted_artifacts)
    return _PROCESS_CACHE.get_or_create(key, lambda: load(pfunc, runtime))


def _shared_first_tier(pfunc: PFunction, runtime: KernelRuntime) -> CompiledExport:
    """The executable this process compiled already, else one from the persistent cache or
    an interpreted plan (shared as executables are), else a compiled one."""
    key = (pfunc.digest, runtime.resolved_device(), runtime.untrusted_artifacts)
    found = _PROCESS_CACHE.get(key)
    if found is not None:
        return found

    def make() -> CompiledExport:  # another runtime may have moved it there meanwhile
        found = _PROCESS_CACHE.get(key)
        return found if found is not None else load(pfunc, runtime, interpret=True)

    first = _PLANS.get_or_create(key, make)
    if not first.interpreted:  # from the persistent cache, or not interpretable: kept once
        _PROCESS_CACHE.put(key, first)
        _PLANS.discard(key)
    return first


def check_jax_exec(pfuncs: Sequence[PFunction], runtime: KernelRuntime) -> None:
    """Before one program's functions are readied: the StableHLO modules of those that a
    party trusting no artifact will parse (not loaded here yet, nor compiled on disk) are
    checked together in one fork of the module-check helper instead of one fork each.
    What fails here is left to each function's own load, which names it."""
    if not runtime.untrusted_artifacts:
        return
    disk, device = disk_cache(), runtime.resolved_device()
    target = device if device is not None else jax.devices()[0]
    modules = []
    for pfunc in pfuncs:
        key = (pfunc.digest, device, runtime.untrusted_artifacts)
        if key in _PROCESS_CACHE or key in _PLANS:
            continue
        if disk is not None and disk.path(_disk_key(pfunc, target, runtime)).exists():
            continue
        try:
            modules.append(_header(pfunc).mlir_module_serialized)
        except InvalidPFunctionError:
            continue
    _CHECKER.check_together(modules, with_sdy=serialize_with_sdy())


def prepare_jax_exec(pfunc: PFunction, runtime: KernelRuntime) -> None:
    """Ready `pfunc` for `runtime` ahead of its first call: interpreted where it can run so
    and is not compiled yet (see `interpret_first_runs`), else compiled."""
    if interpret_first_runs():
        with collection_paused():  # a plan is many objects made at once
            _cached(pfunc, runtime, _shared_first_tier)
    else:
        _compiled(pfunc, runtime)


def tier_up_jax_exec(pfunc: PFunction, runtime: KernelRuntime) -> None:
    """Replace the interpreted plan `runtime` runs for `pfunc` by its compiled executable."""
    cache = runtime.cache(CACHE_NAMESPACE, _weight, executables_budget())
    current = cache.get(pfunc.digest)
    if current is None or not current.interpreted:
        return
    compiled = _shared_load(pfunc, runtime)
    cache.put(pfunc.digest, compiled)
    runtime.direct_calls[pfunc.digest] = DirectCall(compiled.call, len(pfunc.ins_info), cache.touch)
    if pfunc.digest not in cache:  # evicted by another thread just before: none stale
        runtime.direct_calls.pop(pfunc.digest, None)


def _compiled(pfunc: PFunction, runtime: KernelRuntime) -> CompiledExport:
    return _cached(pfunc, runtime, _shared_load)


def _cached(
    pfunc: PFunction,
    runtime: KernelRuntime,
    make: Callable[[PFunction, KernelRuntime], CompiledExport],
) -> CompiledExport:
    """What `runtime` runs for `pfunc` (made by `make` when it has none), offered to
    `invoke` as the PFunction's direct call."""
    cache = runtime.cache(CACHE_NAMESPACE, _weight, executables_budget())
    compiled: CompiledExport = cache.get_or_create(pfunc.digest, lambda: make(pfunc, runtime))
    if pfunc.digest not in runtime.direct_calls:
        runtime.direct_calls[pfunc.digest] = DirectCall(
            compiled.call, len(pfunc.ins_info), cache.touch
        )
        if pfunc.digest not in cache:  # evicted by another thread just before: none stale
            runtime.direct_calls.pop(pfunc.digest, None)
    return compiled


def run_jax_exec(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> tuple[Any, ...]:
    """The kernel: outputs stay on the runtime's device as JAX arrays. It offers `invoke` the
    compiled function as the PFunction's direct call on this runtime."""
    return _compiled(pfunc, runtime).call(*args)


run_jax_exec.check = check_jax_exec  # type: ignore[attr-defined]
run_jax_exec.prepare = prepare_jax_exec  # type: ignore[attr-defined]
run_jax_exec.tier_up = tier_up_jax_exec  # type: ignore[attr-defined]
