"""The JAX plumbing model code hits inside `mp.mpc.run`: `stop_gradient` (in `jax.nn.softmax`
and `log_softmax`, with their `initial=-inf`), `jnp.stack`, and `jnp.any` / `jnp.all`
(`reduce_or` / `reduce_and`) over any axes, against plain JAX."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpplug as mp

rng = np.random.default_rng(5)
LOGITS = rng.normal(size=(3, 5)) * 3
V = rng.normal(size=(3, 5))


def plumbing(logits: Any, v: Any) -> dict[str, Any]:
    positive = v > 0
    return {
        "softmax": jax.nn.softmax(logits, axis=-1),
        "log_softmax": jax.nn.log_softmax(logits),
        "grad_of_cross_entropy": jax.grad(lambda z: -jax.nn.log_softmax(z)[:, 0].sum())(logits),
        "stack_secret_public": jnp.stack([logits, jnp.ones_like(logits)], axis=1),
        "stack_bits": jnp.stack([positive, logits > v]),
        "any_rows": jnp.any(positive, axis=1),
        "all_rows": jnp.all(positive, axis=1),
        "any_all": jnp.any(positive),
        "all_columns": jnp.all(v > -2.5, axis=0),
        "all_both_axes": jnp.all(positive, axis=(0, 1)),
    }


@pytest.mark.slow
def test_model_plumbing_computes_what_jax_computes():
    @mp.function
    def program(logits: Any, v: Any) -> Any:
        sealed = mp.mpc.seal((logits, v))
        return mp.mpc.reveal(mp.mpc.run(plumbing, *sealed), to=0)

    with mp.Simulator(3) as sim:
        got = sim.fetch(sim.evaluate(program, sim.put(0, LOGITS), sim.put(1, V)), party=0)
    with jax.enable_x64(True):  # the sealed inputs are float64
        want = jax.jit(plumbing)(LOGITS, V)
    assert set(got) == set(want)
    for name in want:
        g, w = np.asarray(got[name]), np.asarray(want[name])
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if w.dtype == np.bool_:
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, atol=2e-3, err_msg=name)
    assert np.asarray(want["any_rows"]).any() and not np.asarray(want["all_rows"]).all()
