"""The API as a new user meets it: 64-bit dtypes, keyword arguments, fetching pytrees, the
current cluster, party names, prand, PRNG keys, operators, and errors in the user's terms."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpplug as mp
from mpplug.errors import MPPlugError, TraceError

from .clusters import POOL, driven
from .test_control_flow import _CountingStubs


def test_a_64_bit_dtype_the_function_asks_for_is_kept(make_cluster):
    cluster = make_cluster(2)
    x = cluster.put(0, np.uint32(3))

    @mp.function
    def wide(x):
        return (
            mp.run_jax_at(0, lambda: jnp.uint64(2**40 + 1)),
            mp.run_jax(lambda a: a.astype(jnp.uint64) << 32, x),
            mp.run_jax(lambda a: a + jnp.arange(2), x),  # JAX's default stays 32-bit
        )

    big, shifted, default = cluster.evaluate(wide, x)
    assert cluster.fetch(big, party=0) == np.uint64(2**40 + 1)
    assert big.type == mp.TensorType("uint64", ())
    assert cluster.fetch(shifted, party=0) == np.uint64(3 << 32)
    assert default.type.dtype == mp.DType.INT32


def test_evaluate_takes_keyword_arguments(make_cluster):
    cluster = make_cluster(2)

    @mp.function
    def scaled(x, *, by=1.0, offset=None):
        return mp.run_jax(lambda a, b: a * by + b, x, offset)

    x, offset = cluster.put(0, np.float32(2.0)), cluster.put(0, np.float32(0.5))
    assert cluster.fetch(cluster.evaluate(scaled, x, by=3.0, offset=offset), party=0) == 6.5
    assert cluster.fetch(cluster.evaluate(scaled, x, offset=offset), party=0) == 2.5
    program = cluster.compile(scaled, x, by=3.0, offset=offset)
    with pytest.raises(TraceError, match=r"takes its party values positionally.*\['offset'\]"):
        cluster.evaluate(program, x, offset=offset)


def test_fetch_takes_a_pytree_and_asks_each_party_once(make_cluster):
    cluster = make_cluster(3)

    @mp.function
    def several():
        return {
            "rank": mp.prank(),
            "pair": (
                mp.run_jax_at(1, lambda: jnp.arange(2000)),
                mp.run_jax_at(2, lambda: jnp.full(1100, 5.0)),
            ),
            "more": mp.run_jax_at(1, lambda: jnp.arange(2000) * 2),
            "note": "host values come back as they are",
        }

    out = cluster.evaluate(several)
    if hasattr(cluster, "_stubs"):
        counts = _CountingStubs(cluster)
    got = cluster.fetch(out)
    assert got["note"] == "host values come back as they are"
    assert [int(v) for v in got["rank"]] == [0, 1, 2]
    assert got["pair"][0][0] is None and got["pair"][0][1].tolist() == list(range(2000))
    assert got["pair"][1][:2] == [None, None] and got["pair"][1][2].tolist() == [5.0] * 1100
    assert got["more"][1].tolist() == list(range(0, 4000, 2))
    # Over 4 KiB, values are fetched: parties 1 and 2 once each (party 1 two values in one
    # call). The ranks, small, came back with the Execute replies: party 0 is not asked.
    if hasattr(cluster, "_stubs"):
        assert counts.calls == {"FetchMany": 1, "Fetch": 1}
        counts.reset()
    at_one = cluster.fetch([out["pair"][0], out["rank"]], party=1)
    assert at_one[0].tolist() == list(range(2000)) and int(at_one[1]) == 1
    if hasattr(cluster, "_stubs"):
        assert counts.calls == {"Fetch": 1}
    with pytest.raises(ValueError, match="party 0 does not hold"):
        cluster.fetch(out["pair"], party=0)


def test_small_outputs_come_back_with_the_execution_and_leave_with_their_handle():
    with driven(POOL.get(2), 20.0) as driver:
        out = driver.evaluate(mp.function(lambda: mp.run_jax(lambda r: r * 10, mp.prank())))
        counts = _CountingStubs(driver)
        first = driver.fetch(out)
        first[1] += 5  # the caller's own copy
        assert [int(v) for v in driver.fetch(out)] == [0, 10]
        assert counts.calls == {}
        name = out.name
        assert all(name in held for held in driver._inline)
        del out
        gc.collect()
        driver.fetch(driver.put(0, np.float32(0)), party=0)  # sorts the released names
        assert not any(name in held for held in driver._inline)


def test_module_helpers_work_on_the_current_cluster():
    with mp.Simulator(["alice", "bob"]) as sim:
        x = mp.put("bob", np.float32(2.0))
        out = mp.evaluate(mp.function(lambda v: v * 10), x)
        assert mp.fetch(out, party="bob") == 20.0
        with mp.Simulator(1) as inner:  # the innermost with-block wins
            assert mp.put(0, np.int32(1)).cluster is inner
        assert mp.put(0, np.int32(1)).cluster is sim
    with pytest.raises(MPPlugError, match=r"mp.evaluate works on the current cluster"):
        mp.evaluate(mp.function(mp.prank))


def test_party_names_default_and_chosen():
    with mp.Simulator(2) as sim:
        assert sim.parties == ["P0", "P1"]
        assert sim.fetch(sim.put("P1", np.int32(4)), party="P1") == 4
        with pytest.raises(ValueError, match=r"unknown party 'alice'; parties: \['P0', 'P1'\]"):
            sim.put("alice", 1)
    with mp.Simulator(["alice", "bob"]) as sim:
        assert sim.parties == ["alice", "bob"]
        assert sim.fetch(sim.put("alice", np.int32(1)), party=0) == 1
    with pytest.raises(ValueError, match="expected a non-empty list of party names"):
        mp.Simulator([])


def test_prand_takes_an_int_shape_and_a_dtype():
    with mp.Simulator(2) as sim:
        words, wide = sim.evaluate(
            mp.function(lambda: (mp.prand(4), mp.prand((2, 3), parties=[1], dtype="uint64")))
        )
        assert words.type == mp.TensorType("uint32", (4,)) and words.parties == {0, 1}
        assert wide.type == mp.TensorType("uint64", (2, 3)) and wide.parties == {1}
        a, b = sim.fetch(words)
        assert not np.array_equal(a, b)  # each party's own draw
        with pytest.raises(TraceError, match=r"mp.prand\(shape=3, dtype='float32'\): .*uint32"):
            sim.evaluate(mp.function(lambda: mp.prand(3, dtype="float32")))


def test_typed_prng_keys():
    key = jax.random.key(7)
    with mp.Simulator(1) as sim:
        drawn = sim.evaluate(
            mp.function(lambda: mp.run_jax_at(0, lambda k: jax.random.uniform(k, (3,)), key))
        )
        np.testing.assert_array_equal(sim.fetch(drawn, party=0), jax.random.uniform(key, (3,)))
        with pytest.raises(TraceError, match=r"typed PRNG keys cannot leave.*key_data"):
            sim.evaluate(mp.function(lambda: mp.run_jax_at(0, lambda: jax.random.key(1))))


def test_operators_on_traced_values(make_cluster):
    cluster = make_cluster(2)
    x, y = cluster.put(0, np.float32(6.0)), cluster.put(0, np.float32(4.0))
    i = cluster.put(0, np.int32(6))

    @mp.function
    def arithmetic(x, y, i):
        return [
            x + y, x - y, x * y, x / y, x // y, x % y, x**2, 2**y, 1 - x, 12 / x,
            -x, abs(-x), x < y, x >= y, x == y, x != y, (x > y) & (y > 0), i | 1, i ^ 3, ~i,
        ]  # fmt: skip

    got = [cluster.fetch(v, party=0).item() for v in cluster.evaluate(arithmetic, x, y, i)]
    assert got == [
        10.0, 2.0, 24.0, 1.5, 1.0, 2.0, 36.0, 16.0, -5.0, 2.0,
        -6.0, 6.0, False, True, False, True, True, 7, 5, -7,
    ]  # fmt: skip


def test_errors_speak_in_the_users_call():
    at0 = mp.MPObject(mp.TensorType("float32"), {0})
    at1 = mp.MPObject(mp.TensorType("float32"), {1})
    cases = [
        (lambda x, y: mp.p2p(1, 0, x), r"^mp.p2p\(1, 0, x\): party 1 does not hold the value"),
        (lambda x, y: mp.bcast(1, x), r"^mp.bcast\(1, x\): party 1 does not hold the value"),
        (lambda x, y: mp.gather(x, 0), r"^mp.gather\(.*expected mp.gather\(dst, x\)"),
        (lambda x, y: mp.bcast(x, 0), r"expected mp.bcast\(src, x, to=None\)"),
        (lambda x, y: x * y, r"TracedValue.* \* TracedValue.*no party holds every argument"),
        (lambda x, y: mp.run_jax(lambda: 1.0), r"no party-value argument tells where to run"),
    ]
    for body, message in cases:
        with pytest.raises(TraceError, match=message):
            mp.compile(mp.function(body), at0, at1, world_size=2)


def test_a_handle_used_from_the_enclosing_scope_says_how_to_pass_it():
    with mp.Simulator(2) as sim:
        outside = sim.put(0, np.float32(1.0))
        with pytest.raises(TraceError, match=r"value outside the program.*pass it in as an"):
            sim.evaluate(mp.function(lambda: mp.run_jax(lambda a: a + 1, outside)))


def test_the_driver_refuses_a_program_calling_a_kernel_a_party_lacks():
    from mpplug.errors import UnknownKernelError

    from .clusters import POOL, driven

    @mp.kernel("test.only_in_the_driver")
    def doubled(pfunc, args, runtime):
        return [np.asarray(args[0]) * 2]

    local = mp.PFunction(
        "test.only_in_the_driver",
        "doubled",
        b"",
        (mp.TensorType("float32"),),
        (mp.TensorType("float32"),),
    )

    @mp.function
    def uses_it(x):
        return mp.run_pfunc(local, x)[0]

    with mp.Simulator(2) as sim:  # one process: the kernel is there
        assert sim.fetch(sim.evaluate(uses_it, sim.put(1, np.float32(2.0))), party=1) == 4.0
    with driven(POOL.get(2), 20.0) as driver:
        x = driver.put(1, np.float32(2.0))
        counts = _CountingStubs(driver)
        with pytest.raises(UnknownKernelError) as info:
            driver.evaluate(uses_it, x)
        message = str(info.value)
        assert "party P1 serves no kernel for 'test.only_in_the_driver'" in message
        assert "entry point in the 'mpplug.kernels' group" in message
        assert not {"Execute", "LoadProgram", "LoadProgramSmall"} & set(counts.calls)
        assert [int(v) for v in driver.fetch(driver.evaluate(mp.function(mp.prank)))] == [0, 1]


def _chain(x, y):
    for i in range(20):
        x = mp.run_jax(lambda a, k=1.0 + i / 10: a * k + np.float32(0.5), x)
    moved = mp.p2p(0, 1, x)
    doubled = mp.fori_loop(0, 3, lambda i, v: mp.run_jax(lambda a: a * 2, v) + 1, moved + y)
    return doubled, x - 1, mp.cond(mp.bcast(0, x[0] > 0), lambda v: v * 3, lambda v: v, x)


def test_fused_programs_compute_what_unfused_ones_do(make_cluster):
    cluster = make_cluster(2)
    x = cluster.put(0, np.arange(4, dtype=np.float32))
    y = cluster.put(1, np.ones(4, np.float32))
    plain = cluster.fetch(cluster.evaluate(mp.function(_chain), x, y))
    fused_fn = mp.function(_chain, fuse=True)
    fused = cluster.fetch(cluster.evaluate(fused_fn, x, y))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(fused), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    graph = cluster.compile(fused_fn, x, y).graph
    calls = [op for op in graph.ops if op.kind.name == "CALL"]
    names = [graph.functions[op.function].fn_name for op in calls]
    assert names[0] == "fused20"  # the 20 ops at party 0 in one function, before the p2p
    assert len(graph.functions[calls[0].function].outs_info) == 1  # only the value used later


def test_a_fused_call_keeps_placement_errors():
    def misplaced(x, y):
        return mp.run_jax_at(1, lambda a: a + 1, x)

    at0 = mp.MPObject(mp.TensorType("float32"), {0})
    with pytest.raises(TraceError, match=r"held by \{0\}, not by \{1\}; move it first"):
        mp.compile(mp.function(misplaced, fuse=True), at0, at0, world_size=2)


SCALE = 2.0


def _times_scale(v):
    return v * SCALE


def test_exports_follow_what_a_function_reads():
    global SCALE

    class Scaler:
        def __init__(self, k):
            self.k = k

        def __call__(self, v):
            return v * self.k

    def run(sim, fn, x):
        return float(sim.fetch(sim.evaluate(mp.function(lambda v: mp.run_jax(fn, v)), x), 0))

    with mp.Simulator(1) as sim:
        x = sim.put(0, np.float32(1.0))
        assert run(sim, lambda v: _times_scale(v), x) == 2.0
        SCALE = 5.0  # a global read by a function the lambda calls
        try:
            assert run(sim, lambda v: _times_scale(v), x) == 5.0
        finally:
            SCALE = 2.0
        scaler = Scaler(3.0)
        assert run(sim, scaler, x) == 3.0
        scaler.k = 7.0  # a callable object is never cached
        assert run(sim, scaler, x) == 7.0
        zeros = map(np.float32, (0.0, -0.0))
        signs = [run(sim, lambda v, z=z: 1.0 / (z * (v * 0 + 1)), x) for z in zeros]
        assert signs == [np.inf, -np.inf]  # np.float32 0.0 and -0.0 are different constants


def test_fused_calls_are_frozen_when_made():
    def program(x, y):
        total = x
        for i in range(3):
            total = mp.run_jax(lambda v: v + i, total)  # noqa: B023 (i as it is now)
        host = np.ones(1, np.float32)
        shifted = mp.run_jax(lambda v, h: v + h, total, host)
        host[:] = 100  # too late to matter
        inside = mp.cond(
            mp.bcast(0, y > 0),
            lambda v: mp.run_jax(lambda a, b: a * b, v, x),  # x captured into the branch
            lambda v: v,
            shifted,
        )
        return mp.fori_loop(0, 2, lambda i, v: mp.run_jax(lambda a, b: a + b, v, x), inside)

    with mp.Simulator(2) as sim:
        x, y = sim.put(0, np.float32([2.0])), sim.put(0, np.float32(1.0))
        plain = sim.fetch(sim.evaluate(mp.function(program), x, y), party=0)
        fused = sim.fetch(sim.evaluate(mp.function(program, fuse=True), x, y), party=0)
        assert plain.tolist() == fused.tolist() == [((2 + 3 + 1) * 2) + 4]


def test_mpc_in_a_fused_program():
    @mp.function(fuse=True)
    def product(a, b):
        sa, sb = mp.mpc.seal((a, b))
        return mp.mpc.reveal(mp.mpc.run(lambda u, v: u * v + 1, sa, sb), to=0)

    with mp.Simulator(3) as sim:
        out = sim.evaluate(product, sim.put(0, np.float32([1, 2])), sim.put(1, np.float32([3, 4])))
        np.testing.assert_allclose(sim.fetch(out, party=0), [4, 9], atol=1e-3)


def test_traced_values_iterate_and_defer_to_numpy():
    @mp.function
    def program(x):
        first, *rest = x
        with pytest.raises(TraceError, match="`in` needs a truth value"):
            _ = 1.0 in x
        return first, rest, np.ones(3, np.float32) + x, len(x)

    with mp.Simulator(1) as sim:
        first, rest, summed, size = sim.evaluate(program, sim.put(0, np.float32([1, 2, 3])))
        assert sim.fetch(first, 0) == 1 and [sim.fetch(r, 0) for r in rest] == [2, 3]
        assert sim.fetch(summed, 0).tolist() == [2, 3, 4] and size == 3


def test_threads_share_a_cluster_in_with_blocks():
    import threading

    errors = []
    sim = mp.Simulator(1)
    barrier = threading.Barrier(2)

    def work():
        try:
            with sim:
                barrier.wait()
                assert mp.fetch(mp.put(0, np.int32(3)), party=0) == 3
                barrier.wait()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with pytest.raises(MPPlugError, match=r"there is none"):
        mp.put(0, 1)


def test_prand_shapes_like_numpy():
    with mp.Simulator(1) as sim:
        assert sim.evaluate(mp.function(lambda: mp.prand(np.int64(2)))).type.shape == (2,)
        with pytest.raises(TraceError, match="a bool is not a shape"):
            sim.evaluate(mp.function(lambda: mp.prand(True)))
