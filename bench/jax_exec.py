"""The `jax.exec` kernel against native `jax.jit`, side by side in one run: medians over many
calls of f(x, y) = tanh(x @ y) + 1 at 8x8, 64x64 and 512x512 float32.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export_api

import mpplug as mp
from bench.timing import Target, median_seconds, side_by_side, verdict
from mpplug.kernels import KernelRuntime, invoke

SIZES = (8, 64, 512)
NATIVE_TARGET_SIZES = (8, 64)
LARGE_SIZE_SHARE = 20
"""The 512x512 row takes 1/LARGE_SIZE_SHARE of the calls: each is a thousand times longer."""
MAX_INVOKE_OVER_NATIVE = 1.1
REDESERIALIZE_TARGET_SIZE = 64
MIN_REDESERIALIZE_OVER_INVOKE = 5.0
WARMUP = 50
TRIALS = 7
"""Warm calls are split into this many side-by-side trials, alternating which call goes first."""


def f(x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.tanh(x @ y) + 1


def measure(n: int, repeat: int, rounds: int, slow_repeat: int) -> dict[str, float]:
    """Seconds per call for each way of running f at n x n."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, n), dtype=np.float32)
    y = rng.standard_normal((n, n), dtype=np.float32)
    xd, yd = jax.device_put(x), jax.device_put(y)

    native = jax.jit(f)
    pfunc, _, _ = mp.jax_export(f, x, y)

    # Cold: the first invoke on a fresh runtime deserializes, checks, lowers and compiles.
    start = time.perf_counter()
    invoke(pfunc, xd, yd, runtime=KernelRuntime())[0].block_until_ready()
    cold = time.perf_counter() - start

    warm_runtime = KernelRuntime()
    warm = warm_medians(
        lambda: native(xd, yd),
        lambda: invoke(pfunc, xd, yd, runtime=warm_runtime)[0],
        repeat,
        rounds,
    )
    # What a kernel without a cache does: deserialize the body and call it, every time.
    body = pfunc.fn_body
    redeserialize = median_seconds(
        lambda: jax_export_api.deserialize(bytearray(body)).call(xd, yd)[0],
        slow_repeat,
        warmup=5,
    )
    return {**warm, "redeserialize": redeserialize, "cold": cold}


def warm_medians(
    native: Callable[[], object], warm: Callable[[], object], repeat: int, rounds: int
) -> dict[str, float]:
    """Median seconds of native and warm invoke calls, side by side in TRIALS trials that
    alternate which goes first: the trial with the median invoke/native ratio, so that a
    position bias cancels and trials hit by bursts of load from other processes (up to
    TRIALS // 2) are outvoted."""
    trials = []
    for trial in range(TRIALS):
        pair = [("native", native), ("invoke", warm)]
        if trial % 2:
            pair.reverse()
        trials.append(side_by_side(dict(pair), repeat // TRIALS, WARMUP, rounds))
    trials.sort(key=lambda medians: medians["invoke"] / medians["native"])
    return trials[TRIALS // 2]


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def targets(results: dict[int, dict[str, float]]) -> list[Target]:
    """Warm invoke within MAX_INVOKE_OVER_NATIVE of native at each small size, and far faster
    than re-deserializing on every call."""
    checks = []
    for n in NATIVE_TARGET_SIZES:
        over_native = results[n]["invoke"] / results[n]["native"]
        checks.append(
            Target(
                f"warm invoke within {MAX_INVOKE_OVER_NATIVE}x of native jit at {n}x{n}",
                over_native <= MAX_INVOKE_OVER_NATIVE,
                f"{over_native:.2f}x",
            )
        )
    at = results[REDESERIALIZE_TARGET_SIZE]
    speedup = at["redeserialize"] / at["invoke"]
    n = REDESERIALIZE_TARGET_SIZE
    checks.append(
        Target(
            f"warm invoke at least {MIN_REDESERIALIZE_OVER_INVOKE:g}x faster than "
            f"re-deserializing at {n}x{n}",
            speedup >= MIN_REDESERIALIZE_OVER_INVOKE,
            f"{speedup:.1f}x",
        )
    )
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20000, help="warm calls per column")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per warm trial")
    parser.add_argument(
        "--slow-repeats", type=int, default=200, help="calls per re-deserialize median"
    )
    opts = parser.parse_args(argv)

    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; microseconds per call "
        f"(warm: {opts.repeats} calls per column, 1/{LARGE_SIZE_SHARE} of that at 512x512, in "
        f"{TRIALS} trials of {opts.rounds} rounds: the median of the quietest round of the "
        f"trial with the median ratio)\n"
    )
    print(
        "| size | native jit | warm invoke | re-deserialize | cold first call "
        "| invoke/native | re-deser./invoke |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    results = {}
    for n in SIZES:
        repeat = opts.repeats if n in NATIVE_TARGET_SIZES else opts.repeats // LARGE_SIZE_SHARE
        r = results[n] = measure(n, repeat, opts.rounds, opts.slow_repeats)
        print(
            f"| {n}x{n} | {_us(r['native'])} | {_us(r['invoke'])} | {_us(r['redeserialize'])} "
            f"| {_us(r['cold'])} | {r['invoke'] / r['native']:.2f}x "
            f"| {r['redeserialize'] / r['invoke']:.1f}x |"
        )
    return verdict(targets(results))


if __name__ == "__main__":
    sys.exit(main())
