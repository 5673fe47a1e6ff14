"""Convolutions and pooling inside `mp.mpc.run` against plain JAX: `conv_general_dilated` in
every form (strides, SAME and explicit padding, dilation, feature groups, NHWC, a public
kernel), max/min/average pooling with and without padding, the gradients of a
conv-ReLU-max-pool block under `jax.grad` (convolutions and `select_and_scatter_add`), and one
training step of a small CNN."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpplug as mp
from mpplug.errors import TraceError

rng = np.random.default_rng(0)
X = rng.normal(size=(2, 3, 7, 7)).astype(np.float32)
K = (rng.normal(size=(4, 3, 3, 3)) * 0.3).astype(np.float32)
KG = (rng.normal(size=(6, 1, 3, 3)) * 0.3).astype(np.float32)
X[0, 0, 0, :2] = 1.5  # a tie inside a max-pool window: the first one takes the gradient


def conv(x: Any, k: Any, **kw: Any) -> Any:
    return lax.conv_general_dilated(x, k, **kw)


def pool(x: Any) -> Any:
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")


def block(x: Any, k: Any) -> Any:
    h = jax.nn.relu(conv(x, k, window_strides=(1, 1), padding="SAME"))
    return lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), "SAME")


def cnn_step(x: Any, k: Any, dense: Any) -> tuple[Any, Any]:
    """One SGD step of a small CNN (conv, ReLU, max-pool, dense) on squared error."""

    def loss(params: tuple[Any, Any]) -> Any:
        kernel, weights = params
        h = block(x, kernel).reshape(x.shape[0], -1)
        return jnp.mean((h @ weights - 1.0) ** 2)

    grads = jax.grad(loss)((k, dense))
    return k - 0.1 * grads[0], dense - 0.1 * grads[1]


def layers(x: Any, k: Any, kg: Any) -> dict[str, Any]:
    nhwc = jnp.transpose(x, (0, 2, 3, 1))
    hwio = jnp.transpose(k, (2, 3, 1, 0))
    return {
        "valid": conv(x, k, window_strides=(1, 1), padding="VALID"),
        "same_stride2": conv(x, k, window_strides=(2, 2), padding="SAME"),
        "dilated": conv(x, k, window_strides=(1, 1), padding=((1, 2), (0, 1)), rhs_dilation=(2, 1)),
        "groups": conv(x, kg, window_strides=(1, 1), padding="VALID", feature_group_count=3),
        "nhwc": conv(
            nhwc,
            hwio,
            window_strides=(1, 1),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ),
        "public_kernel": conv(x, jnp.ones((2, 3, 2, 2)), window_strides=(1, 1), padding="VALID"),
        "maxpool": pool(x),
        "maxpool_same": lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), "SAME"),
        "minpool": lax.reduce_window(x, jnp.inf, lax.min, (1, 1, 2, 2), (1, 1, 1, 1), "VALID"),
        "avgpool": lax.reduce_window(x, 0.0, lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID") / 4,
        "maxpool_grad": jax.grad(lambda x: jnp.sum(pool(x) * 2.0))(x),
        "maxpool_vjp_public_input": jax.vjp(pool, jnp.asarray(X))[1](x[:, :, :3, :3])[0],
        "cnn_step": cnn_step(x, k, jnp.tile(kg.reshape(-1), 2)[:64].reshape(64, 1) * 0.1),
        "grads": jax.grad(lambda x, k: jnp.sum(block(x, k) ** 2), argnums=(0, 1))(x, k),
    }


@pytest.mark.slow
def test_convolutions_and_pooling_compute_what_jax_computes():
    @mp.function
    def program(x: Any, k: Any, kg: Any) -> Any:
        return mp.mpc.reveal(mp.mpc.run(layers, *mp.mpc.seal((x, k, kg))), to=0)

    with mp.Simulator(3) as sim:
        handles = sim.put(0, X), sim.put(1, K), sim.put(2, KG)
        got = sim.fetch(sim.evaluate(program, *handles), party=0)
    want = jax.jit(layers)(X, K, KG)
    assert set(got) == set(want)
    for name in want:
        for g, w in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name]), strict=True):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            assert g.shape == w.shape, name
            scale = max(1.0, float(np.max(np.abs(w))))
            np.testing.assert_allclose(g, w, atol=1e-4 * scale, err_msg=name)
    tie = np.asarray(got["maxpool_grad"])[0, 0, 0, :2]
    assert tie.tolist() == [2.0, 0.0]  # a tie: the window's first maximum takes the gradient


def test_pooling_with_base_dilation_is_refused_with_the_primitive_named():
    @mp.function
    def program(x: Any) -> Any:
        dilated = lambda v: lax.reduce_window(  # noqa: E731
            v, -jnp.inf, lax.max, (2, 2), (1, 1), "VALID", base_dilation=(2, 1)
        )
        return mp.mpc.reveal(mp.mpc.run(dilated, mp.mpc.seal(x)), to=0)

    with (
        mp.Simulator(3) as sim,
        pytest.raises(TraceError, match="reduce_window_max with base dilation"),
    ):
        sim.compile(program, sim.put(0, np.ones((3, 3), np.float32)))
