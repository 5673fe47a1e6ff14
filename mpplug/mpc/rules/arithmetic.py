"""Products, powers and division: ABY3's multiplication of replicated shares (Araki et al.,
CCS 2016): each role computes x_i y_i + x_i y_{i+1} + x_{i+1} y_i plus a zero share, then one
resharing round (8 bytes per element per party); a real product is fused with the precise
truncation (3 rounds, 12 bytes). A product with a public value is local.

floor, ceil and round of reals: the precise truncation by the fraction bits, off by at most
one, corrected by two comparisons side by side (8 rounds, then 3 to arithmetic); round adds
1/2 first and, at an exact tie, one equality test and the parity of the result (local)
decide, to even (`jnp.round`, `rint`) or away from zero (`lax.round`'s default). Products
over an axis (`reduce_prod`, `jnp.prod`) are a tree of ceil(log2 n) products.

Integer `div` and `rem` by a public constant (integers up to 32 bits, so `//` and `%` too):
the magnitude times round(2^31 / d), truncated, corrected by four comparisons side by side,
the sign put back: exact, rounding toward zero as lax does. By a secret divisor: restoring
long division over the dividend's w bits (w = 8, 16 or 32), one comparison and one product per
bit as one loop of the share program (about 11 w rounds), the signs put back: exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn

from mpplug.errors import TraceError
from mpplug.mpc import approx, ring
from mpplug.mpc.protocol import Shares
from mpplug.mpc.rules import NAMED_FUNCTIONS, rule
from mpplug.mpc.rules.bits import bit_digits
from mpplug.mpc.secret import UNSUPPORTED_HINT, Secret, Value, is_float, out_aval

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter


@rule("mul")
def _mul(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x, y = values
    dtype = out_aval(eqn).dtype
    shape = out_aval(eqn).shape
    if isinstance(x, Secret) and isinstance(y, Secret):
        bits = self.ctx.frac_bits if is_float(dtype) else 0
        a, b = self.arith(x, dtype, shape), self.arith(y, dtype, shape)
        return self.out(eqn, self.protocol.mul(self.ctx, a, b, bits))
    secret, public = (x, y) if isinstance(x, Secret) else (y, x)
    shares = self.arith(secret, dtype, shape)
    if is_float(dtype):
        return self.out(eqn, times_public(self, shares, public, shape))
    return self.out(eqn, shares * jnp.broadcast_to(self.encode(public, dtype), shape))


MAX_EXTRA_BITS = 20


def times_public(self: Interpreter, shares: Shares, public: Any, shape: Sequence[int]) -> Shares:
    """Fixed-point shares times a public real, one truncation. A known constant below 1 is
    encoded with extra fraction bits (as many as it has leading zeros, up to 20), so that
    x * 1e-4 or x / 1000 keep 18 significant bits instead of a handful; a known integer
    constant (x * 2, x * 1.0) is a local, exact product."""
    extra = 0
    if not isinstance(public, jax.core.Tracer):
        known = np.asarray(public, np.float64)
        if np.all(np.isfinite(known)) and np.all(known == np.round(known)):
            integers = jnp.broadcast_to(ring.to_ring(known.astype(np.int64)), shape)
            return shares * integers
        largest = float(np.max(np.abs(known), initial=0.0))
        if 0.0 < largest < 1.0:
            extra = min(MAX_EXTRA_BITS, int(np.floor(-np.log2(largest))))
    bits = self.ctx.frac_bits + extra
    scale = jnp.broadcast_to(ring.encode(public, bits), shape)
    return self.protocol.trunc(self.ctx, shares * scale, bits)


@rule("dot_general")
def _dot_general(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x, y = values
    dims = eqn.params["dimension_numbers"]
    dtype = out_aval(eqn).dtype
    if isinstance(x, Secret) and isinstance(y, Secret):
        bits = self.ctx.frac_bits if is_float(dtype) else 0
        a, b = self.arith(x, dtype), self.arith(y, dtype)
        return self.out(eqn, self.protocol.dot_general(self.ctx, a, b, dims, bits))
    if isinstance(x, Secret):
        public = self.encode(y, dtype)
        product = self.protocol.local(
            lambda a: ring.dot_general(a, public, dims), self.arith(x, dtype)
        )
    else:
        public = self.encode(x, dtype)
        product = self.protocol.local(
            lambda b: ring.dot_general(public, b, dims), self.arith(y, dtype)
        )
    if is_float(dtype):
        product = self.protocol.trunc(self.ctx, product, self.ctx.frac_bits)
    return self.out(eqn, product)


def require_float(self: Interpreter, eqn: JaxprEqn, dtype: Any) -> None:
    if not is_float(dtype):
        raise TraceError(
            f"{self.where}: {eqn.primitive.name} on secret {np.dtype(dtype)} is supported only "
            f"for floating-point values (fixed point); {UNSUPPORTED_HINT}"
        )


def power(self: Interpreter, x: Shares, exponent: int, floating: bool) -> Shares:
    """x^exponent (exponent >= 1) by square and multiply."""

    def product(a: Shares, b: Shares) -> Shares:
        return self.protocol.mul(self.ctx, a, b, self.ctx.frac_bits if floating else 0)

    result = None
    base = x
    while exponent:
        if exponent & 1:
            result = base if result is None else product(result, base)
        exponent >>= 1
        if exponent:
            base = product(base, base)
    assert result is not None
    return result


@rule("integer_pow")
def _integer_pow(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    y = eqn.params["y"]
    floating = is_float(x.dtype)
    shares = self.arith(x, x.dtype)
    if y == 0:
        return self.out(eqn, self.arith(jnp.ones(x.shape, x.dtype), x.dtype))
    if y < 0:
        require_float(self, eqn, x.dtype)
        return self.out(eqn, approx.reciprocal(self.fx, power(self, shares, -y, True)))
    return self.out(eqn, power(self, shares, y, floating))


@rule("square")
def _square(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    return self.out(eqn, power(self, self.arith(x, x.dtype), 2, is_float(x.dtype)))


@rule("div")
def _div(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x, y = values
    aval = out_aval(eqn)
    if not is_float(aval.dtype):
        if not _one_constant(eqn, y):
            return self.out(eqn, divide_by_secret(self, eqn, x, y)[0])
        divisor = _public_divisor(self, eqn, y)
        quotient, _ = divide_integers(self, self.arith(x, aval.dtype, aval.shape), divisor, aval)
        return self.out(eqn, quotient)
    if not isinstance(y, Secret):
        shares = self.arith(x, aval.dtype, aval.shape)
        inverse = 1.0 / (y if isinstance(y, jax.core.Tracer) else np.asarray(y, np.float64))
        return self.out(eqn, times_public(self, shares, inverse, aval.shape))
    reciprocal = approx.reciprocal(self.fx, self.arith(y, aval.dtype, aval.shape))
    if not isinstance(x, Secret):
        numerator = jnp.broadcast_to(ring.encode(x, self.ctx.frac_bits), aval.shape)
        product = reciprocal * numerator
        return self.out(eqn, self.protocol.trunc(self.ctx, product, self.ctx.frac_bits))
    return self.out(eqn, self.fx.mul(self.arith(x, aval.dtype, aval.shape), reciprocal))


@rule("floor", "ceil")
def _floor(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    require_float(self, eqn, x.dtype)
    shares = self.arith(x, x.dtype)
    if eqn.primitive.name == "ceil":
        return self.out(eqn, -(floor_whole(self, -shares)[0] << np.uint64(self.ctx.frac_bits)))
    return self.out(eqn, floor_whole(self, shares)[0] << np.uint64(self.ctx.frac_bits))


@rule("round")
def _round(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    require_float(self, eqn, x.dtype)
    f = self.ctx.frac_bits
    shares = self.arith(x, x.dtype)
    half = self.protocol.lift(self.ctx, jnp.full(x.shape, np.uint64(1 << (f - 1))))
    whole, rest = floor_whole(self, shares + half)
    both = self.protocol.msb(self.ctx, jnp.stack([rest, -rest], axis=1))
    tie = self.protocol.xor_public(self.ctx, both[:, 0] ^ both[:, 1], jnp.uint64(1))
    if int(eqn.params["rounding_method"]) == int(lax.RoundingMethod.TO_NEAREST_EVEN):
        loser = self.protocol.low_bits(self.ctx, whole, 1)  # odd: one below is even
    else:  # away from zero: x + 1/2 rounded down is right for x >= 0 only
        loser = self.protocol.msb(self.ctx, shares)
    down = self.protocol.b2a(self.ctx, self.protocol.and_(self.ctx, tie, loser, bits=1))
    return self.out(eqn, (whole - down) << np.uint64(f))


def floor_whole(self: Interpreter, x: Shares) -> tuple[Shares, Shares]:
    """(floor(x) as an integer, x - floor(x) in fixed point) for fixed-point shares x."""
    f = self.ctx.frac_bits
    whole = self.protocol.trunc(self.ctx, x, f)
    rest = x - (whole << np.uint64(f))
    one = self.protocol.lift(self.ctx, jnp.full(x.shape[1:], np.uint64(1 << f)))
    signs = self.protocol.b2a(
        self.ctx, self.protocol.msb(self.ctx, jnp.stack([rest, rest - one], axis=1))
    )
    # rest < 0: one too many; rest - 1 >= 0: one too few
    whole = (
        whole
        - signs[:, 0]
        + (self.protocol.lift(self.ctx, jnp.ones(x.shape[1:], ring.RING)) - signs[:, 1])
    )
    return whole, x - (whole << np.uint64(f))


@rule("reduce_prod")
def _reduce_prod(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    axes = tuple(eqn.params["axes"])
    floating = is_float(x.dtype)
    kept = [d for d in range(len(x.shape)) if d not in axes]
    count = int(np.prod([x.shape[d] for d in axes], dtype=np.int64))
    moved = self.protocol.local(
        lambda s: jnp.transpose(s, [*kept, *axes]).reshape(*(x.shape[d] for d in kept), count),
        self.arith(x, x.dtype),
    )
    if count == 0:
        return self.out(eqn, self.arith(jnp.ones(out_aval(eqn).shape, x.dtype), x.dtype))
    bits = self.ctx.frac_bits if floating else 0
    while moved.shape[-1] > 1:
        n = moved.shape[-1]
        half = n // 2
        product = self.protocol.mul(
            self.ctx, moved[..., 0 : 2 * half : 2], moved[..., 1 : 2 * half : 2], bits
        )
        moved = jnp.concatenate([product, moved[..., 2 * half :]], axis=-1)
    return self.out(eqn, moved[..., 0])


@rule("rem")
def _rem(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Value:
    """x - y * trunc(x / y), the sign of x (C's fmod, as lax.rem): integers by a constant by
    `divide_integers`, by a secret by long division; reals by long division of their
    fixed-point encodings (exact on them: fmod of the encodings is the encoding of fmod)."""
    x, y = values
    aval = out_aval(eqn)
    if is_float(aval.dtype):  # the encodings' integer remainder is the remainder's encoding
        shape = tuple(aval.shape)
        both = jnp.stack([self.arith(x, aval.dtype, shape), self.arith(y, aval.dtype, shape)], 1)
        return self.out(eqn, long_divide(self, both, REAL_BITS, True)[1])
    if not _one_constant(eqn, y):
        return self.out(eqn, divide_by_secret(self, eqn, x, y)[1])
    divisor = _public_divisor(self, eqn, y)
    _, remainder = divide_integers(self, self.arith(x, aval.dtype, aval.shape), divisor, aval)
    return self.out(eqn, remainder)


REAL_BITS = 62
"""The magnitude bits of a fixed-point encoding (sealed reals lie within 2^(62 - f))."""


def _long_division(digits: jax.Array, divisor: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Restoring division of the number whose binary digits, highest first, lie along the
    last axis of `digits`, by `divisor` > 0: (quotient, remainder), one bit a step."""
    zero = jnp.zeros(divisor.shape, jnp.int64)

    def step(i: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        quotient, rest = carry
        rest = 2 * rest + digits[..., i]
        fits = (rest >= divisor).astype(jnp.int64)
        return 2 * quotient + fits, rest - fits * divisor

    return lax.fori_loop(0, digits.shape[-1], step, (zero, zero))


def _long_division_64(digits: jax.Array, divisor: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`_long_division` of 64-bit magnitudes (uint64): a remainder of 2^63 or more leaves the
    ring when doubled, and then the divisor always fits (one more comparison a step, side by
    side with the other)."""
    zero = jnp.zeros(divisor.shape, jnp.uint64)

    def step(i: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        quotient, rest = carry
        overflows = rest >= np.uint64(1 << 63)
        rest = rest * np.uint64(2) + digits[..., i]
        fits = (overflows | (rest >= divisor)).astype(jnp.uint64)
        return quotient * np.uint64(2) + fits, rest - fits * divisor

    return lax.fori_loop(0, digits.shape[-1], step, (zero, zero))


def divide_by_secret(self: Interpreter, eqn: JaxprEqn, x: Value, y: Value) -> tuple[Shares, Shares]:
    """(x / y rounded toward zero, x - y * that) for secret integers (or public divisors that
    are not one constant of at most 32 bits): the magnitudes' long division
    (`_long_division`), the signs put back. Division by zero gives the quotient 2^w - 1 and
    the remainder x, where XLA's is implementation-defined."""
    aval = out_aval(eqn)
    width = np.dtype(aval.dtype).itemsize * 8
    shape = tuple(aval.shape)
    signed = bool(jnp.issubdtype(aval.dtype, jnp.signedinteger))

    def divide() -> tuple[Shares, Shares]:
        both = jnp.stack([self.arith(x, aval.dtype, shape), self.arith(y, aval.dtype, shape)], 1)
        return long_divide(self, both, width, signed)

    # `div` and `rem` of the same operands (`//` writes both) share one long division
    key = tuple(v.shares if isinstance(v, Secret) else v for v in (x, y))
    return self.remember(("divide", *key, str(aval.dtype), shape), divide)


def long_divide(self: Interpreter, both: Shares, width: int, signed: bool) -> tuple[Shares, Shares]:
    """(quotient toward zero, remainder with the dividend's sign) of the integers `both[:, 0]`
    by `both[:, 1]`, whose magnitudes hold in `width` bits."""
    shape = both.shape[2:]
    if signed:
        negative = self.protocol.b2a(self.ctx, self.protocol.msb(self.ctx, both))
        both = both - (self.protocol.mul(self.ctx, negative, both) << np.uint64(1))
    else:
        negative = None
    digits = bit_digits(self, self.protocol.low_bits(self.ctx, both[:, 0], width), width)
    highest_first = jnp.moveaxis(digits[:, ::-1], 1, -1)
    dtype = np.dtype(np.uint64 if width == 64 else np.int64)
    quotient, rest = self.eval_as(
        _long_division_64 if width == 64 else _long_division,
        [
            Secret(highest_first, (*shape, width), dtype),
            Secret(both[:, 1], shape, dtype),
        ],
    )
    results = jnp.stack([self.arith(quotient, dtype), self.arith(rest, dtype)], axis=1)
    if negative is None:
        return results[:, 0], results[:, 1]
    # the quotient's sign is the XOR of the signs, the remainder's the dividend's
    flip = jnp.stack(
        [
            negative[:, 0]
            + negative[:, 1]
            - (self.protocol.mul(self.ctx, negative[:, 0], negative[:, 1]) << np.uint64(1)),
            negative[:, 0],
        ],
        axis=1,
    )
    put_back = results - (self.protocol.mul(self.ctx, flip, results) << np.uint64(1))
    return put_back[:, 0], put_back[:, 1]


def _one_constant(eqn: JaxprEqn, y: Value) -> bool:
    """Whether integer division by `y` can multiply by its inverse: one constant (repeated),
    on integers up to 32 bits."""
    if isinstance(y, Secret | jax.core.Tracer) or np.dtype(out_aval(eqn).dtype).itemsize > 4:
        return False
    return bool(np.unique(np.asarray(y, np.int64)).size == 1)


def _public_divisor(self: Interpreter, eqn: JaxprEqn, y: Value) -> np.ndarray:
    divisor = np.asarray(y, np.int64)
    if np.any(divisor == 0):
        raise TraceError(
            f"{self.where}: integer {eqn.primitive.name} by the constant 0, which XLA leaves "
            f"undefined; divide by a nonzero divisor"
        )
    return divisor


def divide_integers(
    self: Interpreter, x: Shares, divisor: np.ndarray, aval: Any
) -> tuple[Shares, Shares]:
    """(x / d rounded toward zero, x - d * that) for integers up to 32 bits and a public
    nonzero d: the magnitude's floor quotient estimated as (|x| * round(2^31 / |d|)) >> 31
    (off by at most two with the truncation), corrected by four comparisons side by side,
    then the sign put back (about 30 rounds)."""
    n = abs(int(divisor.reshape(-1)[0]))
    shape = x.shape[1:]
    signed = bool(jnp.issubdtype(aval.dtype, jnp.signedinteger))
    negative = self.protocol.b2a(self.ctx, self.protocol.msb(self.ctx, x)) if signed else None
    size = x if negative is None else x - (self.protocol.mul(self.ctx, negative, x) << np.uint64(1))
    if n == 1:
        quotient, remainder = size, size - size
    else:
        shift = 31
        estimate = self.protocol.trunc(self.ctx, size * np.uint64(round(2**shift / n)), shift)
        rest = size - estimate * np.uint64(n)
        public = self.protocol.lift(self.ctx, jnp.full(shape, np.uint64(n)))
        one = self.protocol.lift(self.ctx, jnp.ones(shape, ring.RING))
        tests = jnp.stack(
            [rest, rest + public, public - one - rest, (public << np.uint64(1)) - one - rest],
            axis=1,
        )  # rest < 0, rest < -n, rest >= n, rest >= 2n
        signs = self.protocol.b2a(self.ctx, self.protocol.msb(self.ctx, tests))
        quotient = estimate - signs[:, 0] - signs[:, 1] + signs[:, 2] + signs[:, 3]
        remainder = size - quotient * np.uint64(n)
    if negative is not None:
        both = jnp.stack([quotient, remainder], axis=1)
        flipped = both - (
            self.protocol.mul(self.ctx, jnp.stack([negative] * 2, 1), both) << np.uint64(1)
        )
        quotient, remainder = flipped[:, 0], flipped[:, 1]
    if int(divisor.reshape(-1)[0]) < 0:
        quotient = -quotient
    return quotient, remainder


def binary_gcd(x1: jax.Array, x2: jax.Array) -> jax.Array:
    """`jnp.gcd` without a secret-dependent loop: Stein's binary GCD (Stein, "Computational
    problems associated with Racah algebra", J. Comput. Phys. 1, 1967) run for a fixed
    2w steps on the magnitudes as uint64 (ring integers that never wrap). Each step halves a
    or b when even (both, counting k, when both are), else halves the difference of the
    larger and the smaller; every step takes a bit off a or b, so 2w steps reach
    gcd * 2^-k in one of them and 0 in the other; the result is (a + b) << k, in the
    promoted dtype as JAX's (gcd of the minimum int and 0 wraps as it does). A step is two
    parities (4 rounds) beside one comparison, then products and a halving by the bits
    (about 24 rounds; int32: 64 steps)."""
    dtype = jnp.result_type(x1, x2)
    x1, x2 = jnp.broadcast_arrays(x1.astype(dtype), x2.astype(dtype))
    one = jnp.uint64(1)

    def magnitude(x: jax.Array) -> jax.Array:
        if jnp.issubdtype(dtype, jnp.unsignedinteger):
            return x.astype(jnp.uint64)
        wide = x.astype(jnp.int64)
        return jnp.where(wide < 0, -wide, wide).astype(jnp.uint64)

    def step(_: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        a, b, k = carry
        a_odd, b_odd = a & one, b & one
        both_odd = a_odd * b_odd
        a_larger = both_odd * (a >= b).astype(jnp.uint64)
        b_larger = both_odd - a_larger
        halves = lax.shift_right_logical(jnp.stack([a - a_larger * b, b - b_larger * a]), one)
        a = a + ((one - a_odd) + a_larger) * (halves[0] - a)
        b = b + ((one - b_odd) + b_larger) * (halves[1] - b)
        return a, b, k + (one - a_odd) * (one - b_odd)

    start = (magnitude(x1), magnitude(x2), jnp.zeros(x1.shape, jnp.uint64))
    a, b, k = lax.fori_loop(0, 2 * jnp.iinfo(dtype).bits, step, start)
    return lax.shift_left(a + b, k).astype(dtype)


NAMED_FUNCTIONS["gcd"] = binary_gcd  # jnp.gcd loops while a secret is nonzero


def scale_by_power_of_two(x: jax.Array, n: jax.Array) -> jax.Array:
    """`jnp.ldexp(x, n)` = x 2^n, which JAX computes on the float's bits: a public n is an
    exact power of two (a shift of the fixed-point value, or a truncation below 2^0) for
    n >= -(f + MAX_EXTRA_BITS), the extra bits `times_public` gives a small constant (n >= -f
    for a public n computed in the program); below, 2^n is under the resolution and the
    product is 0. A secret n goes through exp2 (exp's relative error). An integer x gives
    float32, as JAX's does."""
    dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
    return jnp.asarray(x, dtype) * jnp.exp2(jnp.asarray(n, dtype))


NAMED_FUNCTIONS["ldexp"] = scale_by_power_of_two
