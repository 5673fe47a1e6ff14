"""Comparisons, selection and the functions built on them: a < b is the sign (most significant
bit) of a - b, extracted by a boolean adder over XOR shares (8 rounds, 33 bytes per element);
selecting between two values multiplies a bit, converted to arithmetic shares, by their
difference (3 more rounds, 24 bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from mpplug.mpc import ring
from mpplug.mpc.protocol import Shares
from mpplug.mpc.rules import NAMED_FUNCTIONS, rule
from mpplug.mpc.rules.bits import not_bit
from mpplug.mpc.secret import Secret, Value, broadcast_shares, is_float, out_aval

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter


def difference(self: Interpreter, x: Value, y: Value, shape: Sequence[int]) -> Shares:
    dtype = x.dtype if isinstance(x, Secret) else y.dtype
    return self.arith(x, dtype, shape) - self.arith(y, dtype, shape)


def full_range(dtype: Any) -> bool:
    """64-bit integers: their differences can overflow the ring's signed range."""
    return bool(jnp.issubdtype(dtype, jnp.integer)) and np.dtype(dtype).itemsize == 8


def below(self: Interpreter, a: Shares, b: Shares, dtype: Any) -> Shares:
    """XOR shares (bit 0) of a < b for arithmetic shares of `dtype` values.

    Reals and integers up to 32 bits: the sign of a - b, which cannot overflow (8 rounds).
    64-bit integers: signs of a, b and a - b in one batch, then a - b's sign corrected where
    a and b differ in sign, lt = s_d ^ ((s_a ^ s_b) & (s_a ^ s_d)): exact over the whole
    range for one AND round more (9 rounds, three times the sign's bytes). Unsigned 64-bit
    values are compared as signed ones after adding 2^63 to both.
    """
    if not full_range(dtype):
        return self.protocol.msb(self.ctx, a - b)
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        top = self.protocol.lift(self.ctx, jnp.full(a.shape[1:], 1 << 63, ring.RING))
        a, b = a + top, b + top
    signs = self.protocol.msb(self.ctx, jnp.stack([a, b, a - b], axis=1))
    s_a, s_b, s_d = signs[:, 0], signs[:, 1], signs[:, 2]
    return s_d ^ self.protocol.and_(self.ctx, s_a ^ s_b, s_a ^ s_d, bits=1)


def below_arith(self: Interpreter, a: Shares, b: Shares, dtype: Any) -> Shares:
    """Arithmetic 0/1 shares of a < b."""
    return self.protocol.b2a(self.ctx, below(self, a, b, dtype))


@rule("lt", "gt", "le", "ge", "lt_to", "le_to")
def _order(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """a < b and its kin; `lt_to` and `le_to` (a total order, for floats' NaNs: fixed point
    has none) are `lt` and `le`."""
    x, y = values
    shape = out_aval(eqn).shape
    name = eqn.primitive.name.removesuffix("_to")
    if name in ("gt", "le"):
        x, y = y, x
    dtype = x.dtype if isinstance(x, Secret) else y.dtype
    bit = remembered_below(self, x, y, dtype, shape)
    if name in ("le", "ge"):
        bit = not_bit(self, bit)
    return self.out(eqn, bit, boolean=True)


@rule("eq", "ne")
def _equality(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x, y = values
    if not isinstance(y, Secret) or not isinstance(x, Secret) or x is not y:
        shape = out_aval(eqn).shape
        d = difference(self, x, y, shape)
        both = self.protocol.msb(self.ctx, jnp.stack([d, -d], axis=1))
        differ = both[:, 0] ^ both[:, 1]  # x < y or y < x, never both
        if full_range(x.dtype if isinstance(x, Secret) else y.dtype):
            # d = -2^63 is its own negation: both signs set. OR instead of XOR (one round).
            differ = differ ^ self.protocol.and_(self.ctx, both[:, 0], both[:, 1], bits=1)
    else:  # x != x is the NaN test; fixed-point values are never NaN
        differ = self.protocol.lift(self.ctx, jnp.zeros(x.shape, ring.RING))
    return self.out(
        eqn, not_bit(self, differ) if eqn.primitive.name == "eq" else differ, boolean=True
    )


@rule("select_n")
def _select_n(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    pred, *cases = values
    aval = out_aval(eqn)
    shares = [self.arith(c, aval.dtype, aval.shape) for c in cases]
    if not isinstance(pred, Secret):
        params = eqn.primitive.get_bind_params(eqn.params)
        return self.out(
            eqn,
            self.protocol.local(lambda *parts: eqn.primitive.bind(pred, *parts, **params), *shares),
        )
    return self.out(eqn, choose(self, pred, shares, aval.shape))


def choose(self: Interpreter, which: Secret, cases: list[Shares], shape: Sequence[int]) -> Shares:
    """Shares of cases[which] for a secret bool or an index in [0, n), elementwise (a scalar
    index picks whole cases). Two cases: which times their difference (the bit to arithmetic
    and one product: 3 rounds). More: a one-hot of which by n equality tests side by side
    (8 rounds), the bits to arithmetic, and one product per case, summed (3 rounds)."""
    if len(cases) == 2:
        bit = self.arith(which, np.int64, shape)
        return cases[0] + self.protocol.mul(self.ctx, bit, cases[1] - cases[0])
    index = broadcast_shares(self.arith(which, np.int64), shape)
    n = len(cases)
    candidates = jnp.broadcast_to(
        jnp.arange(n, dtype=ring.RING).reshape(n, *([1] * len(shape))), (n, *shape)
    )
    d = index[:, None] - self.protocol.lift(self.ctx, candidates)
    both = self.protocol.msb(self.ctx, jnp.stack([d, -d], axis=1))
    onehot = self.protocol.b2a(self.ctx, not_bit(self, both[:, 0] ^ both[:, 1]))
    picked = self.protocol.mul(self.ctx, onehot, jnp.stack(cases, axis=1))
    return jnp.sum(picked, axis=1, dtype=ring.RING)


def remembered_below(
    self: Interpreter, x: Value, y: Value, dtype: Any, shape: Sequence[int]
) -> Shares:
    """XOR shares of x < y, computed once per share program for these operands."""
    key = ("below", x, y, np.dtype(dtype).str, tuple(shape))
    return self.remember(
        key, lambda: below(self, self.arith(x, dtype, shape), self.arith(y, dtype, shape), dtype)
    )


@rule("max", "min")
def _extremum(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """max(x, y) is x where y < x, else y (min: x where x < y): the comparison `x > y` or
    `x < y` is then the one a gradient asks for again, and is computed once."""
    aval = out_aval(eqn)
    x, y = values
    first, second = (y, x) if eqn.primitive.name == "max" else (x, y)
    bits = remembered_below(self, first, second, aval.dtype, aval.shape)
    bit = self.arith(Secret(bits, tuple(aval.shape), np.dtype(np.bool_), True), np.int64)
    a, b = self.arith(x, aval.dtype, aval.shape), self.arith(y, aval.dtype, aval.shape)
    return self.out(eqn, b + self.protocol.mul(self.ctx, bit, a - b))


@rule("abs")
def _abs(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x = self.arith(values[0], values[0].dtype)
    bit = self.fx.is_negative(x)
    return self.out(eqn, x - (self.protocol.mul(self.ctx, bit, x) << np.uint64(1)))


@rule("sign")
def _sign(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x = self.arith(values[0], values[0].dtype)
    signs = self.protocol.msb(self.ctx, jnp.stack([-x, x], axis=1))  # (x > 0, x < 0)
    if jnp.issubdtype(values[0].dtype, jnp.unsignedinteger):  # 0 or 1: x != 0, an OR
        both = self.protocol.and_(self.ctx, signs[:, 0], signs[:, 1], bits=1)
        return self.out(eqn, self.protocol.b2a(self.ctx, signs[:, 0] ^ signs[:, 1] ^ both))
    if full_range(values[0].dtype):  # -2^63 is its own negation: not positive
        both = self.protocol.and_(self.ctx, signs[:, 0], signs[:, 1], bits=1)
        signs = jnp.stack([signs[:, 0] ^ both, signs[:, 1]], axis=1)
    bits = self.protocol.b2a(self.ctx, signs)
    sign = bits[:, 0] - bits[:, 1]
    if is_float(values[0].dtype):
        sign = sign << np.uint64(self.ctx.frac_bits)
    return self.out(eqn, sign)


@rule("clamp")
def _clamp(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """clamp(lo, x, hi) = min(max(x, lo), hi): two comparisons in sequence."""
    lo, x, hi = values
    aval = out_aval(eqn)
    shares = self.arith(x, aval.dtype, aval.shape)
    for bound, keep_larger in ((lo, True), (hi, False)):
        limit = self.arith(bound, aval.dtype, aval.shape)
        below = below_arith(self, shares, limit, aval.dtype)
        if keep_larger:
            shares = shares + self.protocol.mul(self.ctx, below, limit - shares)
        else:
            shares = limit + self.protocol.mul(self.ctx, below, shares - limit)
    return self.out(eqn, shares)


NAMED_FUNCTIONS["signbit"] = lambda x: x < 0  # jnp.signbit (and copysign) reads float bits


@rule("nextafter")
def _nextafter(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Value:
    """The fixed-point neighbour of x toward y: x plus or minus 2^-f, or x where y = x (two
    comparisons and selections; adding a public step is exact). A float's neighbour is
    nearer, so the result is within 2^-f of numpy's."""
    step = 2.0**-self.ctx.frac_bits
    (out,) = self.eval_as(
        lambda x, y: jnp.where(y > x, x + step, jnp.where(y < x, x - step, x)), values
    )
    return out
