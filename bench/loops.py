"""The loop benchmark both cluster benchmarks run: `mp.fori_loop` of 1,000 steps, each a small
JAX op and one p2p, next to the same steps unrolled at trace time, timed alternately; the
ratio is the median of the per-round ratios."""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

import mpplug as mp

STEPS = 1000
ROUNDS = 11
TARGET_RATIO = 1.2


def bump(a: jax.Array) -> jax.Array:
    return a + 1.0


@mp.function
def unrolled(x: mp.MPObject) -> mp.MPObject:
    """Party 0 bumps x and sends it to party 1, STEPS times, the steps written out."""
    sent = x
    for _ in range(STEPS):
        x = mp.run_jax(bump, x)
        sent = mp.p2p(0, 1, x)
    return sent


@mp.function
def looped(x: mp.MPObject) -> mp.MPObject:
    """The same steps as one WHILE op that the parties run."""

    def step(i: mp.MPObject, state: tuple[mp.MPObject, mp.MPObject]) -> tuple[mp.MPObject, ...]:
        x, _ = state
        x = mp.run_jax(bump, x)
        return x, mp.p2p(0, 1, x)

    return mp.fori_loop(0, STEPS, step, (x, mp.p2p(0, 1, x)))[1]


def loop_rows(cluster: mp.Cluster, name: str) -> list[tuple[str, str, str, str, float | None]]:
    """Rows (measurement, loop, unrolled, ratio as text, the ratio TARGET_RATIO applies to or
    None) for `cluster`."""
    x = cluster.put(0, np.zeros(4, np.float32))
    cluster.compile(mp.function(lambda v: mp.run_jax(bump, v)), x)  # export bump once, first
    programs = {}
    for fn in (looped, unrolled):
        start = time.perf_counter()
        programs[fn] = (cluster.compile(fn, x), time.perf_counter() - start)
        out = cluster.fetch(cluster.evaluate(fn, x), party=1)  # ships the program, warms up
        np.testing.assert_array_equal(out, np.full(4, STEPS, np.float32))
    samples: dict[object, list[float]] = {looped: [], unrolled: []}
    for _ in range(ROUNDS):
        for fn in (looped, unrolled):
            start = time.perf_counter()
            cluster.fetch(cluster.evaluate(fn, x), party=1)
            samples[fn].append(time.perf_counter() - start)
    per_step = {fn: statistics.median(s) / STEPS for fn, s in samples.items()}
    ratio = statistics.median(
        a / b for a, b in zip(samples[looped], samples[unrolled], strict=True)
    )
    (loop_program, loop_trace), (flat_program, flat_trace) = programs[looped], programs[unrolled]
    return [
        (
            f"{name}: fori_loop of {STEPS} steps (jax op + p2p each), per step",
            f"{per_step[looped] * 1e6:.0f} us",
            f"unrolled {per_step[unrolled] * 1e6:.0f} us",
            f"{ratio:.2f}x unrolled",
            ratio,
        ),
        (
            f"{name}: the same program traced, and its size",
            f"{loop_trace * 1e3:.0f} ms, {len(loop_program.to_bytes()) / 1e3:.1f} kB",
            f"unrolled {flat_trace * 1e3:.0f} ms, {len(flat_program.to_bytes()) / 1e3:.0f} kB",
            f"{flat_trace / loop_trace:.1f}x faster to trace",
            None,
        ),
    ]
