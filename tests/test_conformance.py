"""The conformance suite: behaviour every Cluster kind must show, identically.

Each test takes `make_cluster` and runs once per kind in tests/clusters.py.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import pytest
from mpplug_testkernels import fail_pfunction, sleep_pfunction

import mpplug as mp
from mpplug.errors import CommTimeoutError, PartyError, TraceError


@mp.function
def millionaire(alice: mp.MPObject, bob: mp.MPObject) -> mp.MPObject:
    return mp.run_jax_at(0, lambda a, b: a < b, alice, mp.p2p(1, 0, bob))


@pytest.mark.parametrize(("alice", "bob", "bob_richer"), [(3, 5, True), (7, 2, False)])
def test_millionaire_result_is_only_at_party_0(make_cluster, alice, bob, bob_richer):
    cluster = make_cluster(2)
    a = cluster.put(0, np.int64(alice * 1_000_000))
    b = cluster.put(1, np.int64(bob * 1_000_000))
    result = cluster.evaluate(millionaire, a, b)
    assert result.parties == {0}
    at_0, at_1 = cluster.fetch(result)
    assert at_1 is None
    assert at_0.dtype == np.bool_ and bool(at_0) is bob_richer
    assert bool(cluster.fetch(result, party=0)) is bob_richer


def test_p2p_moves_exact_bytes(make_cluster):
    cluster = make_cluster(3)
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    src = cluster.put(2, x)

    @mp.function
    def move(v):
        return mp.p2p(2, 0, v)

    out = cluster.evaluate(move, src)
    assert out.parties == {0}
    np.testing.assert_array_equal(cluster.fetch(out, party=0), x)
    assert cluster.fetch(out)[1:] == [None, None]


def test_bcast_reaches_every_party_or_the_named_ones(make_cluster):
    cluster = make_cluster(4)
    x = cluster.put(1, np.array([1.5, -2.0], dtype=np.float64))

    @mp.function
    def spread(v):
        return mp.bcast(1, v), mp.bcast(1, v, to=[0, 3])

    everywhere, some = cluster.evaluate(spread, x)
    for value in cluster.fetch(everywhere):
        np.testing.assert_array_equal(value, [1.5, -2.0])
        assert value.dtype == np.float64
    fetched = cluster.fetch(some)
    assert fetched[1] is None and fetched[2] is None
    np.testing.assert_array_equal(fetched[3], [1.5, -2.0])


def test_gather_collects_each_rank_in_order(make_cluster):
    cluster = make_cluster(3)

    @mp.function
    def collect():
        return mp.gather(2, mp.prank())

    values = cluster.evaluate(collect)
    assert [v.parties for v in values] == [{2}, {2}, {2}]
    assert [int(cluster.fetch(v, party=2)) for v in values] == [0, 1, 2]


def test_converge_joins_disjoint_values(make_cluster):
    cluster = make_cluster(3)

    @mp.function
    def join():
        low = mp.run_jax_at(0, lambda: jnp.float32(10.0))
        high = mp.run_jax(lambda r: (r * 100).astype(jnp.float32), mp.bcast(2, mp.prank(), [1, 2]))
        return mp.converge(low, high)

    out = cluster.evaluate(join)
    assert out.parties == {0, 1, 2}
    assert [float(v) for v in cluster.fetch(out)] == [10.0, 200.0, 200.0]


def test_prank_is_each_partys_rank(make_cluster):
    cluster = make_cluster(3)
    out = cluster.evaluate(mp.function(lambda: mp.prank()))
    assert [int(v) for v in cluster.fetch(out)] == [0, 1, 2]
    assert all(v.dtype == np.int32 and v.shape == () for v in cluster.fetch(out))


def test_prand_is_private_per_party_with_the_right_shape(make_cluster):
    cluster = make_cluster(3)
    out = cluster.evaluate(mp.function(lambda: mp.prand((4, 8))))
    values = cluster.fetch(out)
    assert all(v.shape == (4, 8) and v.dtype == np.uint32 for v in values)
    assert len({v.tobytes() for v in values}) == 3
    again = cluster.fetch(cluster.evaluate(mp.function(lambda: mp.prand((4, 8)))))
    assert again[0].tobytes() != values[0].tobytes()


def test_multiple_and_nested_outputs_keep_their_structure(make_cluster):
    cluster = make_cluster(2)
    x = cluster.put(0, np.arange(4, dtype=np.int32))

    @mp.function
    def shaped(v):
        stats = mp.run_jax(lambda a: {"sum": a.sum(), "parts": (a[:2], [a[2:] * 2])}, v)
        return {
            "stats": stats,
            "moved": mp.p2p(0, 1, v),
            "note": "host constants come back as they are",
        }, mp.prank()

    tree, rank = cluster.evaluate(shaped, x)
    assert tree["note"] == "host constants come back as they are"
    assert int(cluster.fetch(tree["stats"]["sum"], party=0)) == 6
    np.testing.assert_array_equal(cluster.fetch(tree["stats"]["parts"][0], party=0), [0, 1])
    np.testing.assert_array_equal(cluster.fetch(tree["stats"]["parts"][1][0], party=0), [4, 6])
    np.testing.assert_array_equal(cluster.fetch(tree["moved"], party=1), [0, 1, 2, 3])
    assert [int(r) for r in cluster.fetch(rank)] == [0, 1]


def test_chained_evaluations_reuse_handles_without_the_caller(make_cluster):
    cluster = make_cluster(2)

    @mp.function
    def step(v):
        doubled = mp.run_jax(lambda a: a * 2 + 1, v)
        return mp.p2p(0, 1, doubled) if 0 in v.parties else mp.p2p(1, 0, doubled)

    value = cluster.put(0, np.float32(1.0))
    for _ in range(6):
        value = cluster.evaluate(step, value)
    # 1 -> 3 -> 7 -> 15 -> 31 -> 63 -> 127, ending at party 0 after an even number of hops
    assert value.parties == {0}
    assert float(cluster.fetch(value, party=0)) == 127.0


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_sum_of_ranks_at_every_world_size(make_cluster, world_size):
    cluster = make_cluster(world_size)

    @mp.function
    def total():
        parts = mp.gather(0, mp.prank())
        summed = mp.run_jax_at(0, lambda *xs: sum(xs), *parts)
        return mp.bcast(0, summed)

    out = cluster.evaluate(total)
    expected = world_size * (world_size - 1) // 2
    assert [int(v) for v in cluster.fetch(out)] == [expected] * world_size


def test_kernel_error_surfaces_as_party_error_and_releases_the_others(make_cluster):
    cluster = make_cluster(3, timeout=30.0)

    @mp.function
    def broken():
        x = mp.run_jax_at(1, lambda: jnp.float32(1.0))
        (bad,) = mp.run_pfunc(fail_pfunction("boom at party one"), x)
        return mp.bcast(1, bad)  # parties 0 and 2 wait for a value that never comes

    start = time.monotonic()
    with pytest.raises(PartyError) as info:
        cluster.evaluate(broken)
    assert time.monotonic() - start < 10.0, "waiting parties were not released"
    err = info.value
    assert err.party == 1
    assert err.error_type == "ValueError"
    assert "boom at party one" in err.message
    assert "test.fail" in err.op
    # the cluster still works afterwards
    assert [int(v) for v in cluster.fetch(cluster.evaluate(mp.function(mp.prank)))] == [0, 1, 2]


def test_receive_past_the_timeout_names_waiting_party_and_peer(make_cluster):
    cluster = make_cluster(2, timeout=1.0)

    @mp.function
    def slow():
        x = mp.run_jax_at(0, lambda: jnp.float32(2.0))
        (late,) = mp.run_pfunc(sleep_pfunction(3.0), x)
        return mp.p2p(0, 1, late)

    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        cluster.evaluate(slow)
    assert time.monotonic() - start < 8.0
    assert info.value.party == 1 and info.value.peer == 0
    assert "party 1 waited" in str(info.value) and "from party 0" in str(info.value)


def test_compiled_program_ir_and_bytes_round_trip(make_cluster):
    cluster = make_cluster(2)
    a = cluster.put(0, np.int64(3))
    b = cluster.put(1, np.int64(5))
    program = cluster.compile(millionaire, a, b)
    text = program.ir()
    assert "program millionaire(world_size=2)" in text
    assert "shuffle[0<-1](%1) @{0} : i64[]" in text
    assert "call jax.exec:lambda(%0, %2) @{0} : bool[]" in text
    again = mp.Program.from_bytes(program.to_bytes())
    assert again.digest == program.digest and again.to_bytes() == program.to_bytes()
    assert again.ir() == text
    (result,) = cluster.evaluate(again, a, b)  # a decoded program returns a flat list
    assert bool(cluster.fetch(result, party=0)) is True


def test_placement_errors_are_raised_at_trace_time(make_cluster):
    cluster = make_cluster(2)
    a = cluster.put(0, np.float32(1.0))
    b = cluster.put(1, np.float32(2.0))

    @mp.function
    def mixed(x, y):
        return mp.run_jax(lambda u, v: u + v, x, y)

    with pytest.raises(TraceError, match=r"no party holds every argument.*\{0\}, \{1\}"):
        cluster.evaluate(mixed, a, b)
