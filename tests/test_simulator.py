"""Simulator specifics: device binding, program and kernel caching, concurrency, handle
lifetime and argument errors."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

import mpplug as mp
from mpplug.config import ClusterSpec
from mpplug.errors import (
    MPPlugError,
    PartyError,
    PartyUnavailableError,
    TraceError,
    UnsupportedDTypeError,
)
from simulator import Simulator


def test_auto_devices_bind_each_party_to_its_own_cpu_device():
    script = textwrap.dedent(
        """
        import jax, numpy as np
        import mpplug as mp
        with mp.Simulator(6) as sim:
            assert sim.devices() == [jax.devices()[i % 4] for i in range(6)], sim.devices()
            out = sim.evaluate(mp.function(
                lambda: mp.run_jax(lambda r: r * 2, mp.prank())))
            for rank in range(6):
                value = sim._stores[rank][out.name]
                assert value.devices() == {jax.devices()[rank % 4]}, (rank, value.devices())
            assert [int(v) for v in sim.fetch(out)] == [0, 2, 4, 6, 8, 10]
        print("ok")
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_repeated_evaluate_costs_no_retrace_reparse_or_recompile():
    traces = []

    @mp.function
    def prog(x):
        traces.append(1)
        return mp.run_jax(lambda a: jnp.tanh(a) + 1, x)

    with Simulator(2) as sim:
        x = sim.put(0, np.ones(4, np.float32))
        for _ in range(5):
            out = sim.evaluate(prog, x)
        np.testing.assert_allclose(sim.fetch(out, party=0), np.tanh(1) + 1, rtol=1e-6)
        assert len(traces) == 1
        party = sim._parties[0]
        assert len(party._programs) == 1
        assert len(party.runtime.cache("jax.exec")) == 1


def test_concurrent_evaluations_never_mix_values():
    @mp.function
    def relay(x):
        hop = mp.p2p(0, 1, x)
        return mp.p2p(1, 2, mp.run_jax(lambda a: a + 1, hop))

    with Simulator(3) as sim:
        inputs = [sim.put(0, np.full(16, i, np.int32)) for i in range(24)]
        results: dict[int, np.ndarray] = {}

        def worker(i: int) -> None:
            results[i] = sim.fetch(sim.evaluate(relay, inputs[i]), party=2)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == list(range(24))
        for i, value in results.items():
            np.testing.assert_array_equal(value, np.full(16, i + 1, np.int32))


def test_dropping_a_handle_releases_the_value_at_its_parties():
    with Simulator(2) as sim:
        x = sim.put(1, np.zeros(8, np.float32))
        name = x.name
        assert name in sim._stores[1]
        del x
        gc.collect()
        assert name not in sim._stores[1]


def test_parties_are_named_by_the_cluster_spec():
    spec = ClusterSpec.local(["alice", "bob", "carol"])
    with Simulator(spec) as sim:
        assert sim.parties == ["alice", "bob", "carol"] and sim.world_size == 3
        x = mp.put("carol", np.float32(4.0))  # the current cluster: the `with` block's
        out = mp.evaluate(mp.function(lambda v: mp.bcast("carol", v, to=["alice"])), x)
        assert mp.fetch(out) == [np.float32(4.0), None, None]
    with pytest.raises(mp.MPPlugError, match=r"mp.put works on the current cluster"):
        mp.put("carol", np.float32(4.0))


def test_bad_arguments_get_typed_errors():
    with Simulator(2) as sim, Simulator(2) as other:
        with pytest.raises(UnsupportedDTypeError, match=r"got dtype <U3"):
            sim.put(0, np.array(["abc"]))
        with pytest.raises(ValueError, match=r"expected a rank in 0..1 or a party name, got 7"):
            sim.put(7, np.float32(1))
        x = sim.put(0, np.float32(1))
        with pytest.raises(ValueError, match=r"party 1 does not hold"):
            sim.fetch(x, party=1)
        with pytest.raises(TraceError, match=r"belongs to another cluster"):
            other.fetch(x)
        program = sim.compile(mp.function(lambda v: mp.p2p(0, 1, v)), x)
        y = sim.put(1, np.float32(1))
        with pytest.raises(
            TraceError,
            match=r"argument 0: expected f32\[\] @ \{0\}, got "
            r"f32\[\] @ \{1\}",
        ):
            sim.evaluate(program, y)
    with pytest.raises(MPPlugError, match="Simulator is closed"):
        sim.put(0, np.float32(1))


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="expected at least one party"):
        Simulator(0)


def test_concurrent_evaluates_reach_every_party_in_the_same_order(monkeypatch):
    """A slow submit widens the race: without one order across parties, two executions
    would each hold a party the other waits for, until the receive timeout."""
    import concurrent.futures

    real_submit = concurrent.futures.ThreadPoolExecutor.submit

    def slow_submit(self, *args, **kwargs):
        time.sleep(0.01)
        return real_submit(self, *args, **kwargs)

    @mp.function
    def ping(x):
        return mp.p2p(1, 0, mp.p2p(0, 1, x))

    with Simulator(2, timeout=2.0) as sim:
        monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", slow_submit)
        x = sim.put(0, np.int32(7))
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: sim.fetch(sim.evaluate(ping, x), party=0), range(8)))
        assert [int(r) for r in results] == [7] * 8


def test_a_failed_evaluate_leaves_no_outputs_behind():
    from mpplug_testkernels import fail_pfunction

    @mp.function
    def half_fails():
        ok = mp.run_jax_at(0, lambda: jnp.float32(1.0))
        x = mp.run_jax_at(1, lambda: jnp.float32(1.0))
        (bad,) = mp.run_pfunc(fail_pfunction("no"), x)
        return ok, bad

    with Simulator(2) as sim:
        for _ in range(3):
            with pytest.raises(PartyError):
                sim.evaluate(half_fails)
        assert sim._stores == [{}, {}]


def test_a_stuck_party_is_reported_within_the_execute_timeout():
    from mpplug_testkernels import sleep_pfunction

    @mp.function
    def stuck():
        x = mp.run_jax_at(1, lambda: jnp.float32(1.0))
        return mp.run_pfunc(sleep_pfunction(5.0), x)

    with Simulator(2, timeout=1.0, execute_timeout=1.0) as sim:
        start = time.monotonic()
        with pytest.raises(
            PartyUnavailableError,
            match=r"party P1 is unavailable: no answer "
            r"within 1s",
        ):
            sim.evaluate(stuck)
        assert time.monotonic() - start < 3.0


def test_fetched_arrays_belong_to_the_caller():
    with Simulator(2) as sim:
        x = sim.put(1, np.arange(3, dtype=np.int32))
        value = sim.fetch(x, party=1)
        value += 1  # writable, and not the party's copy
        np.testing.assert_array_equal(sim.fetch(x, party=1), [0, 1, 2])


def test_values_are_freed_after_their_last_use():
    from mpplug.runtime.interpreter import Interpreter

    @mp.function
    def chain(x):
        a = mp.run_jax(lambda v: v + 1, x)
        b = mp.run_jax(lambda v: v * 2, a)
        return mp.run_jax(lambda v: v - 1, b)

    program = mp.compile(chain, mp.MPObject(mp.TensorType("f32", (4,)), 0), world_size=1)
    steps = Interpreter(program.graph, 0).steps
    assert [[r.op for r in s.drop] for s in steps] == [[0], [1], [2]]
