"""Loops inside `mp.mpc.run`: `lax.fori_loop` with a static trip count and `lax.scan` run as
loops of the share program (traced and compiled once, whatever the trip count), compute what
the unrolled Python loop and plain JAX compute, and draw fresh randomness every iteration."""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpplug as mp
from mpplug.core.graph import OpKind
from mpplug.kernels import keystream
from mpplug.kernels.builtin import constant_pfunction, identity_pfunction
from mpplug.mpc import trace_cache
from mpplug.mpc.recording import Call, Loop, Recording, Shuffle

rng = np.random.default_rng(7)
X = rng.normal(size=(40, 3))
Y = (rng.random(40) < 0.5).astype(np.float64)
W = np.zeros(3)


def step(x: Any, y: Any, w: Any) -> Any:  # a least-squares gradient step
    return w - 0.25 * (x.T @ (x @ w - y)) / x.shape[0]


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


def test_a_fori_loop_computes_what_plain_jax_computes(make_cluster):
    cluster = make_cluster(3, timeout=120.0)
    args = [cluster.put(i, v) for i, v in enumerate((X, Y, W))]
    looped = cluster.fetch(cluster.evaluate(secure(with_fori), *args), party=0)
    want = np.asarray(jax.jit(unrolled)(X, Y, W))
    np.testing.assert_allclose(looped, want, atol=1e-4)
    assert np.abs(want).max() > 0.01  # the loop moved the weights


def test_a_fori_loop_computes_what_the_unrolled_loop_does():
    with mp.Simulator(3) as sim:
        args = [sim.put(i, v) for i, v in enumerate((X, Y, W))]
        looped = sim.fetch(sim.evaluate(secure(with_fori), *args), party=0)
        plain = sim.fetch(sim.evaluate(secure(unrolled), *args), party=0)
    np.testing.assert_allclose(looped, plain, atol=1e-4)


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
    from mpplug.mpc.rules.control import scan_counts as _scan_counts

    assert _scan_counts({"num_consts": 2, "num_carry": 1}) == (2, 1)  # JAX 0.10
    assert _scan_counts({"ft_in": ((None,), (None, None), ())}) == (1, 2)  # JAX 0.11
    assert _scan_counts({"ft_in": (None, (None,), ())}) is None  # unknown: a TraceError


def looping(n: int) -> mp.MPFunction:
    return secure(lambda x, y, w: jax.lax.fori_loop(0, n, lambda i, w: step(x, y, w), w))


def compiled(fn: mp.MPFunction) -> Any:
    types = [mp.TensorType("float32", v.shape) for v in (X, Y, W)]
    return mp.compile(fn, *(mp.MPObject(t, {i}) for i, t in enumerate(types)), world_size=3)


def test_a_ten_iteration_loop_compiles_the_functions_of_a_one_iteration_loop():
    once, ten = compiled(looping(1)).graph, compiled(looping(10)).graph
    assert len(ten.functions) == len(once.functions) > 0
    assert {f.fn_body for f in ten.functions} == {f.fn_body for f in once.functions}
    assert sum(op.kind is OpKind.WHILE for op in ten.ops) == 1  # the loop, kept a loop


def test_a_loop_carries_secret_bits_public_counts_and_promoted_publics():
    def fn(x: Any) -> Any:
        def body(i: Any, carry: Any) -> Any:
            flag, count, total = carry
            flag = flag & (x[i] > -1.0)  # boolean shares, carried as such
            total = total + jnp.where(flag, x[i], 0.0)  # starts public, carried secret
            return flag, count + i, total

        return jax.lax.fori_loop(0, 5, body, (x[0] < 10.0, 0, 0.0))

    xs = np.array([0.5, 2.25, -0.5, -1.5, 4.0])

    @mp.function
    def program(v: Any) -> Any:
        return mp.mpc.reveal(mp.mpc.run(fn, mp.mpc.seal(v)), to=0)

    with mp.Simulator(3) as sim:
        flag, count, total = sim.fetch(sim.evaluate(program, sim.put(0, xs)), party=0)
    want_flag, want_count, want_total = jax.jit(fn)(xs)
    assert bool(flag) == bool(want_flag) is False
    assert int(count) == int(want_count) == 10
    np.testing.assert_allclose(total, want_total, atol=1e-4)
    assert float(want_total) == pytest.approx(2.25)


def test_every_iteration_draws_streams_no_other_draws(monkeypatch: pytest.MonkeyPatch):
    drawn: Counter[tuple[bytes, int]] = Counter()
    encryptor = keystream._encryptor

    def counting(key: bytes, stream: int) -> Any:
        drawn[key, stream] += 1
        return encryptor(key, stream)

    monkeypatch.setattr(keystream, "_encryptor", counting)
    totals = []
    with mp.Simulator(3) as sim:
        args = [sim.put(i, v) for i, v in enumerate((X, Y, W))]
        for n in (1, 4):
            drawn.clear()
            sim.fetch(sim.evaluate(looping(n), *args), party=0)
            # a pair of roles shares each key: a (key, stream) is drawn by at most two parties
            assert max(drawn.values()) <= 2
            totals.append(len(drawn))
    once, four = totals
    seal = 3 * 2  # three seals, each two streams under a fresh key
    assert four - seal == 4 * (once - seal)  # each iteration draws streams of its own


def test_a_recorded_loop_survives_its_bytes(monkeypatch: pytest.MonkeyPatch):
    stored: list[Recording] = []
    monkeypatch.setattr(trace_cache, "store", lambda key, recording: stored.append(recording))
    monkeypatch.setattr(trace_cache, "load", lambda key: None)
    compiled(looping(3))
    (recording,) = stored
    (loop,) = [s for s in recording.steps if isinstance(s, Loop)]
    assert loop.length == 3 and len(recording.bodies) == 1
    data = recording.to_bytes()
    again = Recording.from_bytes(data)
    assert again.to_bytes() == data and again.steps == recording.steps
    broken = Recording(recording.n_inputs, recording.functions, recording.steps, bodies=[])
    with pytest.raises(ValueError, match="names no recorded body"):
        broken.check()


def test_a_call_prepended_to_a_recording_renumbers_what_reads_later_values():
    """`prepend_call` puts a call before the recorded steps: values made later move up by
    its results, and the placeholders -1, -2, ... name them."""
    one = mp.TensorType("int32", (2,))
    recording = Recording(1)
    (a,) = recording.call(identity_pfunction([one]), [0])
    b = recording.shuffle(a, (1, 2, 0))
    (c,) = recording.call(identity_pfunction([one]), [-2])  # the prepended call's second
    recording.outputs = [b, c, -1]
    recording.prepend_call(constant_pfunction(np.zeros(2, np.int32), np.ones(2, np.int32)))
    first, *rest = recording.steps
    assert first == Call(len(recording.functions) - 1, (), 2)
    assert rest == [Call(0, (0,), 1), Shuffle(3, (1, 2, 0)), Call(1, (2,), 1)]
    assert recording.outputs == [4, 5, 1]
    recording.check()
    assert recording.call(identity_pfunction([one]), [5]) == [6]
