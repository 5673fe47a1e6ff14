"""Integer bit operations, division and remainder by constants, rounding, products and
running extremes, and the real functions written through exp/log/sqrt inside `mp.mpc.run`,
against plain JAX: and/or/xor/not, shifts by constants and population_count on int32 and
uint16 (wrapping as JAX wraps, including int32's minimum), `//`, `%`, lax.div and lax.rem by
constants of either sign, conversions to narrower or differently signed integers and to
bool, split and XOR-reduce; floor, ceil, trunc, round to even and away from zero at exact
ties; prod, cumprod, cummax, cummin, cumlogsumexp; sin, erf, gelu and sinh (at their
documented errors);
division and shifts by secret integers, scatter at secret rows, signbit, nextafter, ldexp;
int32, int16 and uint16 sums and products wrapped at their width before what reads past it.
Every function written through exp, log, sqrt and 1/x by an identity (`_IDENTITIES`) is
checked against JAX in plaintext: the identity is what its rule adds to those parts, whose
errors `test_mpc_rules` measures."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from jax import lax

import mpplug as mp
from mpplug.mpc.rules.approximations import _IDENTITIES

rng = np.random.default_rng(21)
A = rng.integers(-(2**31), 2**31, size=6, dtype=np.int64).astype(np.int32)
A[:2] = [-1, -(2**31)]
B = rng.integers(-(2**31), 2**31, size=6, dtype=np.int64).astype(np.int32)
U = rng.integers(0, 2**16, size=6, dtype=np.int64).astype(np.uint16)
X = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, -3.2, 3.7, 0.0, -1e-4, 7.0, -100.51], np.float32)
P = np.array([[1.5, -2.0, 0.5], [3.0, 0.25, -1.0]], np.float32)
EXACT = ("floor", "ceil", "trunc", "round_even", "round_away", "prod", "cumprod", "cummax")
APPROXIMATE = {
    "sin": 1e-4, "erf": 2e-3, "gelu": 3e-3, "sinh": 3e-3, "nextafter": 4e-6, "interp": 1e-4,
    "float_power": 1e-2, "power_secret": 1e-2, "power_array": 1e-2, "cumlogsumexp": 5e-3,
    "tiny_base": 1e-2, "ldexp_down": 4e-6, "ldexp_secret": 1e-4,
}  # fmt: skip


def integers(a: Any, b: Any, u: Any) -> dict[str, Any]:
    return {
        "and": a & b, "or": a | b, "xor": a ^ b, "and_constant": a & 0xF0F0, "or_constant": a | 5,
        "not": ~a, "not_unsigned": ~u, "shift_left": a << 3, "shift_right": a >> 5,
        "shift_right_sign": a >> 31, "shift_right_logical": lax.shift_right_logical(a, 7),
        "shift_right_unsigned": u >> 3, "popcount": lax.population_count(a),
        "popcount_unsigned": lax.population_count(u), "gray_code": u ^ (u >> 1),
        "to_uint32": a.astype(jnp.uint32), "to_int16": a.astype(jnp.int16),
        "uint16_to_int8": u.astype(jnp.int8), "to_bool": a.astype(bool),
        "cummax_int": lax.cummax(a), "prod_int": jnp.prod(b[:2]),
        "floor_divide": a // 7, "modulo": a % 7, "div_negative": lax.div(a, -3),
        "rem": lax.rem(a, 5), "unsigned_div": u // 10, "unsigned_rem": u % 10,
        "split": jnp.split(a, [1, 4]), "parity": jnp.bitwise_xor.reduce(a > 0),
    }  # fmt: skip


def reals(x: Any, p: Any) -> dict[str, Any]:
    return {
        "floor": jnp.floor(x), "ceil": jnp.ceil(x), "trunc": jnp.trunc(x),
        "round_even": jnp.round(x), "round_away": lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO),
        "prod": jnp.prod(p, axis=1), "cumprod": jnp.cumprod(p, axis=1),
        "cummax": lax.cummax(p, axis=1), "cummin": lax.cummin(p, axis=0, reverse=True),
        "float_to_bool": x.astype(bool), "isfinite": jnp.isfinite(p),
        "sin": jnp.sin(x), "erf": jax.scipy.special.erf(x),
        "gelu": jax.nn.gelu(p, approximate=False), "sinh": jnp.sinh(p),
        "cumlogsumexp": lax.cumlogsumexp(x.reshape(3, 4), axis=1, reverse=True),
    }  # fmt: skip


def secure(fn: Any, *args: np.ndarray) -> Any:
    """fn's results inside `mp.mpc.run`, each argument sealed by party n % 3."""

    @mp.function
    def program(*values: Any) -> Any:
        return mp.mpc.reveal(mp.mpc.run(fn, *mp.mpc.seal(values)), to=0)

    with mp.Simulator(3) as sim:
        handles = [sim.put(n % 3, v) for n, v in enumerate(args)]
        return sim.fetch(sim.evaluate(program, *handles), party=0)


def check(fn: Any, *args: np.ndarray) -> None:
    got = secure(fn, *args)
    want = jax.jit(fn)(*args)
    assert set(got) == set(want)
    for name, w in want.items():
        if isinstance(w, list):  # split: its parts in order
            got[name], w = np.concatenate(got[name]), np.concatenate(w)
        g, w = np.asarray(got[name]), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if name in APPROXIMATE:
            tolerance = APPROXIMATE[name]
            np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance, err_msg=name)
        else:  # integers, bools, and reals that are exact in fixed point
            np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.slow
def test_integer_bit_operations_wrap_as_jax_does():
    check(integers, A, B, U)


@pytest.mark.slow
def test_rounding_products_running_extremes_and_identities_compute_what_jax_computes():
    check(reals, X, P)
    assert set(EXACT) <= set(reals(X, P))


def overflowing(a: Any, b: Any, h: Any, u: Any) -> dict[str, Any]:
    """Sums and products JAX wraps at the dtype's width, then read past their low bits."""

    def accumulate(_: Any, carry: Any) -> Any:
        total, above = carry
        total = total + h[:2]
        return total, above + (total > 0).astype(jnp.int16)

    return {
        "sum_compare": (a + b) > 0, "product_compare": a * b < b,
        "max_of_sum": jnp.maximum(a + b, a),
        "product_to_float": (a * b).astype(jnp.float32), "sum_floor_divide": (a + b) // 7,
        "sum_equal": a + b == b + a - 0,
        "dot_compare": jnp.dot(a, b) > 0, "cumsum_min": jnp.min(jnp.cumsum(a)),
        "int16_sum_compare": h + h[::-1] < h, "int16_to_int32": (h * 3).astype(jnp.int32),
        "uint16_difference_compare": u - u[::-1] > 100, "uint16_negated_max": jnp.max(-u),
        "abs_minimum": jnp.abs(a), "wide_index": jnp.where((a + b) > 0, a * b, a - b),
        "loop_carry": lax.fori_loop(0, 3, accumulate, (h[:2], jnp.zeros(2, jnp.int16))),
        "sort_sums": jnp.sort(h * 7),
    }  # fmt: skip


@pytest.mark.slow
def test_narrow_integer_sums_and_products_wrap_at_their_width_as_jax_does():
    """An int32 sum or product is right modulo 2^32 in the ring; whatever reads more than
    its low bits (a comparison, a division, a widening or real conversion, a sort, a loop's
    next iteration) sees it wrapped at the width, as JAX computes it."""
    h = np.array([30000, -30000, 20000, -1, 16384, 0], np.int16)
    check(overflowing, A, B, h, U)


def test_a_wide_integer_leaving_one_run_is_wrapped_by_the_next():
    """A sealed sum that lies beyond int16's range after one `mp.mpc.run` keeps that mark, so
    a comparison in a later run sees it wrapped."""
    x = np.array([30000, -30000, 100, 32767], np.int16)
    y = np.array([10000, -10000, 200, 1], np.int16)

    @mp.function
    def program(a: Any, b: Any) -> Any:
        total = mp.mpc.run(lambda p, q: p + q, *mp.mpc.seal((a, b)))
        assert total.wide
        return mp.mpc.reveal(mp.mpc.run(lambda t: (t > 0, t), total), to=0)

    with mp.Simulator(3) as sim:
        positive, total = sim.fetch(sim.evaluate(program, sim.put(0, x), sim.put(1, y)), party=0)
    np.testing.assert_array_equal(total, x + y)
    np.testing.assert_array_equal(positive, (x + y) > 0)
    assert list(positive) == [False, True, True, False]


def secret_divisors_and_positions(a: Any, d: Any, u: Any, v: Any, x: Any, i: Any) -> dict[str, Any]:
    rows = x.reshape(4, 3)
    return {
        "div": lax.div(a, d), "rem": lax.rem(a, d), "floor_divide": a // d, "modulo": a % d,
        "unsigned_div": u // v, "unsigned_rem": u % v, "shift_left_secret": a << jnp.abs(d),
        "shift_right_secret": a >> jnp.abs(d),
        "shift_logical_secret": lax.shift_right_logical(a, d),
        "set": rows.at[i[0]].set(x[:3]), "add_duplicates": rows.at[i].add(rows[:3]),
        "set_dropped": x.at[i[2]].set(9.0), "set_clipped": x.at[i[2]].set(9.0, mode="clip"),
        "public_add": rows.at[jnp.array([0, 0])].add(rows[:2]), "public_set": x.at[3].set(x[0]),
        "signbit": jnp.signbit(x), "copysign": jnp.copysign(x, x[::-1]),
        "nextafter": jnp.nextafter(x, x[::-1]),
        "ldexp": jnp.ldexp(x, 3), "ldexp_down": jnp.ldexp(x, -3),
        "ldexp_secret": jnp.ldexp(x[:8], jnp.clip(d, -3, 3)),
    }  # fmt: skip


@pytest.mark.slow
def test_division_by_secret_integers_and_writes_at_secret_positions_are_exact():
    """Long division by secret divisors of both signs (int32 extremes, uint16); shifts by
    secret amounts, negative ones (outside the width) included; scatter and
    scatter-add at secret rows, a duplicate adding twice, -1 wrapping to the last row, an
    index past the end dropped (or clipped); signbit, nextafter and ldexp (by a constant up
    exact, down within a unit of 2^-18, by a secret through exp2) in fixed point."""
    a = np.array([17, -17, 17, -17, 0, 2**31 - 1, -(2**31) + 1, 100], np.int32)
    d = np.array([5, 5, -5, -5, 3, 7, 3, 1], np.int32)
    u, v = np.array([65535, 17, 3, 0], np.uint16), np.array([255, 5, 7, 9], np.uint16)
    x = np.array([-2.5, 0.0, 1.5, 3.0, -0.125, 7.25] * 2, np.float32)  # exact in fixed point
    i = np.array([2, -1, 9], np.int32)
    check(secret_divisors_and_positions, a, d, u, v, x, i)


def points_of_several_axes(x: Any, i: Any, j: Any, k: Any, u: Any) -> dict[str, Any]:
    return {
        "get_ij": x[i, j], "get_ik": x[i, :, k], "get_ijk": x[i, j, k],
        "get_clipped": x.at[i + 1, j].get(mode="clip"), "set_ij": x.at[i, j].set(u),
        "add_ij": x.at[i, j].add(u), "set_ik": x.at[i, :, k].set(u[:, :4]),
        "add_ijk": x.at[i, j, k].add(u[:, 0]), "set_dropped": x.at[i + 2, j].set(u),
    }  # fmt: skip


def test_points_of_several_axes_are_read_and_written_at_secret_indices():
    """x[i, j], x[i, :, k] and their writes: the indexed axes merged into one, each point a
    row of it (negative indices wrapping, clipped reads, writes past the end dropped)."""
    x = (np.arange(60, dtype=np.float32).reshape(3, 4, 5) * 0.5 - 7).astype(np.float32)
    i, j = np.array([2, 0, -1, 1], np.int32), np.array([3, 0, 1, -2], np.int32)
    k = np.array([4, 0, 2, 1], np.int32)
    u = np.tile(np.array([1.5, -2.0, 0.25, 4.0, 8.0], np.float32), (4, 1))
    check(points_of_several_axes, x, i, j, k, u)


def sixty_four_bit_divisions(a: Any, d: Any, u: Any, v: Any, s: Any) -> dict[str, Any]:
    varying = jnp.array([3, -4, 5, 6], jnp.int32)
    return {
        "div": lax.div(a, d), "rem": lax.rem(a, d), "floor_divide": a // d, "modulo": a % d,
        "unsigned_div": u // v, "unsigned_rem": u % v, "by_constant": a // 7,
        "by_varying_constants": s // varying, "rem_varying": s % varying,
    }  # fmt: skip


@pytest.mark.slow
def test_64_bit_integers_and_varying_public_divisors_divide_exactly():
    """Long division over 64 bits: int64's extremes (its minimum's magnitude is 2^63),
    uint64 divisors past 2^63 and dividends near 2^64; public divisors that differ per
    element go the same way."""
    a = np.array([17, -17, 2**62 + 12345, -(2**63), 2**63 - 1, -5, 0, 1000], np.int64)
    d = np.array([5, 5, -(2**40) - 7, 3, -(2**63), 7, 9, -1], np.int64)
    u = np.array([2**64 - 1, 2**63 + 5, 17, 12345678901234], np.uint64)
    v = np.array([2**63 + 1, 3, 2**64 - 2, 10], np.uint64)
    s = np.array([100, -37, 55, 9], np.int32)

    got = secure(sixty_four_bit_divisions, a, d, u, v, s)
    with jax.enable_x64(True):
        want = jax.jit(sixty_four_bit_divisions)(a, d, u, v, s)
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype, name
        np.testing.assert_array_equal(got[name], w, err_msg=name)


def divisors_in_common(a: Any, b: Any, h: Any, k: Any) -> dict[str, Any]:
    return {"gcd": jnp.gcd(a, b), "lcm": jnp.lcm(h, k)}


@pytest.mark.slow
def test_gcd_and_lcm_run_a_fixed_number_of_binary_gcd_steps():
    """jnp.gcd loops while a secret is nonzero; inside `run` it is Stein's binary GCD for
    2w steps (zeros, signs, int32's largest values, a power of two), and jnp.lcm on it."""
    a = np.array([12, -18, 0, 0, 7, 2**31 - 1, 48, 1024, -35, 2**30], np.int32)
    b = np.array([18, 12, 5, 0, 0, 2**31 - 2, -36, 96, 49, 3 * 2**20], np.int32)
    h = np.array([4, -6, 0, 21, 120], np.int16)
    k = np.array([6, 4, 9, -14, 100], np.int16)
    check(divisors_in_common, a, b, h, k)


def sealed_bools(a: Any, b: Any) -> dict[str, Any]:
    return {
        "not": jnp.logical_not(a), "invert": ~a, "and": a & b, "or": jnp.logical_or(a, b),
        "xor": a ^ b, "any": jnp.any(a), "all": jnp.all(b), "where": jnp.where(a, 1.5, -2.0),
    }  # fmt: skip


def test_sealed_bools_take_logic():
    """A sealed bool is held as arithmetic 0/1 shares; logic takes its lowest bit."""
    check(sealed_bools, np.array([True, False, True, False]), np.array([True, True, False, False]))


def sorted_searches(a: Any, x: Any, s: Any) -> dict[str, Any]:
    return {
        "sort_bool": jnp.sort(a), "argsort_bool": jnp.argsort(a),
        "searchsorted": jnp.searchsorted(s, x), "interp": jnp.interp(x, s, s * 2.0),
    }  # fmt: skip


@pytest.mark.slow
def test_bools_sort_and_secret_values_are_searched_in_secret_sorted_ones():
    """Bools sort as 0 and 1; searchsorted's binary search (lax's total-order comparisons and
    a gather that keeps the row's axis) and interp run at secret positions."""
    a = np.array([True, False, True, False, False])
    x = np.array([3.0, -1.0, 2.5, 0.5, 7.0], np.float32)  # interp at knots: exact in fixed point
    check(sorted_searches, a, x, np.array([-2.0, 0.0, 1.0, 4.0], np.float32))


def powers(x: Any, y: Any, z: Any) -> dict[str, Any]:
    exponents = jnp.array([1.0, 2.0, 0.5, 3.0, 2.0, 2.5, 2.0, -1.0], jnp.float32)
    return {
        "float_power": jnp.float_power(x, y), "power_secret": z ** y.astype(jnp.float32),
        "power_array": z ** exponents,
        "tiny_base": jnp.float_power(jnp.abs(z) * 1e-6, jnp.abs(z) * 1e-5),
    }  # fmt: skip


@pytest.mark.slow
def test_powers_keep_the_sign_of_a_negative_base_to_an_odd_whole_exponent():
    """x ** y for a secret y, or public exponents that differ per element: exp(y log |x|)
    with the sign of a negative base to an odd whole power, and 0 ** y (where it is not inf),
    at exp's and log's errors; a base below fixed point's resolution to a tiny power stays
    near 1, as floats give."""
    x = np.array([-1, 2, -3, 0, 5, 0, -2, 3], np.int16)
    y = np.array([3, 2, 2, 3, -1, 0, 1, 3], np.int16)
    z = np.array([2.0, 0.5, 3.0, -2.0, 0.0, 1.5, -1.5, 4.0], np.float32)
    y = np.where((z == 0) & (y < 0), 1, y).astype(np.int16)  # 0 ** -1 is inf: no fixed point
    check(powers, x, y, z)


def remainders_of_reals(x: Any, y: Any) -> dict[str, Any]:
    return {"fmod": jnp.fmod(x, y), "mod": x % y, "floor_divide": x // y, "mod_public": x % 2.5}


@pytest.mark.slow
def test_remainders_of_reals_are_exact_on_their_fixed_point_encodings():
    """fmod of the encodings is the encoding of fmod: exact where x and y are (dyadic), both
    signs, an exact multiple giving 0 rather than y."""
    x = np.array([5.5, -5.5, 6.0, -7.25, 100.75, 3.0, -0.5], np.float32)
    y = np.array([1.5, 1.5, -1.5, 2.0, -7.0, 3.0, 4.0], np.float32)
    check(remainders_of_reals, x, y)


NUMPY = {
    "cos": np.cos, "sin": np.sin, "erf": scipy.special.erf, "erfc": scipy.special.erfc,
    "exp2": np.exp2, "expm1": np.expm1, "sinh": np.sinh, "cosh": np.cosh,
    "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh, "cbrt": np.cbrt,
    "tan": np.tan, "atan": np.arctan, "asin": np.arcsin, "acos": np.arccos,
    "atan2": lambda x: np.arctan2(x, np.roll(x, 200) + 0.5),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_IDENTITIES))
def test_each_identity_a_rule_evaluates_is_the_function_jax_computes(name: str):
    grid = np.linspace(-3.0, 3.0, 601)
    domain = {
        "acosh": grid[grid >= 1.0], "atanh": grid[np.abs(grid) < 0.99] / 3.0,
        "tan": grid / 3.0, "asin": grid / 3.0, "acos": grid / 3.0, "atan": grid * 40.0,
    }  # fmt: skip
    x = domain.get(name, grid)
    want = NUMPY[name]
    args = (x, np.roll(x, 200) + 0.5) if name == "atan2" else (x,)
    with jax.enable_x64(True):
        got = np.asarray(_IDENTITIES[name](*map(jnp.asarray, args)))
    np.testing.assert_allclose(got, want(x), rtol=1e-9, atol=2e-7, err_msg=name)
