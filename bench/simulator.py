"""Simulator benchmark: evaluate+fetch latency versus party count, the cost of one p2p hop inside
a program, a chained pipeline versus its native jax.jit ops, a 64 MiB put+fetch, a fori_loop
versus the same steps unrolled, and the first evaluate of a 100-op program.

Run as `python -m bench.simulator`; prints a markdown table, then PASS/FAIL per target.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import mpplug as mp
from bench.loops import TARGET_RATIO, loop_rows
from bench.timing import Target, median_seconds, side_by_side, verdict
from simulator import Simulator

PIPELINE_OPS = 50
HOP_EVERY = 5
SIZE = 128
HOPS = 40
CHAIN_OPS = 100
TARGET_FIRST_S = 1.5
TARGET_PIPELINE = 1.3
TARGET_HOP_MS = 0.15
TARGET_GROWTH = 1.0


def layer(a: jax.Array) -> jax.Array:
    return jnp.tanh(a @ a.T * (1.0 / SIZE)) + a * 0.5


@mp.function
def pipeline(x: mp.MPObject) -> mp.MPObject:
    holder = 0
    for i in range(PIPELINE_OPS):
        x = mp.run_jax(layer, x)
        if (i + 1) % HOP_EVERY == 0 and i + 1 < PIPELINE_OPS:
            nxt = (holder + 1) % 3
            x = mp.p2p(holder, nxt, x)
            holder = nxt
    return x


def bump(a: jax.Array) -> jax.Array:
    return a + 1


@mp.function
def relay(x: mp.MPObject, hops: int) -> mp.MPObject:
    """A scalar bumped and handed on around the three parties, `hops` times."""
    holder = 0
    x = mp.run_jax(bump, x)
    for _ in range(hops):
        nxt = (holder + 1) % 3
        x = mp.run_jax(bump, mp.p2p(holder, nxt, x))
        holder = nxt
    return x


@mp.function
def chain_of_lambdas(x: mp.MPObject) -> mp.MPObject:
    """A program as a new user writes one: a fresh lambda at every step."""
    for _ in range(CHAIN_OPS):
        x = mp.run_jax(lambda a: a * 1.01 + 1.0, x)
    return x


@mp.function
def chain_of_closures(x: mp.MPObject) -> mp.MPObject:
    """The worst case for the export cache: every op is a different function."""
    for i in range(CHAIN_OPS):
        x = mp.run_jax(lambda a, k=1.0 + i / 1000: a * k + 1.0, x)
    return x


Row = tuple[str, str, str]


def latency_rows(targets: list[Target]) -> list[Row]:
    rows, latency = [], {}
    prog = mp.function(lambda: mp.prank())
    for n in (2, 3, 5, 8, 16):
        with Simulator(n) as sim:
            latency[n] = median_seconds(lambda: sim.fetch(sim.evaluate(prog)), 200)
        rows.append(
            (
                f"prank evaluate+fetch, {n} parties",
                f"{latency[n] * 1e3:.3f} ms",
                f"{latency[n] / latency[2]:.2f}x of 2 parties",
            )
        )
    growth = (latency[16] / latency[2]) / (16 / 2)
    targets.append(
        Target("latency growth 2 -> 16 parties <= linear", growth <= TARGET_GROWTH, f"{growth:.2f}")
    )
    return rows


def hop_rows(targets: list[Target]) -> list[Row]:
    """The cost of one p2p hop: a relay of HOPS hops next to the same ops with none."""
    with Simulator(3) as sim:
        x = sim.put(0, np.float32(0.0))
        holder = HOPS % 3
        times = side_by_side(
            {
                "hops": lambda: sim.fetch(sim.evaluate(relay, x, HOPS), party=holder),
                "none": lambda: sim.fetch(sim.evaluate(relay, x, 0), party=0),
            },
            repeat=200,
            warmup=5,
        )
    ops = side_by_side({"ops": lambda: _bumps(HOPS)}, repeat=200, warmup=5)["ops"]
    per_hop = (times["hops"] - times["none"] - ops) / HOPS
    targets.append(
        Target(
            f"p2p hop inside a 3-party program < {TARGET_HOP_MS} ms",
            per_hop * 1e3 < TARGET_HOP_MS,
            f"{per_hop * 1e3:.3f} ms",
        )
    )
    return [
        (
            f"p2p hop (scalar) inside a 3-party program, per hop ({HOPS} hops)",
            f"{per_hop * 1e3:.3f} ms",
            f"relay {times['hops'] * 1e3:.2f} ms, no hops {times['none'] * 1e3:.2f} ms, "
            f"{HOPS} native bumps {ops * 1e3:.2f} ms",
        )
    ]


_native_bump = jax.jit(bump)


def _bumps(count: int) -> jax.Array:
    a = jnp.float32(0.0)
    for _ in range(count):
        a = _native_bump(a)
    return a


def pipeline_rows(targets: list[Target]) -> list[Row]:
    x0 = np.random.default_rng(0).standard_normal((SIZE, SIZE)).astype(np.float32)
    native = jax.jit(layer)

    def run_native() -> jax.Array:
        a = jnp.asarray(x0)
        for _ in range(PIPELINE_OPS):
            a = native(a)
        return a

    with Simulator(3) as sim:
        x = sim.put(0, x0)
        out = sim.evaluate(pipeline, x)
        holder = min(out.parties)
        np.testing.assert_allclose(sim.fetch(out, party=holder), run_native(), rtol=1e-4)
        times = side_by_side(
            {
                "pipeline": lambda: sim.fetch(sim.evaluate(pipeline, x), party=holder),
                "native": lambda: np.asarray(run_native()),
            },
            repeat=40,
        )
    ratio = times["pipeline"] / times["native"]
    targets.append(
        Target(
            f"{PIPELINE_OPS}-op 3-party pipeline <= {TARGET_PIPELINE}x native jax.jit ops",
            ratio <= TARGET_PIPELINE,
            f"{ratio:.2f}x",
        )
    )
    return [
        (
            f"native jax.jit, {PIPELINE_OPS} ops f32[{SIZE},{SIZE}]",
            f"{times['native'] * 1e3:.2f} ms",
            "",
        ),
        (
            f"3-party pipeline, p2p every {HOP_EVERY} ops (+fetch)",
            f"{times['pipeline'] * 1e3:.2f} ms",
            f"{ratio:.2f}x native",
        ),
    ]


def transfer_rows() -> list[Row]:
    big = np.random.default_rng(1).standard_normal(16 * 2**20).astype(np.float32)  # 64 MiB
    with Simulator(2) as sim:

        def round_trip() -> None:
            sim.fetch(sim.put(1, big), party=1)

        t_big = median_seconds(round_trip, 5, warmup=1)
    return [
        (
            "put + fetch 64 MiB f32",
            f"{t_big * 1e3:.1f} ms",
            f"{2 * big.nbytes / t_big / 1e6:.0f} MB/s moved",
        )
    ]


def loop_table_rows(targets: list[Target]) -> list[Row]:
    rows = []
    with Simulator(2) as sim:
        for measurement, loop, unrolled, ratio, ratio_value in loop_rows(sim, "2 parties"):
            rows.append((measurement, loop, f"{ratio} ({unrolled})"))
            if ratio_value is not None:
                targets.append(
                    Target(
                        f"2 parties: fori_loop <= {TARGET_RATIO}x unrolled",
                        ratio_value <= TARGET_RATIO,
                        ratio,
                    )
                )
    return rows


def first_evaluate_rows(targets: list[Target]) -> list[Row]:
    rows = []
    for program, what, judged in (
        (chain_of_lambdas, "one lambda written in the loop", True),
        (chain_of_closures, "a different function at each op", False),
        (mp.function(chain_of_closures.fn, fuse=True), "the same, fuse=True", True),
    ):
        with Simulator(2) as sim:
            x = sim.put(0, np.ones(4, np.float32))
            start = time.perf_counter()
            sim.fetch(sim.evaluate(program, x), party=0)
            t_first = time.perf_counter() - start
        label = f"first evaluate of a {CHAIN_OPS}-op chain: {what}"
        rows.append((label, f"{t_first:.2f} s", "trace, export and compile included"))
        if judged:
            targets.append(
                Target(
                    f"{label} < {TARGET_FIRST_S:g} s", t_first < TARGET_FIRST_S, f"{t_first:.2f} s"
                )
            )
    return rows


def main() -> int:
    targets: list[Target] = []
    rows = [
        *latency_rows(targets),
        *hop_rows(targets),
        *pipeline_rows(targets),
        *transfer_rows(),
        *loop_table_rows(targets),
        *first_evaluate_rows(targets),
    ]
    print(f"mpplug simulator benchmark (jax {jax.__version__}, {jax.devices()[0].platform})\n")
    print("| measurement | median | reference |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return verdict(targets)


if __name__ == "__main__":
    sys.exit(main())
