"""Rules that move or relabel values: stop_gradient, stack, and convert_element_type: a shift
for int to float, one bit-to-arithmetic conversion for bool, a sign split and truncation for
float to int (rounding toward zero as JAX does), a test against zero for anything to bool, and
for an integer into a narrower or differently signed one, its bits reweighed (`bits`), wrapped
as JAX wraps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn

from mpplug.mpc.protocol import Shares
from mpplug.mpc.rules import rule
from mpplug.mpc.rules.bits import from_bits, value_weights, width_of
from mpplug.mpc.secret import Secret, Value, is_float

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter


@rule("stop_gradient")
def _stop_gradient(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Value:
    """No gradient flows through it: on shares it is the value itself."""
    return values[0]


@rule("split")
def _split(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> list[Secret]:
    """`jnp.split`: slices of each share, either kind of shares."""
    (x,) = values
    axis = int(eqn.params["axis"])
    parts, start = [], 0
    for index, size in enumerate(int(n) for n in eqn.params["sizes"]):
        piece = self.protocol.local(
            lambda s, b=start, z=size: lax.slice_in_dim(s, b, b + z, axis=axis), x.shares
        )
        parts.append(self.out(eqn, piece, boolean=x.boolean, index=index))
        start += size
    return parts


@rule("stack")
def _stack(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """`jnp.stack`: boolean shares stacked as they are when every operand is a secret bit;
    otherwise as `concatenate` (public operands lifted)."""
    if all(isinstance(v, Secret) and v.boolean for v in values):
        shares = [v.shares for v in values]
        stacked = self.bind_on_shares(eqn, values, list(range(len(values))), shares)
        return self.out(eqn, stacked, boolean=True)
    return self.linear(eqn, values, None)


@rule("convert_element_type")
def _convert(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Value:
    (x,) = values
    new = np.dtype(eqn.params["new_dtype"])
    if new == np.bool_:
        if x.dtype == np.bool_:
            return self.out(eqn, x.shares, boolean=x.boolean)
        (nonzero,) = self.eval_as(lambda v: v != 0, [x])
        return nonzero
    if x.boolean:
        return self.out(eqn, self.arith(x, new))
    if is_float(x.dtype) and is_float(new):
        return self.out(eqn, x.shares)
    if is_float(new):
        return self.out(eqn, x.shares << np.uint64(self.ctx.frac_bits))
    if is_float(x.dtype):
        return self.out(eqn, _toward_zero(self, x.shares))
    if _holds(new, x.dtype):
        return self.out(eqn, x.shares)
    # a narrower or differently signed integer: its own w bits, wrapped as JAX wraps
    bits = self.protocol.low_bits(self.ctx, x.shares, width_of(new))
    return self.out(eqn, from_bits(self, bits, new, value_weights(new)))


def _holds(new: np.dtype[Any], old: np.dtype[Any]) -> bool:
    """Every `old` integer (or bool) is a `new` integer."""
    if old == np.bool_:
        return True
    return bool(np.can_cast(old, new, casting="safe"))


def _toward_zero(self: Interpreter, x: Shares) -> Shares:
    """Fixed point to integer, rounding toward zero as JAX does (24 rounds): split off the
    sign, truncate |x| (off by at most one up), correct with one comparison, sign back."""
    f = self.ctx.frac_bits
    negative = self.fx.is_negative(x)
    magnitude = x - (self.protocol.mul(self.ctx, negative, x) << np.uint64(1))
    whole = self.protocol.trunc(self.ctx, magnitude, f)
    whole = whole - self.fx.is_negative(magnitude - (whole << np.uint64(f)))
    return whole - (self.protocol.mul(self.ctx, negative, whole) << np.uint64(1))
