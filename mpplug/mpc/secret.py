"""Secret values inside a share program (shares plus the logical type) and the few helpers
every secure rule uses to read an equation's output type and line shares up with it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from mpplug.mpc.protocol import Shares


@dataclass(frozen=True)
class Secret:
    """Shares of a tensor of logical `shape` and `dtype`; `boolean`: XOR shares of bit 0;
    `wide`: an integer narrower than 64 bits whose ring value may lie beyond its dtype's
    range (a sum or product JAX wraps at the width), right only modulo 2^width."""

    shares: Shares
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    boolean: bool = False
    wide: bool = False


Value = Any  # Secret or a public array

UNSUPPORTED_HINT = (
    "write the computation with supported primitives (see docs/mpc.md), or reveal the value"
)


def is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def is_narrow_int(dtype: Any) -> bool:
    """An integer dtype narrower than the ring (its sums and products wrap before 2^64)."""
    dtype = np.dtype(dtype)
    return dtype.kind in "iu" and dtype.itemsize < 8


def out_aval(eqn: JaxprEqn, index: int = 0) -> Any:
    """The abstract value (shape, dtype) of an equation's output."""
    return eqn.outvars[index].aval


def broadcast_shares(shares: Shares, shape: Sequence[int]) -> Shares:
    """Shares (share axis first) broadcast to `shape` as numpy aligns trailing axes."""
    value_shape = shares.shape[1:]
    padded = (1,) * (len(shape) - len(value_shape)) + tuple(value_shape)
    return jnp.broadcast_to(shares.reshape(shares.shape[0], *padded), (shares.shape[0], *shape))


def traced_as(role: Any, value: Any) -> Any:
    """`value` as a value of the share program being traced (a constant becomes an equation
    XLA folds away), so that it can be a loop's operand or a share program's output."""
    value = jnp.asarray(value)
    return jnp.where(role < 0, value, value)
