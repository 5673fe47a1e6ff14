"""Rules that move or relabel values without arithmetic: stop_gradient, stack, and
convert_element_type (a shift for int to float, one bit-to-arithmetic conversion for bool, a
sign split and truncation for float to int, rounding toward zero as JAX does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from jax.extend.core import JaxprEqn

from mpplug.errors import TraceError
from mpplug.mpc.protocol import Shares
from mpplug.mpc.rules import rule
from mpplug.mpc.secret import Secret, Value, is_float

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter


@rule("stop_gradient")
def _stop_gradient(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Value:
    """No gradient flows through it: on shares it is the value itself."""
    return values[0]


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
def _convert(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    new = np.dtype(eqn.params["new_dtype"])
    if new == np.bool_:
        if x.dtype == np.bool_:
            return self.out(eqn, x.shares, boolean=x.boolean)
        raise TraceError(
            f"{self.where}: converting a secret {x.dtype} to bool is not supported; "
            f"compare it instead (x != 0)"
        )
    if x.boolean:
        return self.out(eqn, self.arith(x, new))
    if is_float(x.dtype) == is_float(new):
        return self.out(eqn, x.shares)
    if is_float(new):
        return self.out(eqn, x.shares << np.uint64(self.ctx.frac_bits))
    return self.out(eqn, _toward_zero(self, x.shares))


def _toward_zero(self: Interpreter, x: Shares) -> Shares:
    """Fixed point to integer, rounding toward zero as JAX does (24 rounds): split off the
    sign, truncate |x| (off by at most one up), correct with one comparison, sign back."""
    f = self.ctx.frac_bits
    negative = self.fx.is_negative(x)
    magnitude = x - (self.protocol.mul(self.ctx, negative, x) << np.uint64(1))
    whole = self.protocol.trunc(self.ctx, magnitude, f)
    whole = whole - self.fx.is_negative(magnitude - (whole << np.uint64(f)))
    return whole - (self.protocol.mul(self.ctx, negative, whole) << np.uint64(1))
