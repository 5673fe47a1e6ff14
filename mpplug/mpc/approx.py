"""Approximations of real functions on fixed-point shares, built from products, public
constants and sign tests only. Each states its method and the input range it is meant for;
the errors measured against float64 are in docs/mpc.md and pinned in tests/test_mpc_rules.py.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp

from mpplug.mpc import ring
from mpplug.mpc.fixed import Fxp
from mpplug.mpc.protocol import Shares

EXP_SQUARINGS = 8
"""exp(x) = (1 + t + t^2/2)^(2^8) with t = x/2^8: SPU's and CrypTen's limit form, second order."""
EXP_FLOOR = -64.0
"""A saturating exp is 0 below this (e^-64 is 2^-92, far below any resolution)."""
EXP_LOWEST = -500.0
"""Below about -500 the limit form's base, which grows again for x < -256, exceeds 0.95 and
its 256th power is no longer 0: exp's input range starts here unless it saturates."""
RECIPROCAL_ITERATIONS = 9
LOG_ITERATIONS = 2
LOG_ORDER = 8
RSQRT_ITERATIONS = 4


def exp(fx: Fxp, x: Shares, saturate: bool = False) -> Shares:
    """e^x as (1 + t + t^2/2)^256 with t = x/256: the limit form (1 + t)^256 of SPU and
    CrypTen (relative error x^2/512, 3% at |x| = 4) with a second-order base, whose own error
    is |x|^3/393,216 (1.6e-4 at |x| = 4). x in [EXP_LOWEST, 17.9] (e^x must stay below the
    range 2^(62-2f) = 2^26, as the last squaring's product): 27 rounds precise, t and
    t^2/2 = x^2/2^17 computed side by side from x. With `saturate`, any x up to 17.9: the
    result is 0 below EXP_FLOOR, from a sign test beside the squarings (one round more, 57
    bytes an element; x^2 may then wrap, but only where the result is 0).

    Each squaring doubles the relative error its operand brings, so a rounding in the base
    comes out 256 times larger (2e-3 at f = 18). With precise truncation the base and the
    early squarings carry up to 30 fraction bits (`exp_fraction_bits`: as many as keep each
    product below 2^62 over the whole input range, and at most 2f + 16 so that t^2/2 is still
    truncated), and each truncation brings the product to the next one's bits (for f <= 22 by
    at most 32, as cheap as f's, and t is x shifted up, with no truncation of its own: 108
    bytes an element where it was 121). Rounding adds about 1e-5 relative above 1 and a few
    units of 2^-f below."""
    below_floor = fx.is_negative(fx.add_const(x, -EXP_FLOOR)) if saturate else None
    bits = exp_fraction_bits(fx.f) if fx.ctx.truncation == "precise" else (fx.f,) * 9
    t = fx.scale_pow2(x, bits[0] - fx.f - EXP_SQUARINGS)  # x/256 with bits[0] fraction bits
    half_square = fx.protocol.mul(fx.ctx, x, x, 2 * fx.f - bits[0] + 2 * EXP_SQUARINGS + 1)
    one = fx.protocol.lift(fx.ctx, jnp.full(x.shape[1:], 1 << bits[0], ring.RING))
    y = t + half_square + one
    for k in range(EXP_SQUARINGS):
        y = fx.protocol.mul(fx.ctx, y, y, 2 * bits[k] - bits[k + 1])
    return y if below_floor is None else y - fx.times_int(below_floor, y)


@functools.cache
def exp_fraction_bits(f: int) -> tuple[int, ...]:
    """The fraction bits of exp's base and of each squaring's result (the last is f): at
    most 30, and fewer where e^(x/2^(8-k)) at the top of the range (x = (62 - 2f) ln 2)
    squared would reach 2^62."""
    top = (62 - 2 * f) * math.log(2)
    bits = [
        min(30, 2 * f + 16, max(f, math.floor(30.5 - top / 2 ** (EXP_SQUARINGS - k) / math.log(2))))
        for k in range(EXP_SQUARINGS)
    ]
    return (*bits, f)


def _goldschmidt(fx: Fxp, x: Shares, y: Shares, iterations: int) -> Shares:
    """1/x from a guess y with |1 - x y| < 1: y <- y (1 + e) and e <- e^2 in parallel, two
    rounds an iteration; after n iterations the relative error is (1 - x y)^(2^n)."""
    e = fx.add_const(-fx.mul(x, y), 1.0)
    for _ in range(iterations):
        y, e = fx.mul(y, fx.add_const(e, 1.0)), fx.mul(e, e)
    return y


def _newton_reciprocal(fx: Fxp, x: Shares, y: Shares) -> Shares:
    """One self-correcting Newton step y (2 - x y): squares the error and leaves only the
    last truncations' (Goldschmidt's error grows with its iterations). Four rounds."""
    return fx.mul(y, fx.add_const(-fx.mul(x, y), 2.0))


def reciprocal_positive(fx: Fxp, x: Shares) -> Shares:
    """1/x for x in [0.1, 150]: CrypTen's guess 3 exp(0.5 - x) + 0.003, nine Goldschmidt
    iterations and one Newton step (43 rounds)."""
    guess = fx.add_const(fx.mul_const(exp(fx, fx.add_const(-x, 0.5)), 3.0), 0.003)
    return _newton_reciprocal(fx, x, _goldschmidt(fx, x, guess, RECIPROCAL_ITERATIONS))


def _sign_split(fx: Fxp, x: Shares) -> tuple[Shares, Shares]:
    """(negative bit, |x|): 11 rounds."""
    negative = fx.is_negative(x)
    return negative, x - (fx.times_int(negative, x) << 1)


def reciprocal(fx: Fxp, x: Shares) -> Shares:
    """1/x for |x| in [0.1, 150], either sign (the sign is split off first): 53 rounds."""
    negative, magnitude = _sign_split(fx, x)
    inverse = reciprocal_positive(fx, magnitude)
    return inverse - (fx.times_int(negative, inverse) << 1)


def logistic(fx: Fxp, x: Shares) -> Shares:
    """1 / (1 + e^-x) on |x| (so the denominator d lies in [1, 2]), then 1 - s for x < 0:
    exp as above, 1/d by four Goldschmidt iterations from 2/3 ((1/3)^16 < 1e-7). 40 rounds;
    absolute error below 5e-5."""
    negative, magnitude = _sign_split(fx, x)
    denominator = fx.add_const(exp(fx, -magnitude, saturate=True), 1.0)
    guess = fx.const(2.0 / 3.0, x.shape[1:])
    s = _goldschmidt(fx, denominator, guess, 4)
    return s + fx.times_int(negative, fx.add_const(-(s << 1), 1.0))


def tanh(fx: Fxp, x: Shares) -> Shares:
    """tanh(x) = 2 logistic(2x) - 1 (40 rounds)."""
    return fx.add_const(logistic(fx, x << 1) << 1, -1.0)


def log(fx: Fxp, x: Shares) -> Shares:
    """ln x for x in [0.01, 100] (CrypTen's method): guess x/120 - 20 exp(-2x - 1) + 3, then
    two 8th-order Householder steps y -= sum_k h^k / k with h = 1 - x exp(-y): about 5e-4
    absolute on [0.01, 100], 1e-4 on [0.1, 10]. 76 rounds."""
    y = fx.mul_const(x, 1 / 120) - fx.mul_const(exp(fx, fx.add_const(-(x << 1), -1.0)), 20.0)
    y = fx.add_const(y, 3.0)
    for _ in range(LOG_ITERATIONS):
        h = fx.add_const(-fx.mul(x, exp(fx, -y)), 1.0)
        powers = _powers(fx, h, LOG_ORDER)
        y = y - sum(fx.mul_const(p, 1 / (k + 1)) for k, p in enumerate(powers))
    return y


def _powers(fx: Fxp, h: Shares, order: int) -> list[Shares]:
    """h, h^2, ..., h^order in ceil(log2(order)) products deep."""
    powers = [h]
    while len(powers) < order:
        top = powers[-1]
        powers += [fx.mul(p, top) for p in powers[: order - len(powers)]]
    return powers


def rsqrt(fx: Fxp, x: Shares, iterations: int = RSQRT_ITERATIONS + 1) -> Shares:
    """1/sqrt(x) for x in [0.1, 100]: CrypTen's guess 2.2 exp(-(x/2 + 0.2)) + 0.2 - x/1024,
    then five Newton steps y <- y (3 - x y^2) / 2 (six rounds each; 50 rounds)."""
    y = fx.mul_const(exp(fx, fx.add_const(-fx.scale_pow2(x, -1), -0.2)), 2.2)
    y = fx.add_const(y - fx.scale_pow2(x, -10), 0.2)
    for _ in range(iterations):
        t = fx.add_const(-fx.mul(x, fx.mul(y, y)), 3.0)
        y = fx.protocol.mul(fx.ctx, y, t, fx.f + 1)
    return y


def sqrt(fx: Fxp, x: Shares) -> Shares:
    """sqrt(x) for x in [0.1, 100]: g = x rsqrt(x) after four Newton steps, refined once by
    the coupled iteration r = 1/2 - g y/2, g <- g (1 + r), which squares g's relative error
    and leaves a few ulps (50 rounds)."""
    y = rsqrt(fx, x, RSQRT_ITERATIONS)
    g = fx.mul(x, y)
    half_gy = fx.protocol.mul(fx.ctx, g, y, fx.f + 1)
    return g + fx.mul(g, fx.add_const(-half_gy, 0.5))
