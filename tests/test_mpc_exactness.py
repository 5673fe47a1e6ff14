"""`mp.mpc` is never silently wrong inside its documented range, on the Simulator.

- Precise truncation (the default): every fixed-point product, square, dot, product by a
  public real and division by a public real, for a million inputs per magnitude decade of the
  result from 1 to the range limit 2^(62 - 2f) = 2^26 (edges included), is the exact ring
  result floor(p / 2^m) or one above it: never further. The inputs lie on the fixed-point
  grid, so the exact ring product p is known here in int64.
- `truncation="probabilistic"` is the faster protocol whose rare large errors the default
  removes: at products around 1e6 some results are off by about 2^28.
- exp over its whole input range [-16, 16] on a million inputs stays within its bound.
- Comparisons, max/min, sign and equality on int64 and uint64 are exact over the whole range.
- `seal` refuses, at the owner, reals fixed point cannot hold (NaN, infinities, |v| >= 2^44),
  with a typed error naming the value and the range, wherever the value is read: by a run
  whose function reads it, by `reveal`, as a program's output, as a branch's result. A
  function that does not read it (`jnp.imag`, `jnp.isreal`) computes what JAX computes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpplug as mp
from mpplug.errors import PartyError, TraceError

F = mp.mpc.DEFAULT_FRAC_BITS
TIMEOUT = 300.0
PER_DECADE = 1_000_000
LIMIT = 2.0 ** (62 - 2 * F)  # |x y| below this: a product is in range
DECADES = [(10.0**k, 0.25, 2.25) for k in range(8)] + [(LIMIT, 0.9, 0.999)]
"""(scale, low, high): |x y| uniform-ish in [low, high] * scale; the last is the range's edge."""
SCALE, THIRD = 0.3712, 7.0
"""A public real below 1 (encoded with one extra fraction bit) and a public divisor."""


def _ring(x: np.ndarray) -> np.ndarray:
    return np.round(x * 2.0**F).astype(np.int64)


def _public_bits(c: float) -> int:
    """Fraction bits `mp.mpc` gives a public factor c (`rules.arithmetic.times_public`)."""
    return F + (min(20, int(np.floor(-np.log2(abs(c))))) if abs(c) < 1 else 0)


def _decade_inputs(rng: np.random.Generator, scale: float, low: float, high: float) -> Any:
    """x, y on the fixed-point grid with |x y| in [low, high] * scale, random signs."""
    root = np.sqrt(scale)
    u = rng.uniform(np.sqrt(low), np.sqrt(high), PER_DECADE)
    v = rng.uniform(np.sqrt(low), np.sqrt(high), PER_DECADE)
    sign = rng.choice([-1.0, 1.0], PER_DECADE)
    x, y = sign * u * root, v * root
    return _ring(x) / 2.0**F, _ring(y) / 2.0**F


ROWS = (-1, 4)
"""The dot's operands: rows of 4 of x/2 and y/2 (on the grid), so each row's sum of four
products stays in the decade."""


def _products(x: jnp.ndarray, y: jnp.ndarray, hx: jnp.ndarray, hy: jnp.ndarray) -> Any:
    halves = jnp.einsum("ij,ij->i", hx.reshape(ROWS), hy.reshape(ROWS))
    return {
        "x * y": x * y,
        "x * x": jnp.square(x),
        "x * 0.3712": x * SCALE,
        "x * 1234.5": x * 1234.5,
        "x / 7": x / THIRD,
        "rows of x/2 . rows of y/2": halves,
    }


def _halves(x: np.ndarray) -> np.ndarray:
    return (_ring(x) >> 1) / 2.0**F


def _expected_ring(x: np.ndarray, y: np.ndarray) -> dict[str, tuple[np.ndarray, int]]:
    """Per output: the exact ring value before truncation, and the bits truncated."""
    xr, yr = _ring(x), _ring(y)
    c_bits, d_bits = _public_bits(SCALE), _public_bits(1.0 / THIRD)
    half_x, half_y = _ring(_halves(x)), _ring(_halves(y))
    return {
        "x * y": (xr * yr, F),
        "x * x": (xr * xr, F),
        "x * 0.3712": (xr * round(SCALE * 2.0**c_bits), c_bits),
        "x * 1234.5": (xr * round(1234.5 * 2.0**F), F),
        "x / 7": (xr * round(2.0**d_bits / THIRD), d_bits),
        "rows of x/2 . rows of y/2": ((half_x.reshape(ROWS) * half_y.reshape(ROWS)).sum(1), F),
    }


@mp.function
def _product_program(x: Any, y: Any, hx: Any, hy: Any, truncation: str) -> Any:
    sealed = mp.mpc.seal((x, y, hx, hy), truncation=truncation)
    return mp.mpc.reveal(mp.mpc.run(_products, *sealed), to=0)


def _evaluate(sim: mp.Simulator, x: np.ndarray, y: np.ndarray, truncation: str) -> Any:
    handles = (sim.put(0, x), sim.put(1, y), sim.put(0, _halves(x)), sim.put(1, _halves(y)))
    return sim.fetch(sim.evaluate(_product_program, *handles, truncation), party=0)


@pytest.mark.slow
def test_precise_truncation_is_within_one_unit_for_a_million_inputs_per_decade():
    rng = np.random.default_rng(20)
    failures = []
    with mp.Simulator(3, timeout=TIMEOUT) as sim:
        for scale, low, high in DECADES:
            x, y = _decade_inputs(rng, scale, low, high)
            out = _evaluate(sim, x, y, "precise")
            for name, (exact, bits) in _expected_ring(x, y).items():
                got = np.round(out[name] * 2.0**F).astype(np.int64)
                offset = got - (exact >> bits)  # floor(p / 2^m) or one above it
                bad = (offset < 0) | (offset > 1)
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    failures.append(
                        f"{name} at |x y| ~ {scale:.3g}: {int(bad.sum())} of {bad.size} off "
                        f"by more than one unit, e.g. {int(offset[i])} units"
                    )
    assert not failures, "\n".join(failures)


def test_probabilistic_truncation_fails_rarely_and_by_a_lot():
    rng = np.random.default_rng(21)
    x, y = _decade_inputs(rng, 1e6, 0.25, 2.25)
    with mp.Simulator(3, timeout=TIMEOUT) as sim:
        out = _evaluate(sim, x, y, "probabilistic")
    err = np.abs(out["x * y"] - x * y)
    wrong = err > 1e-3
    # a failure is off by 2^(64 - 2f) = 2^28; its rate is about |x y| / 2^28 (0.4% here)
    assert 0.001 < wrong.mean() < 0.02, wrong.mean()
    assert np.all(np.abs(err[wrong] - 2.0**28) < 2.0**10)


def test_exp_over_its_whole_range_on_a_million_inputs():
    x = np.random.default_rng(22).uniform(-16, 16, PER_DECADE)
    x[:4] = [-16.0, 16.0, 0.0, 8.0]
    x = _ring(x) / 2.0**F

    @mp.function
    def program(v: Any) -> Any:
        return mp.mpc.reveal(mp.mpc.run(jnp.exp, mp.mpc.seal(v)), to=0)

    with mp.Simulator(3, timeout=TIMEOUT) as sim:
        got = sim.fetch(sim.evaluate(program, sim.put(0, x)), party=0)
    t = x / 256
    method = (1 + t + t**2 / 2) ** 256  # exp's documented method; its own error is exact
    bound = 4 * 2.0**-F + 5e-3 * method
    err = np.abs(got - method)
    assert np.all(err <= bound), (x[np.argmax(err / bound)], float(np.max(err / bound)))


I64 = np.iinfo(np.int64)
EDGES = np.array([I64.min, I64.min + 1, -(2**62), -1, 0, 1, 2**62, I64.max], np.int64)


def _order_cases() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(23)
    x = np.concatenate([np.repeat(EDGES, len(EDGES)), rng.integers(I64.min, I64.max, 4000)])
    y = np.concatenate([np.tile(EDGES, len(EDGES)), rng.integers(I64.min, I64.max, 4000)])
    y[-500:] = x[-500:]  # ties
    return x.astype(np.int64), y.astype(np.int64)


def _orders(x: jnp.ndarray, y: jnp.ndarray) -> dict[str, jnp.ndarray]:
    both = jnp.concatenate([x[None], y[None]])
    return {
        "lt": x < y,
        "le": x <= y,
        "gt": x > y,
        "ge": x >= y,
        "eq": x == y,
        "ne": x != y,
        "max": jnp.maximum(x, y),
        "min": jnp.minimum(x, y),
        "max over an axis": jnp.max(both, axis=0),
        "argmin": jnp.argmin(both, axis=0),
    }


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
@pytest.mark.slow
def test_64_bit_comparisons_are_exact_over_the_whole_range(dtype: Any):
    x, y = (v.astype(dtype) for v in _order_cases())

    def run(u: jnp.ndarray, v: jnp.ndarray) -> dict[str, jnp.ndarray]:
        if dtype == np.uint64:  # the same rules; only the offset by 2^63 is new
            outs = {k: f for k, f in _orders(u, v).items() if k in ("lt", "ge", "eq", "max")}
            return {**outs, "sign": jnp.sign(u)}  # 0 or 1 for unsigned values
        outs = _orders(u, v)
        outs["sign"] = jnp.sign(u)
        outs["clamp"] = lax.clamp(np.int64(-(2**62)), u, np.int64(2**62))
        return outs

    @mp.function
    def program(a: Any, b: Any) -> Any:
        s, t = mp.mpc.seal((a, b))
        return mp.mpc.reveal(mp.mpc.run(run, s, t), to=0)

    with mp.Simulator(3, timeout=TIMEOUT) as sim:
        got = sim.fetch(sim.evaluate(program, sim.put(0, x), sim.put(1, y)), party=0)
    with jax.enable_x64(True):
        want = jax.tree.map(np.asarray, run(jnp.asarray(x), jnp.asarray(y)))
    wrong = {k: int((np.asarray(got[k]) != want[k]).sum()) for k in want}
    assert wrong == {k: 0 for k in want}, wrong


@mp.function
def _sealed_sum(v: Any) -> Any:
    return mp.mpc.reveal(mp.mpc.run(lambda a: a.sum(), mp.mpc.seal(v)), to=0)


@pytest.mark.parametrize(
    ("bad", "shown"),
    [(np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf"), (2.0**44, "|v| >= 1.75922e+13")],
)
def test_seal_refuses_reals_fixed_point_cannot_hold(bad: float, shown: str):
    values = np.array([1.0, -2.5, bad, 3.0])
    with mp.Simulator(3, timeout=TIMEOUT) as sim, pytest.raises(PartyError) as caught:
        sim.fetch(sim.evaluate(_sealed_sum, sim.put(1, values)))
    error = caught.value
    assert error.party == 1 and error.error_type == "FixedPointRangeError"
    assert "mp.mpc.seal leaf 0 (f64[4]" in error.message
    assert "frac_bits=18 holds |v| < 2^44" in error.message
    assert f"got {shown}" in error.message and "at index (2,)" in error.message
    assert "17592186044416" not in error.message  # a finite value is not shown


OUT_OF_RANGE = np.array([[1.0, np.inf, -np.inf], [2.0, np.nan, 2.0**50]], np.float32)


@pytest.mark.parametrize("fn", [jnp.imag, jnp.iscomplex, jnp.isreal, jnp.isrealobj])
def test_reals_a_function_does_not_read_may_be_out_of_range(fn: Any):
    @mp.function
    def program(v: Any) -> Any:
        return mp.mpc.reveal(mp.mpc.run(fn, mp.mpc.seal(v)), to=0)

    with mp.Simulator(3, timeout=TIMEOUT) as sim:
        got = sim.fetch(sim.evaluate(program, sim.put(2, OUT_OF_RANGE)), party=0)
    want = np.asarray(fn(OUT_OF_RANGE))
    assert got.dtype == want.dtype and np.array_equal(got, want)


def _branch_sealed(v: Any) -> Any:
    flag = mp.run_jax(lambda x: x.size > 0, v)
    sealed = mp.cond(mp.bcast(2, flag), lambda a: mp.mpc.seal(a), lambda a: mp.mpc.seal(a), v)
    return mp.mpc.reveal(mp.mpc.run(jnp.isreal, sealed), to=0)


@pytest.mark.parametrize(
    "program",
    [
        lambda v: mp.mpc.reveal(mp.mpc.run(lambda a: a[0, 0] + 1, mp.mpc.seal(v)), to=0),
        lambda v: mp.mpc.reveal(mp.mpc.seal(v), to=0),
        lambda v: mp.mpc.seal(v),
        _branch_sealed,
    ],
    ids=["read-by-run", "revealed", "returned", "left-its-branch"],
)
def test_reals_out_of_range_fail_where_they_are_read(program: Any):
    with mp.Simulator(3, timeout=TIMEOUT) as sim, pytest.raises(PartyError) as caught:
        sim.fetch(sim.evaluate(mp.function(program), sim.put(2, OUT_OF_RANGE)))
    error = caught.value
    assert error.party == 2 and error.error_type == "FixedPointRangeError"
    assert "got inf at index (0, 1) (4 of 6 elements outside)" in error.message


def test_seal_accepts_reals_just_inside_the_range():
    values = np.array([2.0**44 - 1.0, -(2.0**44) + 1.0, 0.5])
    with mp.Simulator(3, timeout=TIMEOUT) as sim:
        assert sim.fetch(sim.evaluate(_sealed_sum, sim.put(0, values)), party=0) == pytest.approx(
            0.5
        )


def test_probabilistic_truncation_alone_by_public_constants():
    """A program whose only randomness is the probabilistic truncation's mask (used by two
    roles of three): the third role draws nothing, and the two that do agree."""

    @mp.function
    def program(v: Any) -> Any:
        sealed = mp.mpc.seal(v, truncation="probabilistic")
        return mp.mpc.reveal(mp.mpc.run(lambda x: (x * 0.5, x / 3.0, jnp.mean(x)), sealed), to=0)

    # small values: a probabilistic truncation of a million of them fails with p ~ 1e-4
    x = np.random.default_rng(24).uniform(-0.01, 0.01, 100_000)
    with mp.Simulator(3, timeout=TIMEOUT) as sim:
        half, third, mean = sim.fetch(sim.evaluate(program, sim.put(0, x)), party=0)
    # 1/3 and 1/4 are encoded with 20 fraction bits: relative error at most 2^-18
    for got, want in ((half, x * 0.5), (third, x / 3.0), (mean, x.mean())):
        np.testing.assert_allclose(got, want, rtol=2.0**-F, atol=2 * 2.0**-F)


def test_seal_names_an_unknown_truncation():
    @mp.function
    def program(v: Any) -> Any:
        return mp.mpc.seal(v, truncation="fast")

    with pytest.raises(TraceError, match="expected truncation in 'precise', 'probabilistic'"):
        mp.compile(program, mp.MPObject(np.zeros(2), 0), world_size=3)


def test_sealed_values_of_different_truncations_do_not_mix():
    @mp.function
    def program(a: Any, b: Any) -> Any:
        x = mp.mpc.seal(a)
        y = mp.mpc.seal(b, truncation="probabilistic")
        return mp.mpc.run(lambda u, v: u * v, x, y)

    args = (mp.MPObject(np.zeros(2), 0), mp.MPObject(np.zeros(2), 1))
    with pytest.raises(TraceError, match="sealed arguments disagree"):
        mp.compile(program, *args, world_size=3)
