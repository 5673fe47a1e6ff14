"""`jax_export`: turn a JAX function and example arguments into a `jax.exec` PFunction.

Array-like leaves become runtime inputs; every other leaf is baked in as a constant.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax import export as jax_export_module
from jax.extend.core import jaxpr_as_fun
from jax.tree_util import PyTreeDef

from mpplug.core import PFunction, TensorType
from mpplug.core.custom_calls import module_targets
from mpplug.errors import InvalidPFunctionError, TraceError
from mpplug.kernels import jax_exec
from mpplug.kernels.compile_cache import arrays_digest, cache_key, disk_cache, source_digest

jax_config_states: Any
try:  # private, thread-local config states; without them digests depend on the call site
    from jax._src import config as jax_config_states
except ImportError:  # pragma: no cover - layout of a future JAX
    jax_config_states = None


def is_array_like(leaf: Any) -> bool:
    """Leaves with `.shape` and `.dtype` are runtime inputs (arrays, specs, party values);
    typed PRNG keys (`jax.random.key`) are not: they are baked in like other constants."""
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype") and not _is_key(leaf.dtype)


def _is_key(dtype: Any) -> bool:
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


@contextlib.contextmanager
def _reproducible_locations() -> Iterator[None]:
    """Thread-local: keep only each op's own source line, with directories stripped.

    Without this the artifact embeds the caller's stack, so equal functions exported from
    different call sites (or install paths) would get different digests.
    """
    if jax_config_states is None:  # pragma: no cover - layout of a future JAX
        yield
        return
    with (
        jax_config_states.include_full_tracebacks_in_locations(False),
        jax_config_states.hlo_source_file_canonicalization_regex(r".*/"),
    ):
        yield


@contextlib.contextmanager
def _x64_if(needed: bool) -> Iterator[None]:
    if needed and not jax.config.read("jax_enable_x64"):
        with jax.enable_x64(True):
            yield
    else:
        yield


def jax_export(
    fn: Callable[..., Any],
    *args: Any,
    platforms: Sequence[str] | None = None,
    disk: bool = True,
    **kwargs: Any,
) -> tuple[PFunction, list[Any], PyTreeDef]:
    """Export `fn(*args, **kwargs)` once into a PFunction.

    With `disk`, the export is looked up in (and added to) the persistent compile cache, by
    the function's jaxpr (traced first: cheaper than lowering), so a second process skips
    lowering it; a jaxpr that names a Python function's address is never cached.

    Returns `(pfunc, in_vars, out_tree)`: `in_vars` are the array-like leaves of
    `(args, kwargs)` in flattening order (the PFunction's inputs), and `out_tree` rebuilds
    the output pytree from the PFunction's flat outputs. 64-bit types are kept whether or
    not the process enabled `jax_enable_x64`, for inputs and for any dtype the function
    asks for (`jnp.uint64(1)`, `x.astype(jnp.int64)`), where JAX would truncate them; other
    dtypes default as JAX's do. No global config is changed.
    """
    leaves, in_tree = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if is_array_like(leaf)]
    in_vars = [leaves[i] for i in dynamic]
    try:
        in_types = [TensorType(v.dtype, v.shape) for v in in_vars]
    except Exception as exc:
        raise TraceError(f"{function_name(fn)}: unsupported input: {exc}") from None
    out_trees: list[PyTreeDef] = []

    def flat_fn(*values: Any) -> tuple[Any, ...]:
        full = list(leaves)
        for i, value in zip(dynamic, values, strict=True):
            full[i] = value
        call_args, call_kwargs = jax.tree.unflatten(in_tree, full)
        out_leaves, out_tree = jax.tree.flatten(fn(*call_args, **call_kwargs))
        out_trees.append(out_tree)
        return tuple(out_leaves)

    flat_fn.__name__ = flat_fn.__qualname__ = function_name(fn)
    x64 = bool(jax.config.read("jax_enable_x64")) or any(t.dtype.is_64bit for t in in_types)
    specs = [jax.ShapeDtypeStruct(t.shape, t.dtype.numpy) for t in in_types]
    target = _platforms(fn, platforms)
    closed = _traced(flat_fn, specs, x64) if disk and disk_cache() is not None else None
    key = _disk_key(closed, flat_fn.__name__, specs, target, x64) if closed else None
    if key is not None:
        found = _from_disk(key, function_name(fn), in_types)
        if found is not None:
            return found, in_vars, out_trees[-1]
    if closed is not None:  # export what was traced: the user's function runs once
        exported = _export(_as_function(closed, flat_fn.__name__), specs, target, x64)
    else:
        exported = _export(flat_fn, specs, target, x64)
    if not x64 and exported is None:  # the function asked for a 64-bit type: honour it
        x64 = True
        out_trees.clear()
        exported = _export(flat_fn, specs, target, x64)
    assert exported is not None
    with _x64_if(x64), _reproducible_locations():
        try:
            outs_info = tuple(TensorType(a.dtype, a.shape) for a in exported.out_avals)
        except Exception as exc:
            raise TraceError(f"{function_name(fn)}: unsupported output: {_explain(exc)}") from None
        body = bytes(exported.serialize())
    if not out_trees:
        raise InvalidPFunctionError(f"{function_name(fn)}: export did not trace the function")
    attrs = {
        jax_exec.ATTR_JAX_VERSION: jax.__version__,
        jax_exec.ATTR_CALLING_CONVENTION: exported.calling_convention_version,
        jax_exec.ATTR_PLATFORMS: tuple(exported.platforms),
        jax_exec.ATTR_KEPT_INPUTS: tuple(sorted(exported.module_kept_var_idx)),
        jax_exec.ATTR_X64: x64,
    }
    targets = module_targets(exported)
    if targets:  # what a party checks against its custom-call policy at load
        attrs[jax_exec.ATTR_CUSTOM_CALLS] = targets
    pfunc = PFunction(jax_exec.FN_TYPE, function_name(fn), body, tuple(in_types), outs_info, attrs)
    cache = disk_cache() if key is not None else None
    if cache is not None and key is not None:
        cache.put(key, pfunc.to_bytes())
    return pfunc, in_vars, out_trees[-1]


def _traced(flat_fn: Callable[..., Any], specs: list[Any], x64: bool) -> Any:
    """`flat_fn`'s closed jaxpr, or None where the plain export path must run (the trace
    fails, or warns that a 64-bit type would be truncated without x64)."""
    with _x64_if(x64), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            closed = jax.make_jaxpr(flat_fn)(*specs)
        except Exception:  # the export raises it, with its own message
            return None
    if any(_TRUNCATION in str(w.message) for w in caught):
        return None
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return closed


def _as_function(closed: Any, name: str) -> Callable[..., Any]:
    def traced(*args: Any) -> tuple[Any, ...]:
        return tuple(jaxpr_as_fun(closed)(*args))

    traced.__name__ = traced.__qualname__ = name
    return traced


def _disk_key(
    closed: Any, name: str, specs: list[Any], target: tuple[str, ...] | None, x64: bool
) -> bytes | None:
    """The persistent cache's key for an export: its jaxpr and everything else it depends
    on; None for a jaxpr that names a Python function's address (another process's differs)."""
    text = str(closed.jaxpr)
    try:
        consts = arrays_digest(closed.consts)
    except TypeError:  # constants numpy cannot hold (typed PRNG keys): not cached
        return None
    if " at 0x" in text:
        return None
    return cache_key(
        "jax_export",
        source_digest(),
        jax.__version__,
        jax_exec.jaxlib_version(),
        text,
        consts,
        repr([(s.shape, str(s.dtype)) for s in specs]),
        repr(target),
        str(x64),
        name,
    )


def _from_disk(key: bytes, name: str, in_types: list[TensorType]) -> PFunction | None:
    cache = disk_cache()
    payload = cache.get(key) if cache is not None else None
    if payload is None:
        return None
    try:
        pfunc = PFunction.from_bytes(payload)
    except Exception:
        return None
    if pfunc.fn_name != name or pfunc.ins_info != tuple(in_types):
        return None
    return pfunc


def _export(
    flat_fn: Callable[..., Any], specs: list[Any], target: tuple[str, ...] | None, x64: bool
) -> jax_export_module.Exported | None:
    """The export of `flat_fn`, or None when, without x64, JAX would truncate a 64-bit dtype
    the function explicitly asks for (JAX only warns about it) or a constant overflows."""
    with _x64_if(x64), _reproducible_locations(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            exported = jax_export_module.export(jax.jit(flat_fn), platforms=target)(*specs)
        except OverflowError:  # a 64-bit constant (jnp.uint64(2**40)) without x64
            if x64:
                raise
            return None
    truncated = [w for w in caught if _TRUNCATION in str(w.message)]
    for w in caught:
        if w not in truncated:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return None if truncated and not x64 else exported


_TRUNCATION = "is not available, and will be truncated"
"""What JAX's UserWarning says when jax_enable_x64 is off and a 64-bit dtype is asked for."""


def _explain(exc: Exception) -> str:
    text = str(exc)
    if "key<" in text:
        text += (
            "; typed PRNG keys cannot leave a PFunction: return jax.random.key_data(key) "
            "and rebuild it with jax.random.wrap_key_data(data) where it is used"
        )
    return text


EXPORT_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def _platforms(fn: Callable[..., Any], platforms: Sequence[str] | None) -> tuple[str, ...] | None:
    """Validate `platforms`: None (the host's default backend), one name, or several."""
    if platforms is None:
        return None
    names = (platforms,) if isinstance(platforms, str) else tuple(platforms)
    unknown = [p for p in names if p not in EXPORT_PLATFORMS]
    if not names or unknown or len(set(names)) != len(names):
        raise TraceError(
            f"{function_name(fn)}: expected platforms to be distinct names among "
            f"{', '.join(EXPORT_PLATFORMS)}, got {platforms!r}"
        )
    return names


def function_name(fn: Callable[..., Any]) -> str:
    """A function's name for messages and PFunction records ("lambda" for lambdas)."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "lambda" if name == "<lambda>" else name
