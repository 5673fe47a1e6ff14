"""Reductions to an extremum over an axis (reduce_max/min, argmax/argmin): a tournament of
ceil(log2 n) levels, each one comparison and one selection (11 rounds per level); ties keep the
lower index, as numpy does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
from jax.extend.core import JaxprEqn

from mpplug.mpc.protocol import Shares
from mpplug.mpc.rules import rule
from mpplug.mpc.rules.comparison import below_arith
from mpplug.mpc.secret import Secret, Value

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter


def reduce_extremum(
    self: Interpreter, shares: Shares, axis: int, largest: bool, with_index: bool, dtype: Any
) -> tuple[Shares, Shares | None]:
    """Tournament over `axis`: ceil(log2 n) levels of one comparison and one selection."""
    x = jnp.moveaxis(shares, axis + 1, -1)
    n = x.shape[-1]
    index = (
        self.protocol.lift(self.ctx, jnp.broadcast_to(jnp.arange(n, dtype=jnp.uint64), x.shape[1:]))
        if with_index
        else None
    )
    while n > 1:
        half = n // 2
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]  # neighbours: ties keep a
        bit = below_arith(self, a, b, dtype) if largest else below_arith(self, b, a, dtype)
        if index is not None:
            ia, ib = index[..., 0 : 2 * half : 2], index[..., 1 : 2 * half : 2]
            chosen = self.protocol.mul(
                self.ctx, jnp.stack([bit, bit], 1), jnp.stack([b - a, ib - ia], 1)
            )
            merged, merged_index = a + chosen[:, 0], ia + chosen[:, 1]
            index = jnp.concatenate([merged_index, index[..., 2 * half :]], axis=-1)
        else:
            merged = a + self.protocol.mul(self.ctx, bit, b - a)
        x = jnp.concatenate([merged, x[..., 2 * half :]], axis=-1)
        n = x.shape[-1]
    return x[..., 0], (None if index is None else index[..., 0])


@rule("reduce_max", "reduce_min")
def _reduce_max(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x = self.arith(values[0], values[0].dtype)
    for axis in sorted(eqn.params["axes"], reverse=True):
        largest = eqn.primitive.name == "reduce_max"
        x, _ = reduce_extremum(self, x, axis, largest, False, values[0].dtype)
    return self.out(eqn, x)


@rule("argmax", "argmin")
def _argmax(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (axis,) = eqn.params["axes"]
    x = self.arith(values[0], values[0].dtype)
    largest = eqn.primitive.name == "argmax"
    _, index = reduce_extremum(self, x, axis, largest, True, values[0].dtype)
    assert index is not None
    return self.out(eqn, index)
