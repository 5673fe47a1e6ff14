"""Real functions by fixed-point approximation (exp, log, logistic, tanh, sqrt, rsqrt, log1p,
pow): each is a fixed sequence of secure products and comparisons (see `mpc.approx` for the
methods, after CrypTen's and SPU's); the rounds, bytes and errors are in docs/mpc.md.

Functions written through those by their identities (exp2, expm1, sinh, cosh, asinh, acosh,
atanh, cbrt) cost what their parts cost and keep their parts' input ranges; expm1 near 0 has
exp's absolute error, not a relative one. sin and cos reduce x to a fraction of a turn (a
public product and a floor: exact in fixed point) and sum the Taylor series of sin to degree
17 (nine products); tan is their quotient. atan takes 1/x beyond |x| = 1, one half-angle step
t / (1 + sqrt(1 + t^2)) brings it under tan(pi/8), and its odd Taylor series to degree 17
finishes; asin, acos and atan2 are written through it. erf and erfc follow Abramowitz and
Stegun 7.1.26 (a reciprocal, a degree-5 polynomial and exp(-x^2)) on |x| clipped to 5.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from mpplug.mpc import approx
from mpplug.mpc.fixed import Fxp
from mpplug.mpc.protocol import Shares
from mpplug.mpc.rules import rule
from mpplug.mpc.rules.arithmetic import power, require_float
from mpplug.mpc.secret import Secret, Value, out_aval

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter


_APPROXIMATIONS: dict[str, Callable[[Fxp, Shares], Shares]] = {
    "exp": approx.exp,
    "log": approx.log,
    "logistic": approx.logistic,
    "tanh": approx.tanh,
    "sqrt": approx.sqrt,
    "rsqrt": approx.rsqrt,
}


@rule(*_APPROXIMATIONS)
def _approximation(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    require_float(self, eqn, x.dtype)
    return self.out(eqn, _APPROXIMATIONS[eqn.primitive.name](self.fx, self.arith(x, x.dtype)))


def _sine(x: jax.Array, quarter_turns: float = 0.0) -> jax.Array:
    """sin(x + quarter_turns * pi / 2): the turn count's fraction u in [-1/2, 1/2) (a floor),
    then sin(2 pi u) as its Taylor series in u to degree 17, whose coefficients (2 pi)^(2k+1)
    / (2k+1)! all hold in fixed point (a series in 2 pi u would lose its small ones)."""
    turns = x * float(1.0 / (2.0 * np.pi)) + quarter_turns / 4.0
    u = turns - jnp.floor(turns + 0.5)
    v = u * u
    series = jnp.zeros_like(u)
    for k in range(8, -1, -1):
        series = series * v + float(
            (-1) ** k * (2.0 * np.pi) ** (2 * k + 1) / math.factorial(2 * k + 1)
        )
    return u * series


def _half_angle(x: jax.Array) -> jax.Array:
    """tan(atan(x) / 2) = x / (1 + sqrt(1 + x^2)): in (-1, 1) for every x."""
    return x / (1.0 + jnp.sqrt(1.0 + x * x))


def _atan_reduced(y: jax.Array) -> jax.Array:
    """atan(y) for |y| <= tan(pi / 8) = 0.4142: its odd Taylor series to degree 17, whose
    first omitted term is under 0.4142^19 / 19 = 3e-9."""
    v = y * y
    series = jnp.zeros_like(y)
    for k in range(8, -1, -1):
        series = series * v + (-1) ** k / (2 * k + 1)
    return y * series


def _atan_unit(t: jax.Array) -> jax.Array:
    """atan(t) for |t| <= 1: one half-angle step (sqrt of a value in [1, 2], 1/x of one in
    [2, 2.42]) brings t into the series' range."""
    return 2.0 * _atan_reduced(_half_angle(t))


ATAN_REACH = 150.0
"""atan takes 1/x for |x| > 1 (the reciprocal's range ends at 150); beyond, x is clipped, so
the error there is at most 1/150."""


def _atan(x: jax.Array) -> jax.Array:
    """atan(x) = sign(x) pi/2 - atan(1/x) where |x| > 1, else atan(x)."""
    outside = jnp.abs(x) > 1.0
    inverse = 1.0 / jnp.clip(jnp.where(outside, x, 1.0), -ATAN_REACH, ATAN_REACH)
    near = _atan_unit(jnp.where(outside, inverse, x))
    return jnp.where(outside, jnp.sign(x) * (np.pi / 2) - near, near)


def _asin(x: jax.Array) -> jax.Array:
    """asin(x) = 2 atan(x / (1 + sqrt(1 - x^2))), the ratio in [-1, 1] for |x| <= 1; sqrt
    of values under 0.1 loses accuracy, so near |x| = 1 the error grows to 1e-3."""
    return 2.0 * _atan_unit(x / (1.0 + jnp.sqrt(jnp.maximum(1.0 - x * x, 0.0))))


def _atan2(y: jax.Array, x: jax.Array) -> jax.Array:
    """The angle of (x, y): atan of the smaller of |x|, |y| over the larger (in [0, 1]),
    moved to its octant by three comparisons. Where both are under 0.1 the ratio is taken
    over 0.1 instead (1/x's range starts there), so the angle there is coarse."""
    a, b = jnp.abs(x), jnp.abs(y)
    ratio = jnp.minimum(a, b) / jnp.maximum(jnp.maximum(a, b), 0.1)
    theta = _atan_unit(ratio)
    theta = jnp.where(b > a, np.pi / 2 - theta, theta)
    theta = jnp.where(x < 0, np.pi - theta, theta)
    return jnp.where(y < 0, -theta, theta)


def _erf(x: jax.Array) -> jax.Array:
    """Abramowitz and Stegun 7.1.26 (error 1.5e-7) on |x| clipped to 5, sign put back."""
    a = jnp.clip(jnp.abs(x), 0.0, 5.0)
    t = 1.0 / (1.0 + 0.3275911 * a)
    series = jnp.zeros_like(t)
    for c in (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592):
        series = (series + c) * t
    return jnp.sign(x) * (1.0 - series * jnp.exp(-a * a))


_IDENTITIES: dict[str, Callable[..., jax.Array]] = {
    "sin": _sine,
    "cos": lambda x: _sine(x, 1.0),
    "tan": lambda x: _sine(x) / _sine(x, 1.0),
    "atan": _atan,
    "asin": _asin,
    "acos": lambda x: np.pi / 2 - _asin(x),
    "atan2": _atan2,
    "erf": _erf,
    "erfc": lambda x: 1.0 - _erf(x),
    "exp2": lambda x: jnp.exp(x * float(np.log(2.0))),
    "expm1": lambda x: jnp.exp(x) - 1.0,
    "sinh": lambda x: (jnp.exp(x) - jnp.exp(-x)) * 0.5,
    "cosh": lambda x: (jnp.exp(x) + jnp.exp(-x)) * 0.5,
    "asinh": lambda x: jnp.sign(x) * jnp.log(jnp.abs(x) + jnp.sqrt(x * x + 1.0)),
    "acosh": lambda x: jnp.log(x + jnp.sqrt(x * x - 1.0)),
    "atanh": lambda x: 0.5 * jnp.log((1.0 + x) / (1.0 - x)),
    "cbrt": lambda x: jnp.sign(x) * jnp.exp(jnp.log(jnp.abs(x)) / 3.0),
}


@rule(*_IDENTITIES)
def _identity(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Value:
    for x in values:
        require_float(self, eqn, x.dtype)
    (out,) = self.eval_as(_IDENTITIES[eqn.primitive.name], values)
    return out


@rule("is_finite")
def _is_finite(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Value:
    """Fixed-point values are always finite: a public true."""
    return jnp.ones(out_aval(eqn).shape, jnp.bool_)


@rule("log1p")
def _log1p(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    require_float(self, eqn, x.dtype)
    return self.out(eqn, approx.log(self.fx, self.fx.add_const(self.arith(x, x.dtype), 1.0)))


@rule("pow")
def _pow(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """x ** y: a public integral scalar y becomes integer_pow; any other y `_general_power`."""
    x, y = values
    aval = out_aval(eqn)
    require_float(self, eqn, aval.dtype)
    if not isinstance(y, Secret):
        exponent = np.asarray(y)
        if exponent.ndim == 0 and float(exponent).is_integer():
            shares = self.arith(x, aval.dtype, aval.shape)
            if exponent == 0:
                return self.out(eqn, self.arith(jnp.ones(aval.shape, aval.dtype), aval.dtype))
            product = power(self, shares, abs(int(exponent)), True)
            return self.out(eqn, product if exponent > 0 else approx.reciprocal(self.fx, product))
    smallest = 2.0**-self.ctx.frac_bits
    (out,) = self.eval_as(lambda x, y: _general_power(x, y, smallest), values)
    return out


def _general_power(x: jax.Array, y: jax.Array, smallest: float) -> jax.Array:
    """exp(y log |x|), negated where x < 0 and y is an odd whole number. |x| below the
    smallest fixed-point magnitude (a 0 encoding, or a value such as 1e-6 that rounded to
    it) counts as that magnitude, so x ** y stays continuous in y (near 1 for a small y, as
    floats give for a tiny x; 1 for y = 0); to a negative y it gives 0 instead of a huge
    value. A negative x to a y that is not whole (NaN in floats) gives |x| ** y."""
    magnitude = jnp.abs(x)
    result = jnp.exp(y * jnp.log(jnp.maximum(magnitude, smallest)))
    whole = jnp.floor(y)
    odd = (whole == y) & (whole - 2.0 * jnp.floor(whole * 0.5) == 1.0)
    result = jnp.where((x < 0) & odd, -result, result)
    return jnp.where((magnitude == 0) & (y < 0), 0.0, result)


@rule("cumlogsumexp")
def _cumlogsumexp(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Value:
    """log(sum exp) along an axis, running: each prefix kept as a pair (m, s) with the value
    m + log(s), m the prefix's maximum, so s lies in [1, n] whatever the inputs' scale;
    pairs merge by m = max(m1, m2), s = s1 exp(m1 - m) + s2 exp(m2 - m) in an associative
    scan (ceil(log2 n) levels of a comparison, two exps and two products); log(s / sqrt(n))
    keeps log's input in its range for axes of up to 10,000."""
    (x,) = values
    require_float(self, eqn, x.dtype)
    axis, reverse = int(eqn.params["axis"]), bool(eqn.params["reverse"])
    scale = math.sqrt(x.shape[axis])

    def running(v: jax.Array) -> jax.Array:
        def merge(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> Any:
            (m1, s1), (m2, s2) = a, b
            m = jnp.maximum(m1, m2)
            return m, s1 * _exp_below(m1 - m) + s2 * _exp_below(m2 - m)

        m, s = jax.lax.associative_scan(merge, (v, jnp.ones_like(v)), reverse, axis)
        return m + jnp.log(s / scale) + math.log(scale)

    (out,) = self.eval_as(running, values)
    return out


def _exp_below(d: jax.Array) -> jax.Array:
    """exp(d) for d <= 0, as 0 below -30 (where exp's input range would end)."""
    return jnp.exp(jnp.maximum(d, -30.0))
