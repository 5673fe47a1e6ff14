"""Sorting, secret control flow and secret indexing inside `mp.mpc.run`, against plain JAX:
`jnp.sort` (any axis, descending), a stable `argsort` with ties, a public payload sorted by
secret keys (its values exact where a float32 sum of two would round), `lax.top_k`,
`jnp.median`;
`lax.cond` / `lax.switch` / `select_n` over three cases with secret predicates and indices;
`table[i]`, `jnp.take` and `jnp.take_along_axis` with secret indices into secret and public
tables (negative indices too), `lax.dynamic_slice` and `lax.dynamic_update_slice` with secret
starts (clamped as lax clamps them). Then what is refused, with the primitive and the way out
named."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpplug as mp
from mpplug.errors import TraceError
from mpplug.mpc.rules import selection

rng = np.random.default_rng(11)
X = rng.normal(size=(3, 9)).astype(np.float32)
X[1, 2] = X[1, 6]  # a tie
K = np.array([3, -1, 3, 0, -1, 3, 2], np.int32)  # ties: argsort keeps their order
T = rng.normal(size=(37,)).astype(np.float32)
IDX = np.array([[0, 36, 5], [17, 17, 2]], np.int32)
J = np.int32(2)
PUBLIC = rng.normal(size=(37,)).astype(np.float32)
LARGE = np.array([2.0, 2.0**23 - 0.5, 1.25], np.float32)  # a float32 sum of two rounds


def computations(x: Any, k: Any, t: Any, i: Any, j: Any) -> dict[str, Any]:
    m = x[:, :6]
    return {
        "sort_rows": jnp.sort(x, axis=1),
        "sort_columns": jnp.sort(x, axis=0),
        "sort_descending": jnp.sort(x[0], descending=True),
        "argsort_stable": jnp.argsort(k),
        "sort_ints": jnp.sort(k),
        "sort_public_payload": lax.sort((k[1:4], jnp.asarray(LARGE)), num_keys=1),
        "top_k": lax.top_k(x, 3),
        "median": jnp.median(x, axis=1),
        "cond": lax.cond(x[0, 0] > 0, lambda v: (v * 2, v > 0), lambda v: (v - 1, v < 0), x[0]),
        "switch": lax.switch(
            j, [lambda v: v, lambda v: v * v, lambda v: -v, lambda v: v + 3], x[1]
        ),
        "select_n_3": lax.select_n(jnp.clip(j - 1 + (x[2] > 0), 0, 2), x[0], -x[1], 2 * x[2]),
        "take": t[i],
        "take_public_table": jnp.asarray(PUBLIC)[i],
        "take_negative": t[-j],
        "take_columns": jnp.take(m, jnp.minimum(i[0], 5), axis=1),
        "take_along_axis": jnp.take_along_axis(x[:2], jnp.minimum(i[:, :2], 8) - 4, axis=1),
        "take_along_public": jnp.take_along_axis(jnp.asarray(PUBLIC)[None], i, axis=1),
        "dynamic_slice": lax.dynamic_slice(m, (j - 1, 2), (2, 3)),
        "dynamic_update": lax.dynamic_update_slice(m, jnp.ones((2, 2)) * 7, (j - 1, j)),
        "dynamic_update_clamped": lax.dynamic_update_slice(x[0], x[1, :3] * 2, (j + 8,)),
        "dynamic_slice_clamped": lax.dynamic_slice(m, (j + 4, j), (2, 3)),
    }


@pytest.mark.slow
def test_sorting_secret_branches_and_secret_indices_compute_what_jax_computes():
    @mp.function
    def program(*args: Any) -> Any:
        return mp.mpc.reveal(mp.mpc.run(computations, *mp.mpc.seal(args)), to=0)

    with mp.Simulator(3) as sim:
        handles = [sim.put(n % 3, v) for n, v in enumerate((X, K, T, IDX, J))]
        got = sim.fetch(sim.evaluate(program, *handles), party=0)
    assert_as_jax(got, computations(X, K, T, IDX, J), atol=1e-5)


def assert_as_jax(got: dict[str, Any], want: dict[str, Any], atol: float) -> None:
    """Each named result as JAX computed it: its shape and dtype, reals within `atol`, the
    rest exactly."""
    assert set(got) == set(want)
    for name in want:
        for g, w in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name]), strict=True):
            g, w = np.asarray(g), np.asarray(w)
            assert g.shape == w.shape and g.dtype == w.dtype, name
            if np.issubdtype(w.dtype, np.floating):
                np.testing.assert_allclose(g, w, atol=atol, err_msg=name)
            else:
                np.testing.assert_array_equal(g, w, err_msg=name)


def refused(fn: Any, *args: np.ndarray) -> str:
    @mp.function
    def program(*values: Any) -> Any:
        return mp.mpc.reveal(mp.mpc.run(fn, *mp.mpc.seal(values)), to=0)

    with mp.Simulator(3) as sim, pytest.raises(TraceError) as caught:
        sim.compile(program, *(sim.put(0, a) for a in args))
    return str(caught.value)


def batcher_lower_ends(n: int) -> list[list[int]]:
    """The lower ends of each layer of Batcher's odd-even merge sort over 2^ceil(log2 n)
    elements, keeping the comparators that stay below n (the textbook loops)."""
    m, layers, p = 1 << (n - 1).bit_length(), [], 1
    while p < m:
        k = p
        while k >= 1:
            layers.append(
                [
                    i + j
                    for j in range(k % p, m - k, 2 * k)
                    for i in range(min(k, m - j - k))
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p) and i + j + k < n
                ]
            )
            k //= 2
        p *= 2
    return layers


@pytest.mark.parametrize("n", [2, 3, 5, 9, 16, 17, 100, 1001])
def test_the_sorting_network_is_batchers_over_exactly_n_and_sorts(n: int):
    """The secure sort's network, run in plaintext: each layer's comparators are Batcher's
    with those past n dropped, in n // 2 slots; it sorts ties and keeps payloads stable."""
    layers = batcher_lower_ends(n)
    assert len(selection._layers(n)) == len(layers)
    for (lp, lk), want in zip(selection._layers(n), layers, strict=True):
        lower, kept, source = map(np.asarray, selection._comparators(lp, lk, n))
        assert lower.shape == (n // 2,)
        assert sorted(lower[kept].tolist()) == want
        k, moved = 1 << int(lk), np.zeros(n, bool)
        moved[lower[kept]] = moved[lower[kept] + k] = True
        assert (source[lower[kept]] == n + np.flatnonzero(kept)).all()
        assert (source[lower[kept] + k] == n + n // 2 + np.flatnonzero(kept)).all()
        assert (source[~moved] == np.flatnonzero(~moved)).all()
    keys = np.random.default_rng(n).integers(-3, 3, size=(2, n)).astype(np.int32)
    payload = np.arange(2 * n, dtype=np.int32).reshape(2, n)
    got_keys, got_payload = jax.jit(selection._network(2, 1, 1))(keys, payload)
    order = np.argsort(keys, axis=1, kind="stable")
    np.testing.assert_array_equal(got_keys, np.take_along_axis(keys, order, 1))
    np.testing.assert_array_equal(got_payload, np.take_along_axis(payload, order, 1))


def test_the_sorting_network_sorts_every_input_of_zeros_and_ones():
    """The 0-1 principle: a network that sorts every 0-1 input sorts every input."""
    for n in range(2, 13):
        bits = np.array(np.unravel_index(np.arange(2**n), (2,) * n), np.int32)
        (got,) = jax.jit(selection._network(1, 1, 0))(bits)
        assert (np.diff(np.asarray(got), axis=0) >= 0).all(), n


def test_a_while_loop_on_secrets_is_refused_with_the_way_out():
    message = refused(lambda x: lax.while_loop(lambda v: v[0] < 10, lambda v: v * 2, x), X[0])
    assert "lax.while_loop on secrets is not supported" in message
    assert "lax.fori_loop with constant bounds" in message


def _windows_at(m: Any, i: Any) -> Any:
    """Windows of two rows starting at the points (i, i): a gather no rule reads."""
    dims = lax.GatherDimensionNumbers(
        offset_dims=(1,), collapsed_slice_dims=(1,), start_index_map=(0, 1)
    )
    return lax.gather(m, jnp.stack([i, i], axis=1), dims, slice_sizes=(2, 1))


def test_a_gather_of_windows_at_secret_points_is_refused_naming_what_works():
    message = refused(_windows_at, X, np.array([0, 1], np.int32))
    assert "gather with secret indices is supported for reading whole rows" in message
    assert "or points of several (table[i, j])" in message


def _write_windows_at(m: Any, i: Any) -> Any:
    dims = lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(1,), scatter_dims_to_operand_dims=(0, 1)
    )
    return lax.scatter(m, jnp.stack([i, i], axis=1), jnp.zeros((2, 2), m.dtype), dims)


def test_a_scatter_of_windows_at_secret_points_is_refused_naming_what_works():
    message = refused(_write_windows_at, X, np.array([0, 1], np.int32))
    assert "scatter at secret indices writes whole rows along one axis" in message
    assert "or points of several (x.at[i, j].set(v))" in message
