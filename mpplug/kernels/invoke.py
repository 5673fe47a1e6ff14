"""`invoke`: check arguments against a PFunction's `ins_info` and run its kernel.

The single entry point through which interpreters and users run PFunctions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpplug.core import PFunction, TableType, TensorType
from mpplug.errors import ArgumentMismatchError, InvalidPFunctionError
from mpplug.kernels.registry import REGISTRY
from mpplug.kernels.runtime import KernelRuntime, default_runtime

_JaxArray: Any
try:  # the concrete JAX array type: arguments of exactly this type may take a direct call
    from jax._src.array import ArrayImpl as _JaxArray
except ImportError:  # pragma: no cover - layout of a future JAX: every call goes to the kernel
    _JaxArray = None


def _describe(arg: Any) -> str:
    """An argument's type as `f32[2,3]`, or as numpy spells an unsupported dtype."""
    try:
        return str(TensorType(arg.dtype, arg.shape))
    except Exception:  # a dtype outside the supported set (e.g. big-endian), or a bad shape
        try:
            return f"{np.dtype(arg.dtype).str}[{','.join(map(str, arg.shape))}]"
        except Exception:
            return f"{type(arg).__name__} with dtype {arg.dtype!r} and shape {arg.shape!r}"


def _mismatch(pfunc: PFunction, i: int, arg: Any) -> ArgumentMismatchError:
    return ArgumentMismatchError(
        f"{pfunc.fn_name!r} argument {i}: expected {pfunc.ins_info[i]}, got {_describe(arg)}"
    )


def _checked_table(pfunc: PFunction, i: int, arg: Any, expected: TableType) -> Any:
    from mpplug.tables import arrow

    try:
        return arrow.conform(arg, expected, f"{pfunc.fn_name!r} argument {i}")
    except ValueError as exc:
        raise ArgumentMismatchError(str(exc)) from None


def _check_arguments(pfunc: PFunction, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments, non-arrays converted with `np.asarray`, once each matches `ins_info`.

    This runs on every call, so the common case (arrays of the right type) does no more than
    compare each argument's shape and dtype.
    """
    expected = pfunc.ins_info
    if len(args) != len(expected):
        raise ArgumentMismatchError(
            f"{pfunc.fn_name!r} expects {len(expected)} argument(s) "
            f"({', '.join(map(str, expected))}), got {len(args)}"
        )
    checked: list[Any] | None = None
    for i, arg in enumerate(args):
        ttype = expected[i]
        if isinstance(ttype, TableType):
            if checked is None:
                checked = list(args)
            checked[i] = _checked_table(pfunc, i, arg, ttype)
            continue
        try:
            shape, dtype = arg.shape, arg.dtype
        except AttributeError:
            arg = np.asarray(arg)
            shape, dtype = arg.shape, arg.dtype
            if checked is None:
                checked = list(args)
            checked[i] = arg
        if dtype != ttype.dtype.numpy or (shape != ttype.shape and tuple(shape) != ttype.shape):
            raise _mismatch(pfunc, i, arg)
    return args if checked is None else tuple(checked)


def invoke(pfunc: PFunction, *args: Any, runtime: KernelRuntime | None = None) -> tuple[Any, ...]:
    """Run `pfunc` on `args` with the kernel registered for its `fn_type`.

    Returns exactly `len(pfunc.outs_info)` arrays. `runtime` is the party's state; None means
    the process's default single-party runtime.

    A warm call whose arguments are all JAX arrays, or numpy arrays of exactly the declared
    dtype and shape, goes straight to the `DirectCall` the kernel left in
    `runtime.direct_calls` (for `jax.exec`, the jitted function, where JAX itself checks
    JAX arrays against the artifact); anything else is checked here first.
    """
    if runtime is None:
        runtime = default_runtime()
    digest = pfunc.digest
    direct = runtime.direct_calls.get(digest)
    if direct is not None and len(args) == direct.n_ins:
        for i, arg in enumerate(args):  # inline, like the rest of this path: each call costs
            if type(arg) is _JaxArray:
                continue
            if type(arg) is not np.ndarray:  # a value received from a peer is an ndarray
                break
            expected = pfunc.ins_info[i]  # JAX would take other byte orders: checked here
            if not isinstance(expected, TensorType) or not (
                arg.dtype == expected.dtype.numpy and arg.shape == expected.shape
            ):
                break
        else:
            try:
                direct.touch(digest)
            except KeyError:  # the kernel's cache dropped it since: the kernel loads it again
                runtime.direct_calls.pop(digest, None)
            else:
                try:
                    return direct.call(*args)
                except (ValueError, TypeError):
                    _check_arguments(pfunc, args)  # an ArgumentMismatchError if JAX refused them
                    raise
    checked = _check_arguments(pfunc, args)
    kernel = REGISTRY.lookup(pfunc.fn_type)
    outs = kernel(pfunc, checked, runtime)
    if len(outs) != len(pfunc.outs_info):
        raise InvalidPFunctionError(
            f"kernel {pfunc.fn_type!r} returned {len(outs)} output(s) for {pfunc.fn_name!r}, "
            f"which declares {len(pfunc.outs_info)}"
        )
    return tuple(outs)
