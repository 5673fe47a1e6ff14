"""Simulator benchmark: evaluate+fetch latency versus party count, a chained pipeline versus
its native jax.jit ops, a 64 MiB put+fetch, a fori_loop versus the same steps unrolled, and
the first evaluate of a 100-op program; prints one markdown table of ratios."""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# `simulator` package; drop that entry before importing it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for bench.loops

import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mpplug as mp  # noqa: E402
from bench.loops import loop_rows  # noqa: E402
from simulator import Simulator  # noqa: E402

PIPELINE_OPS = 50
HOP_EVERY = 5
SIZE = 128
CHAIN_OPS = 100
TARGET_FIRST_S = 1.5


def median_seconds(fn: Callable[[], object], repeat: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


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


def main() -> int:
    rows: list[tuple[str, str, str, str]] = []

    latency = {}
    for n in (2, 3, 5, 8, 16):
        with Simulator(n) as sim:
            prog = mp.function(lambda: mp.prank())
            latency[n] = median_seconds(
                lambda sim=sim, prog=prog: sim.fetch(sim.evaluate(prog)), 200
            )
        rows.append(
            (
                f"prank evaluate+fetch, {n} parties",
                f"{latency[n] * 1e3:.3f} ms",
                f"{latency[n] / latency[2]:.2f}x of 2 parties",
                "",
            )
        )
    growth = (latency[16] / latency[2]) / (16 / 2)
    rows.append(
        (
            "growth 2 -> 16 parties vs linear",
            f"{growth:.2f}",
            "target <= 1.00",
            "PASS" if growth <= 1.0 else "FAIL",
        )
    )

    x0 = np.random.default_rng(0).standard_normal((SIZE, SIZE)).astype(np.float32)
    native = jax.jit(layer)

    def run_native() -> None:
        a = jnp.asarray(x0)
        for _ in range(PIPELINE_OPS):
            a = native(a)
        a.block_until_ready()

    with Simulator(3) as sim:
        x = sim.put(0, x0)
        out = sim.evaluate(pipeline, x)
        np.testing.assert_allclose(
            sim.fetch(out, party=min(out.parties)), _reference(native, x0), rtol=1e-4
        )
        t_pipe = median_seconds(lambda: sim.fetch(sim.evaluate(pipeline, x), party=0), 30)
    t_native = median_seconds(run_native, 30)
    ratio = t_pipe / t_native
    rows.append(
        (
            f"native jax.jit, {PIPELINE_OPS} ops f32[{SIZE},{SIZE}]",
            f"{t_native * 1e3:.2f} ms",
            "",
            "",
        )
    )
    rows.append(
        (
            f"3-party pipeline, p2p every {HOP_EVERY} ops (+fetch)",
            f"{t_pipe * 1e3:.2f} ms",
            f"{ratio:.2f}x native (target <= 2.00)",
            "PASS" if ratio <= 2.0 else "FAIL",
        )
    )

    big = np.random.default_rng(1).standard_normal(16 * 2**20).astype(np.float32)  # 64 MiB
    with Simulator(2) as sim:

        def round_trip() -> None:
            handle = sim.put(1, big)
            sim.fetch(handle, party=1)

        t_big = median_seconds(round_trip, 5, warmup=1)
    rows.append(
        (
            "put + fetch 64 MiB f32",
            f"{t_big * 1e3:.1f} ms",
            f"{2 * big.nbytes / t_big / 1e6:.0f} MB/s moved",
            "",
        )
    )

    with Simulator(2) as sim:
        for measurement, loop, unrolled, ratio, verdict in loop_rows(sim, "2 parties"):
            rows.append((measurement, loop, f"{ratio} ({unrolled})", verdict))

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
        rows.append(
            (
                f"first evaluate of a {CHAIN_OPS}-op chain: {what}",
                f"{t_first:.2f} s",
                "trace, export and compile included",
                f"{'PASS' if t_first < TARGET_FIRST_S else 'FAIL'} (< {TARGET_FIRST_S:g} s)"
                if judged
                else "one export and one compile per function",
            )
        )

    print(f"mpplug simulator benchmark (jax {jax.__version__}, {jax.devices()[0].platform})\n")
    print("| measurement | median | ratio | target |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if any(row[3] == "FAIL" for row in rows) else 0


def _reference(native: Callable[[jax.Array], jax.Array], x0: np.ndarray) -> np.ndarray:
    a = jnp.asarray(x0)
    for _ in range(PIPELINE_OPS):
        a = native(a)
    return np.asarray(a)


if __name__ == "__main__":
    sys.exit(main())
