"""Cyclic garbage collection is paused while mp.mpc traces a share program and while a party
plans a function for its interpreted first run, and the collector's state is restored after:
across threads at once, and when the caller had disabled it."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mpplug as mp
from mpplug.kernels import KernelRuntime, interpreted, jax_exec
from mpplug.kernels.collection import collection_paused
from mpplug.mpc import api


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_a_share_program_is_traced_with_collection_paused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, collector_on: None
) -> None:
    monkeypatch.setenv("MPPLUG_CACHE_DIR", str(tmp_path))  # traced here, not read from disk
    seen: list[bool] = []
    record = api._record

    def recording(*args: Any) -> Any:
        seen.append(gc.isenabled())
        return record(*args)

    monkeypatch.setattr(api, "_record", recording)

    @mp.function
    def program(x: object, y: object) -> object:
        a, b = mp.mpc.seal((x, y))
        return mp.mpc.reveal(mp.mpc.run(lambda u, v: u * v + 1.5, a, b), to=0)

    with mp.Simulator(3) as sim:
        x, y = np.arange(4, dtype=np.float32), np.full(4, 2.0, np.float32)
        out = sim.evaluate(program, sim.put(0, x), sim.put(1, y))
        np.testing.assert_allclose(sim.fetch(out, party=0), x * y + 1.5, atol=1e-3)
    assert seen == [False]
    assert gc.isenabled()


def test_a_function_is_planned_for_its_interpreted_first_run_with_collection_paused(
    monkeypatch: pytest.MonkeyPatch, collector_on: None
) -> None:
    monkeypatch.setenv("MPPLUG_CACHE_DIR", "")  # nothing compiled on disk
    seen: list[bool] = []
    plan = interpreted.plan_serialized

    def planning(module: bytes) -> Any:
        seen.append(gc.isenabled())
        return plan(module)

    monkeypatch.setattr(interpreted, "plan_serialized", planning)
    x = np.arange(5, dtype=np.int32)
    c = int(np.random.default_rng().integers(10, 1000))  # a function no test planned before
    (pfunc,) = mp.jax_export(lambda v: v * c + 1, x)[:1]
    runtime = KernelRuntime()
    jax_exec.prepare_jax_exec(pfunc, runtime)
    assert seen == [False] and gc.isenabled()
    np.testing.assert_array_equal(
        np.asarray(jax_exec.run_jax_exec(pfunc, [x], runtime)[0]), x * c + 1
    )


def test_pauses_on_several_threads_restore_the_collector_after_the_last(
    collector_on: None,
) -> None:
    inside, leave = threading.Barrier(3), threading.Event()
    states: list[bool] = []

    def pausing() -> None:
        with collection_paused():
            inside.wait()
            leave.wait()
        states.append(gc.isenabled())

    threads = [threading.Thread(target=pausing) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait()
    assert not gc.isenabled()
    leave.set()
    for t in threads:
        t.join()
    assert gc.isenabled()
    assert states.count(True) >= 1  # whichever left last found it restored


def test_a_collector_the_caller_disabled_stays_disabled(collector_on: None) -> None:
    gc.disable()
    with collection_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
