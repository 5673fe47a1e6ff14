"""Protocol steps traced once per signature and spliced in: the same program bytes as tracing
each step in place, for fewer traces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import mpplug as mp
from mpplug.kernels.runtime import LRUCache
from mpplug.mpc import spliced
from mpplug.mpc.aby3 import ABY3


def model(x: Any, y: Any, d: Any, k: Any) -> Any:
    """Products and truncations, comparisons, a secret division (a loop), a sort."""
    h = jnp.maximum(x @ y, 0.0)
    z = jax_sigmoid(h) * x[:, :2]
    return z, jnp.sort(x[0] * 3.0), k // d, jnp.argmax(h, axis=1)


def jax_sigmoid(v: Any) -> Any:
    return 1.0 / (1.0 + jnp.exp(-v))


@mp.function
def program(x: Any, y: Any, d: Any, k: Any) -> Any:
    sealed = mp.mpc.seal((x, y, d, k))
    return mp.mpc.reveal(mp.mpc.run(model, *sealed), to=0)


ARGS = (
    np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3),
    np.linspace(0.5, -0.5, 6, dtype=np.float32).reshape(3, 2),
    np.array([3, -7, 5, 2], np.int32),
    np.array([100, 50, -9, 7], np.int32),
)


def _traced(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The digest of `program` traced afresh (no trace read from a cache)."""
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path / name))
    with mp.Simulator(3) as sim:
        handles = [sim.put(i % 3, a) for i, a in enumerate(ARGS)]
        return sim.compile(program, *handles).digest


def test_a_program_of_spliced_steps_is_the_program_traced_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spliced, "_steps", LRUCache())
    spliced_digest = _traced(tmp_path, "spliced", monkeypatch)
    again = _traced(tmp_path, "again", monkeypatch)  # every step read from the cache now
    monkeypatch.setattr(spliced, "_signature", lambda *args: None)  # each step in place
    in_place = _traced(tmp_path, "in_place", monkeypatch)
    assert spliced_digest == again == in_place


def test_a_step_called_inside_another_is_traced_into_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A comparison's msb calls ANDs and share lifts: they are traced into the msb, which
    holds no splice, and the program keeps the bytes of tracing every step in place."""
    steps: LRUCache[Any, Any] = LRUCache()
    monkeypatch.setattr(spliced, "_steps", steps)
    digest = _traced(tmp_path, "nested", monkeypatch)
    names = {key[1] for key in steps._data}
    assert {"msb", "mul", "b2a"} <= names, names
    for key, step in steps._data.items():
        inner = [e for e in step.closed.jaxpr.eqns if e.primitive is spliced.splice_p]
        assert not inner, f"{key[1]} splices {[e.params['step'] for e in inner]}"
    monkeypatch.setattr(spliced, "_signature", lambda *args: None)  # each step in place
    assert _traced(tmp_path, "in_place", monkeypatch) == digest


def test_a_step_is_traced_once_per_signature_and_draws_its_own_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(spliced, "_steps", LRUCache())
    traced = []
    truncation = ABY3._trunc_pair

    def counted(self: Any, ctx: Any, u: Any, bits: int) -> Any:
        traced.append(tuple(u.shape))
        return truncation(self, ctx, u, bits)

    monkeypatch.setattr(ABY3, "_trunc_pair", counted)

    def products(a: Any, b: Any) -> Any:
        for _ in range(4):
            a = a * b
        return a, a[:2] * b[:2]

    @mp.function
    def chain(x: Any, y: Any) -> Any:
        return mp.mpc.reveal(mp.mpc.run(products, *mp.mpc.seal((x, y))), to=0)

    x = np.array([1.5, -0.5, 2.0, 0.25])
    y = np.array([0.5, 2.0, -1.0, 1.25])
    with mp.Simulator(3) as sim:
        got = sim.fetch(sim.evaluate(chain, sim.put(0, x), sim.put(1, y)), party=0)
    assert traced == [(4,), (2,)]  # five products, two signatures
    np.testing.assert_allclose(got[0], x * y**4, atol=1e-4)
    np.testing.assert_allclose(got[1], (x * y**4)[:2] * y[:2], atol=1e-4)
