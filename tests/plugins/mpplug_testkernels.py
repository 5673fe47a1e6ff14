"""Test kernels shipped as a tiny third-party plugin (found through its entry points).

`test.sleep` holds a party up; `test.fail` raises inside a kernel, as a buggy plugin would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mpplug.core import DType, PFunction, TensorType

SCALAR = TensorType(DType.FLOAT32, ())


def sleep_pfunction(seconds: float) -> PFunction:
    """f32[] -> f32[]: sleeps `seconds`, then returns its input."""
    return PFunction("test.sleep", "sleep", b"", (SCALAR,), (SCALAR,), {"seconds": seconds})


def fail_pfunction(message: str) -> PFunction:
    """f32[] -> f32[]: raises ValueError(message)."""
    return PFunction("test.fail", "fail", b"", (SCALAR,), (SCALAR,), {"message": message})


def run_sleep(pfunc: PFunction, args: Sequence[Any], runtime: Any) -> list[Any]:
    seconds = pfunc.attrs["seconds"]
    assert isinstance(seconds, float)
    time.sleep(seconds)
    return list(args)


def run_fail(pfunc: PFunction, args: Sequence[Any], runtime: Any) -> list[Any]:
    raise ValueError(str(pfunc.attrs["message"]))
