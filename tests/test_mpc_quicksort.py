"""Long sorts inside `mp.mpc.run`: a secret shuffle, then a quicksort whose comparisons are
opened (`mpplug.mpc.quicksort`).

Against plain JAX on both cluster kinds: `jnp.sort` with ties, a stable `argsort`, payloads,
narrow integer and bool keys, a batch of rows along either axis, descending, `top_k`. Then
what a party sees: every value it receives is uniform bytes whatever the secret, and what
the parties open (each level's bits) depends on the random order alone: the first level's
count of elements before the pivot is uniform over 0..n-1 for distinct keys and for keys
that are all equal (without the labels that tell equal keys apart it would always be 0, and
the sort would take n levels).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from scipy import stats

import mpplug as mp
from mpplug.core.graph import OpKind
from mpplug.mpc import quicksort
from mpplug.mpc.recording import WHILE, Loop, Recording
from mpplug.mpc.secret import Secret

from .mpc_views import RecordingSimulator
from .test_mpc_selection import assert_as_jax

N = 600
rng = np.random.default_rng(23)
X = np.round(rng.normal(size=N), 1).astype(np.float32)  # about 60 distinct values: ties
K = rng.integers(-100, 100, size=N).astype(np.int8)
M = rng.integers(-9, 9, size=(N, 3)).astype(np.int32)
P_MIN = 1e-6


def computations(x: Any, k: Any, m: Any) -> dict[str, Any]:
    return {
        "sort": jnp.sort(x),
        "argsort_stable": jnp.argsort(x),
        "payload": lax.sort((x, k, x * 2), num_keys=1),
        "int8": jnp.sort(k),
        "bool": jnp.sort(k > 0),
        "columns": jnp.sort(m, axis=0),
        "rows": jnp.sort(m.T, axis=1),
        "descending": jnp.sort(x, descending=True),
        "top_k": lax.top_k(x, 5),
    }


@mp.function
def sorts(x: Any, k: Any, m: Any) -> Any:
    return mp.mpc.reveal(mp.mpc.run(computations, *mp.mpc.seal((x, k, m))), to=0)


def while_loops(block: Any) -> int:
    """WHILE ops in a graph or region, nested ones too."""
    return sum(
        (op.kind is OpKind.WHILE) + sum(while_loops(r) for r in op.regions) for op in block.ops
    )


@pytest.mark.slow
def test_long_sorts_compute_what_jax_computes_on_every_cluster(make_cluster):
    assert N >= quicksort.SMALLEST
    cluster = make_cluster(3, timeout=300.0)
    handles = [cluster.put(i, v) for i, v in enumerate((X, K, M))]
    # one loop per sort of a secret key: the sorts ran as quicksorts, not as networks
    assert while_loops(cluster.compile(sorts, *handles).graph) == 9
    got = cluster.fetch(cluster.evaluate(sorts, *handles), party=0)
    assert_as_jax(got, computations(X, K, M), atol=2e-5)


def test_long_sorts_of_one_key_shuffle_and_the_rest_run_the_network():
    """The network stays for short sorts, several keys, 64-bit integer keys, public keys and
    sorts inside a loop's body (whose share program holds no loop of its own)."""

    def secret(n: int, dtype: Any = np.float32) -> Secret:
        return Secret(np.zeros((2, 3, n), np.uint64), (3, n), np.dtype(dtype))

    in_program, in_body = SimpleNamespace(loops=object()), SimpleNamespace(loops=None)
    long, short = quicksort.SMALLEST, quicksort.SMALLEST - 1
    assert quicksort.applies(in_program, [secret(long)], 1, 1)
    assert quicksort.applies(in_program, [secret(long, np.int8), np.zeros((3, long))], 1, 1)
    assert quicksort.applies(in_program, [secret(long, np.bool_)], 1, 1)
    assert not quicksort.applies(in_program, [secret(long)], 1, 0)  # 3 along axis 0
    assert not quicksort.applies(in_program, [secret(short)], 1, 1)
    assert not quicksort.applies(in_body, [secret(long)], 1, 1)
    assert not quicksort.applies(in_program, [secret(long), secret(long)], 2, 1)
    assert not quicksort.applies(in_program, [secret(long, np.int64)], 1, 1)
    assert not quicksort.applies(in_program, [np.zeros((3, long)), secret(long)], 1, 1)


def test_a_recorded_while_loop_round_trips_and_a_bad_length_is_refused():
    body = Recording(4, outputs=[2, 3])  # (iteration, invariant, next iteration, go on)
    outer = Recording(3, steps=[Loop(0, (0,), (1, 2), WHILE)], outputs=[3], bodies=[body])
    again = Recording.from_bytes(outer.to_bytes())
    assert again.steps == outer.steps
    for length, carry in ((-2, (1, 2)), (WHILE, (1,))):
        body = Recording(2 + len(carry), outputs=list(range(2, 2 + len(carry))))
        bad = Recording(3, steps=[Loop(0, (0,), carry, length)], outputs=[3], bodies=[body])
        with pytest.raises(ValueError, match="no valid length"):
            Recording.from_bytes(bad.to_bytes())


@mp.function
def sort_shares(x: Any) -> Any:
    return mp.mpc.run(jnp.sort, x).shares


def opened_levels(received: list[Any], n: int) -> list[np.ndarray]:
    """The bits each level opened, from one evaluation's messages: role i receives share i+2
    of the bits from role i+1, packed 64 to a u64 word, so the three received words of a
    level XOR to the bits. (At n = 512 no other message is 8 words of u64.)"""
    words = n // 64
    by_party: dict[int, list[np.ndarray]] = {0: [], 1: [], 2: []}
    for m in received:
        if m.value.dtype == np.uint64 and m.value.shape == (words,):
            by_party[m.dst].append(m.value)
    counts = {len(v) for v in by_party.values()}
    assert len(counts) == 1, counts
    levels = []
    for a, b, c in zip(by_party[0], by_party[1], by_party[2], strict=True):
        packed = a ^ b ^ c
        bits = (packed[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)
        levels.append(bits.reshape(-1).astype(bool))
    return levels


@pytest.mark.slow
def test_what_a_long_sort_shows_depends_on_the_random_order_alone():
    """Secret A: 512 distinct values in order; secret B: 512 equal values. Each is sealed
    once and sorted 16 times on the same shares."""
    n, evaluations = quicksort.SMALLEST, 16
    secrets = {"A": np.arange(n, dtype=np.float32), "B": np.full(n, 3.5, np.float32)}
    firsts: dict[str, list[int]] = {}
    depths: dict[str, list[int]] = {}
    data: dict[str, dict[int, list[bytes]]] = {}
    with RecordingSimulator(3, timeout=180.0) as sim:
        for name, x in secrets.items():
            sealed = sim.evaluate(mp.function(lambda v: mp.mpc.seal(v)), sim.put(0, x))
            firsts[name], depths[name], data[name] = [], [], {0: [], 1: [], 2: []}
            seen_first = set()
            for _ in range(evaluations):
                _, received = sim.evaluate_recorded(sort_shares, sealed)
                levels = opened_levels(received, n)
                firsts[name].append(int(levels[0].sum()))
                depths[name].append(len(levels))
                seen_first.add(levels[0].tobytes())
                for m in received:
                    data[name][m.dst].append(m.value.tobytes())
            assert len(seen_first) > evaluations - 2  # a fresh order every evaluation
    uniform = stats.randint(0, n)
    for name in secrets:
        # the pivot's rank among n: uniform, for distinct and for equal keys
        assert stats.kstest(firsts[name], uniform.cdf).pvalue > P_MIN, (name, firsts[name])
        # a random binary search tree's height: about 23 levels for 512 elements, not 512
        assert min(depths[name]) >= 9 and max(depths[name]) < 60, (name, depths[name])
    assert stats.mannwhitneyu(depths["A"], depths["B"]).pvalue > P_MIN
    for party in range(3):
        for name in secrets:
            counts = np.bincount(
                np.frombuffer(b"".join(data[name][party]), np.uint8), minlength=256
            )
            assert stats.chisquare(counts).pvalue > P_MIN, (name, party)
        table = np.stack(
            [
                np.bincount(np.frombuffer(b"".join(data[s][party]), np.uint8), minlength=256)
                for s in "AB"
            ]
        )
        assert stats.chi2_contingency(table).pvalue > P_MIN, party
