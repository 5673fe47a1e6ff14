"""Loops inside `mp.mpc.run`: `lax.fori_loop` with a static trip count and `lax.scan` run on
shares, unrolled, and compute what the unrolled Python loop and plain JAX compute."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import mpplug as mp

rng = np.random.default_rng(7)
X = rng.normal(size=(40, 3))
Y = (rng.random(40) < 0.5).astype(np.float64)
W = np.zeros(3)


def step(x: Any, y: Any, w: Any) -> Any:
    return w - 0.5 * (x.T @ (jax.nn.sigmoid(x @ w) - y)) / x.shape[0]


def with_fori(x: Any, y: Any, w: Any) -> Any:
    return jax.lax.fori_loop(0, 3, lambda i, w: step(x, y, w), w)


def unrolled(x: Any, y: Any, w: Any) -> Any:
    for _ in range(3):
        w = step(x, y, w)
    return w


def secure(fn: Any) -> mp.MPFunction:
    @mp.function
    def program(x: Any, y: Any, w: Any) -> Any:
        return mp.mpc.reveal(mp.mpc.run(fn, *(mp.mpc.seal(v) for v in (x, y, w))), to=0)

    return program


def test_a_fori_loop_computes_what_the_unrolled_loop_does():
    with mp.Simulator(3) as sim:
        args = [sim.put(i, v) for i, v in enumerate((X, Y, W))]
        looped = sim.fetch(sim.evaluate(secure(with_fori), *args), party=0)
        plain = sim.fetch(sim.evaluate(secure(unrolled), *args), party=0)
    want = np.asarray(jax.jit(unrolled)(X, Y, W))
    np.testing.assert_allclose(looped, want, atol=2e-3)
    np.testing.assert_allclose(looped, plain, atol=2e-3)
    assert np.abs(want).max() > 0.05  # the loop moved the weights


def test_a_scan_carries_and_stacks_secret_values():
    def running(xs: Any) -> Any:
        return jax.lax.scan(lambda c, r: (c + r, c * r), 0.0, xs, reverse=False)

    def backwards(xs: Any) -> Any:
        return jax.lax.scan(lambda c, r: (c * 0.5 + r, c > r), 1.0, xs, reverse=True)

    xs = np.array([0.5, -1.25, 2.0, 3.5, -0.75])

    @mp.function
    def program(v: Any) -> Any:
        sealed = mp.mpc.seal(v)
        return mp.mpc.reveal((mp.mpc.run(running, sealed), mp.mpc.run(backwards, sealed)), to=0)

    with mp.Simulator(3) as sim:
        (total, products), (last, greater) = sim.fetch(sim.evaluate(program, sim.put(0, xs)), 0)
    want_total, want_products = jax.jit(running)(xs)
    want_last, want_greater = jax.jit(backwards)(xs)
    np.testing.assert_allclose(total, want_total, atol=1e-4)
    np.testing.assert_allclose(products, want_products, atol=1e-4)
    np.testing.assert_allclose(last, want_last, atol=1e-4)
    np.testing.assert_array_equal(greater, np.asarray(want_greater))
    assert jnp.asarray(greater).dtype == jnp.bool_


def test_scan_operand_counts_are_read_from_either_jax_layout():
    from mpplug.mpc.interpreter import _scan_counts

    assert _scan_counts({"num_consts": 2, "num_carry": 1}) == (2, 1)  # JAX 0.10
    assert _scan_counts({"ft_in": ((None,), (None, None), ())}) == (1, 2)  # JAX 0.11
    assert _scan_counts({"ft_in": (None, (None,), ())}) is None  # unknown: a TraceError
