"""`invoke`: check arguments against a PFunction's `ins_info` and run its kernel.

The single entry point through which interpreters and users run PFunctions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpplug.core import PFunction
from mpplug.errors import ArgumentMismatchError, InvalidPFunctionError
from mpplug.kernels.registry import REGISTRY
from mpplug.kernels.runtime import KernelRuntime, default_runtime


def _check_arguments(pfunc: PFunction, args: tuple[Any, ...]) -> tuple[Any, ...]:
    expected = pfunc.ins_info
    if len(args) != len(expected):
        raise ArgumentMismatchError(
            f"{pfunc.fn_name!r} expects {len(expected)} argument(s) "
            f"({', '.join(map(str, expected))}), got {len(args)}"
        )
    checked = list(args)
    for i, (arg, ttype) in enumerate(zip(args, expected, strict=True)):
        if not hasattr(arg, "dtype") or not hasattr(arg, "shape"):
            arg = checked[i] = np.asarray(arg)
        if tuple(arg.shape) != ttype.shape or arg.dtype != ttype.dtype.numpy:
            got = f"{np.dtype(arg.dtype).name}{list(arg.shape)}"
            raise ArgumentMismatchError(
                f"{pfunc.fn_name!r} argument {i}: expected {ttype}, got {got}"
            )
    return tuple(checked)


def invoke(pfunc: PFunction, *args: Any, runtime: KernelRuntime | None = None) -> tuple[Any, ...]:
    """Run `pfunc` on `args` with the kernel registered for its `fn_type`.

    Returns exactly `len(pfunc.outs_info)` arrays. `runtime` is the party's state; None means
    the process's default single-party runtime.
    """
    checked = _check_arguments(pfunc, args)
    kernel = REGISTRY.lookup(pfunc.fn_type)
    outs = kernel(pfunc, checked, runtime or default_runtime())
    if len(outs) != len(pfunc.outs_info):
        raise InvalidPFunctionError(
            f"kernel {pfunc.fn_type!r} returned {len(outs)} output(s) for {pfunc.fn_name!r}, "
            f"which declares {len(pfunc.outs_info)}"
        )
    return tuple(outs)
