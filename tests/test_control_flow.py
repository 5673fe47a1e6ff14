"""mp.cond, mp.while_loop and mp.fori_loop on every cluster kind: values, placements, errors
inside branches and iterations, memory over long loops, and no driver round trip per step."""

from __future__ import annotations

import time
import tracemalloc

import jax.numpy as jnp
import numpy as np
import pytest
from mpplug_testkernels import fail_pfunction, sleep_pfunction

import mpplug as mp
from mpplug.core.graph import Graph
from mpplug.errors import CommTimeoutError, InvalidProgramError, PartyError, TraceError
from simulator import Simulator


def _held(cluster, value):
    return [None if v is None else v.tolist() for v in cluster.fetch(value)]


@mp.function
def route_by_flag(x, y, flag):
    """Party 1's flag picks the branch; the branches move different values between
    different parties, and both deliver to party 2."""
    pred = mp.bcast(1, flag, to=[0, 1, 2])

    def double_from_zero(x, y):
        return mp.p2p(0, 2, mp.run_jax(lambda a: a * 2, x))

    def bump_from_one(x, y):
        return mp.p2p(1, 2, mp.run_jax(lambda b: b + 100, y))

    return mp.cond(pred, double_from_zero, bump_from_one, x, y)


def test_cond_branches_move_different_values_between_different_parties(make_cluster):
    cluster = make_cluster(3)
    x = cluster.put(0, np.float32(3.0))
    y = cluster.put(1, np.float32(5.0))
    taken = cluster.evaluate(route_by_flag, x, y, cluster.put(1, np.bool_(True)))
    other = cluster.evaluate(route_by_flag, x, y, cluster.put(1, np.bool_(False)))
    assert _held(cluster, taken) == [None, None, 6.0]
    assert _held(cluster, other) == [None, None, 105.0]
    text = cluster.compile(route_by_flag, x, y, cluster.put(1, np.bool_(True))).ir()
    assert "= cond(" in text and "then {" in text and "else {" in text
    assert "shuffle[2<-0]" in text and "shuffle[2<-1]" in text


@mp.function
def collatz_steps(start):
    """Steps of the Collatz sequence from party 0's start: a data-dependent trip count, with a
    nested cond choosing the step at party 0 and the flag broadcast to both parties."""

    def keep_going(state):
        n, _ = state
        return mp.bcast(0, mp.run_jax(lambda v: v != 1, n), to=[0, 1])

    def step(state):
        n, count = state
        odd = mp.run_jax(lambda v: v % 2 == 1, n)
        n = mp.cond(
            odd,
            lambda v: mp.run_jax(lambda a: 3 * a + 1, v),
            lambda v: mp.run_jax(lambda a: a // 2, v),
            n,
        )
        tick = mp.p2p(0, 1, mp.run_jax(lambda v: v * 0 + 1, n))
        return n, mp.run_jax(lambda c, t: c + t, count, tick)

    count = mp.constant(np.int32(0), parties=[1])
    return mp.while_loop(keep_going, step, (start, count))


def _collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n = 3 * n + 1 if n % 2 else n // 2
        steps += 1
    return steps


def test_while_loop_trip_count_depends_on_data_broadcast_from_one_party(make_cluster):
    cluster = make_cluster(2)
    program = None
    for start in (1, 6, 27):
        n, count = cluster.evaluate(collatz_steps, cluster.put(0, np.int32(start)))
        assert cluster.fetch(n, party=0) == 1
        assert cluster.fetch(count, party=1) == _collatz(start)
        compiled = cluster.compile(collatz_steps, cluster.put(0, np.int32(start)))
        assert program is None or compiled.digest == program.digest  # one program, any data
        program = compiled
    assert _collatz(27) == 111


def test_a_thousand_iterations_with_a_p2p_each_step(make_cluster):
    cluster = make_cluster(2)

    @mp.function
    def relay(x):
        def body(i, x):
            there = mp.p2p(0, 1, x)
            back = mp.run_jax(lambda v, i: v + i.astype(v.dtype), there, i)
            return mp.p2p(1, 0, back)

        return mp.fori_loop(0, 1000, body, x)

    out = cluster.evaluate(relay, cluster.put(0, np.int64(7)))
    assert cluster.fetch(out, party=0) == 7 + sum(range(1000))


def test_fori_loop_index_and_bounds(make_cluster):
    cluster = make_cluster(3)

    @mp.function
    def powers(x):
        doubled = mp.fori_loop(3, 8, lambda i, v: mp.run_jax(lambda a, i: a * 2 + i, v, i), x)
        untouched = mp.fori_loop(5, 5, lambda i, v: mp.run_jax(lambda a: a + 1, v), x)
        return doubled, untouched

    x = cluster.put(1, np.int32(1))
    doubled, untouched = cluster.evaluate(powers, x)
    expected = 1
    for i in range(3, 8):
        expected = expected * 2 + i
    assert cluster.fetch(doubled, party=1) == expected
    assert cluster.fetch(untouched, party=1) == 1  # an empty range returns init as it is
    loop = next(op for op in cluster.compile(powers, x).graph.ops if op.kind.name == "WHILE")
    assert loop.parties == {1}  # the index lives only where the loop has work


def test_values_captured_from_enclosing_scopes_and_nested_regions(make_cluster):
    cluster = make_cluster(2)

    @mp.function
    def scaled(x, scale, flag):
        pred = mp.bcast(0, flag)

        def body(i, acc):
            inner = mp.cond(
                pred,
                lambda a: mp.run_jax(lambda a, s: a * s, a, scale),  # scale: captured twice up
                lambda a: a,
                acc,
            )
            return mp.run_jax(lambda a: a + 1, inner)

        return mp.fori_loop(0, 3, body, x)

    x, scale = cluster.put(0, np.float32(1.0)), cluster.put(0, np.float32(2.0))
    assert (
        cluster.fetch(cluster.evaluate(scaled, x, scale, cluster.put(0, np.bool_(True))), 0) == 15
    )
    assert (
        cluster.fetch(cluster.evaluate(scaled, x, scale, cluster.put(0, np.bool_(False))), 0) == 4
    )


def test_failing_kernel_in_iteration_37_is_reported_with_op_and_iteration(make_cluster):
    cluster = make_cluster(2, timeout=30.0)

    @mp.function
    def breaks_late(x):
        def body(i, v):
            v = mp.p2p(0, 1, mp.p2p(1, 0, v))
            hit = mp.run_jax(lambda i: i == 37, i)
            boom = fail_pfunction("broke in the loop")
            return mp.cond(hit, lambda a: mp.run_pfunc(boom, a)[0], lambda a: a, v)

        return mp.fori_loop(0, 100, body, x)

    start = time.monotonic()
    with pytest.raises(PartyError) as info:
        cluster.evaluate(breaks_late, cluster.put(1, np.float32(1.0)))
    assert time.monotonic() - start < 10.0
    err = info.value
    assert err.party == 1 and err.error_type == "ValueError" and err.message == "broke in the loop"
    assert "(call test.fail:fail) in the true branch of op" in err.op
    assert "in iteration 37 of op" in err.op and "(while)" in err.op
    assert [int(v) for v in cluster.fetch(cluster.evaluate(mp.function(mp.prank)))] == [0, 1]


def test_timeout_inside_a_loop_names_the_iteration(make_cluster):
    cluster = make_cluster(2, timeout=1.0)

    @mp.function
    def stalls(x):
        def body(i, v):
            late = mp.cond(
                mp.run_jax(lambda i: i == 5, i),
                lambda a: mp.run_pfunc(sleep_pfunction(3.0), a)[0],
                lambda a: a,
                v,
            )
            return mp.p2p(1, 0, mp.p2p(0, 1, late))

        return mp.fori_loop(0, 10, body, x)

    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        cluster.evaluate(stalls, cluster.put(0, np.float32(1.0)))
    assert time.monotonic() - start < 8.0
    assert info.value.party == 1 and info.value.peer == 0
    assert "in iteration 5 of op" in str(info.value)
    assert "different values of a branch or loop predicate" in str(info.value)


def test_sealed_loop_state_stays_sealed_and_a_revealed_loss_drives_the_loop(make_cluster):
    cluster = make_cluster(3, timeout=60.0)

    @mp.function
    def fit(start, target):
        w, t = mp.mpc.seal(start), mp.mpc.seal(target)

        def improving(state):
            _, loss, steps = state
            return mp.run_jax(lambda loss, s: (loss > 0.01) & (s < 40), loss, steps)

        def step(state):
            w, _, steps = state
            w = mp.mpc.run(lambda w, t: w - 0.5 * (w - t), w, t)
            loss = mp.mpc.reveal(mp.mpc.run(lambda w, t: jnp.sum((w - t) ** 2), w, t))
            return w, loss, mp.run_jax(lambda s: s + 1, steps)

        init = (w, mp.constant(np.float32(1e9)), mp.constant(np.int32(0)))
        w, loss, steps = mp.while_loop(improving, step, init)
        return mp.mpc.reveal(w, to=0), loss, steps

    start = cluster.put(0, np.zeros(3, np.float32))
    target = cluster.put(1, np.array([1.0, 2.0, 3.0], np.float32))
    w, loss, steps = cluster.evaluate(fit, start, target)
    np.testing.assert_allclose(cluster.fetch(w, party=0), [1.0, 2.0, 3.0], atol=0.05)
    assert cluster.fetch(loss, party=2) <= 0.01
    assert cluster.fetch(steps, party=1) == 6  # the loss falls 4x a step, from 14
    loop = next(
        op for op in cluster.compile(fit, start, target).graph.ops if op.kind.name == "WHILE"
    )
    assert str(loop.outs[0]) == "u64[2,3]"  # the weights cross iterations as shares only


def test_driver_rpcs_do_not_grow_with_the_trip_count():
    from tests.clusters import POOL, driven

    with driven(POOL.get(2), 20.0) as driver:
        counts = _CountingStubs(driver)
        start = driver.put(0, np.int32(1))
        driver.fetch(driver.evaluate(collatz_steps, start)[1], party=1)  # ships the program
        calls = []
        for n in (2, 27, 97):  # 1, 111 and 118 iterations
            value = driver.put(0, np.int32(n))
            counts.reset()
            driver.evaluate(collatz_steps, value)
            calls.append(dict(counts.calls))
        assert calls[0] == calls[1] == calls[2] == {"Execute": 2}


class _CountingStubs:
    """Counts the calls a Driver makes to its parties, by method name."""

    def __init__(self, driver) -> None:
        self.calls: dict[str, int] = {}
        driver._stubs = [_Counted(s, self.calls) for s in driver._stubs]
        driver._streams = [_Counted(s, self.calls) for s in driver._streams]

    def reset(self) -> None:
        self.calls.clear()


class _Counted:
    def __init__(self, stub, calls) -> None:
        self._stub, self._calls = stub, calls

    def __getattr__(self, name):
        method = getattr(self._stub, name)
        calls = self._calls

        class Method:
            def __call__(self, *args, **kwargs):
                calls[name] = calls.get(name, 0) + 1
                if name == "ExecuteStream":  # count each execution sent on it as one Execute
                    args = (_counting("Execute", args[0], calls), *args[1:])
                return method(*args, **kwargs)

            def future(self, *args, **kwargs):
                calls[name] = calls.get(name, 0) + 1
                return method.future(*args, **kwargs)

        return Method()


def _counting(name, messages, calls):
    for message in messages:
        calls[name] = calls.get(name, 0) + 1
        yield message


def test_past_iterations_are_freed():
    payload = np.zeros(2**18, np.float32)  # 1 MiB a value; 200 iterations would keep 400 MiB

    @mp.function
    def shuttle(x):
        return mp.fori_loop(0, 200, lambda i, v: mp.p2p(1, 0, mp.p2p(0, 1, v)), x)

    with Simulator(2) as sim:
        x = sim.put(0, payload)
        sim.evaluate(shuttle, x)  # warm up: trace and plan
        tracemalloc.start()
        try:
            out = sim.evaluate(shuttle, x)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert sim.fetch(out, party=0).shape == payload.shape
    assert peak < 16 * payload.nbytes, f"peak {peak / 2**20:.0f} MiB over 200 iterations"


# -- trace errors ----------------------------------------------------------------------------


def _trace(fn, *args, world_size=3):
    return mp.compile(mp.function(fn), *args, world_size=world_size)


F32_AT_0 = mp.MPObject(mp.TensorType("float32"), {0})
BOOL_AT_0 = mp.MPObject(mp.TensorType("bool"), {0})


def test_cond_predicate_must_reach_every_party_of_the_branches():
    def prog(x, flag):
        return mp.cond(flag, lambda v: mp.p2p(0, 2, v), lambda v: mp.p2p(0, 2, v), x)

    with pytest.raises(
        TraceError,
        match=r"mp.cond: parties \{2\} take part but do not hold "
        r"the predicate \(held by \{0\}\).*mp.bcast\(0, pred\)",
    ):
        _trace(prog, F32_AT_0, BOOL_AT_0)


def test_cond_predicate_must_be_a_bool_scalar():
    def prog(x):
        return mp.cond(x, lambda v: v, lambda v: v, x)

    with pytest.raises(TraceError, match=r"expected a bool\[\] predicate, got f32\[\]"):
        _trace(prog, F32_AT_0)


@pytest.mark.parametrize(
    ("false_fn", "message"),
    [
        (
            lambda v: (mp.run_jax(lambda a: a.astype(jnp.int32), v),),
            r"output\[0\] is f32\[\] @\{0\} from true_fn .*, but i32\[\] @\{0\} from false_fn",
        ),
        (
            lambda v: (mp.p2p(0, 1, v),),
            r"output\[0\] is f32\[\] @\{0\} from true_fn .*, but f32\[\] @\{1\} from false_fn",
        ),
        (lambda v: (v, v), r"true_fn .* gives PyTreeDef\(\(\*,\)\), but false_fn .* gives"),
        (lambda v: (v, 1.0), r"false_fn .* output\[1\] is float, expected a party value"),
    ],
)
def test_cond_branches_must_agree(false_fn, message):
    def prog(x, flag):
        return mp.cond(flag, lambda v: (v,), false_fn, x)

    with pytest.raises(TraceError, match=message):
        _trace(prog, F32_AT_0, BOOL_AT_0)


def test_while_loop_trace_errors():
    def unheld(x):
        def cond_fn(v):
            return mp.run_jax(lambda a: a < 3, v)

        return mp.while_loop(cond_fn, lambda v: mp.p2p(1, 0, mp.p2p(0, 1, v)), x)

    with pytest.raises(
        TraceError,
        match=r"parties \{1\} take part but do not hold cond_fn "
        r"cond_fn's result \(held by \{0\}\).*return mp.bcast\(0, flag\)",
    ):
        _trace(unheld, F32_AT_0)

    def moved(x):
        return mp.while_loop(lambda v: mp.run_jax(lambda a: a < 3, v), lambda v: mp.p2p(0, 1, v), x)

    with pytest.raises(TraceError, match=r"output is f32\[\] @\{0\} from init, but f32\[\] @\{1\}"):
        _trace(moved, F32_AT_0)

    def not_a_flag(x):
        return mp.while_loop(lambda v: v, lambda v: v, x)

    with pytest.raises(
        TraceError, match=r"cond_fn .* must return one bool\[\] party value, got f32"
    ):
        _trace(not_a_flag, F32_AT_0)

    def host_leaf(x):
        return mp.while_loop(lambda s: s[0], lambda s: s, (x, 3))

    with pytest.raises(TraceError, match=r"mp.while_loop init\[1\] is int, expected a party value"):
        _trace(host_leaf, BOOL_AT_0)


def test_fori_loop_bounds_are_python_ints():
    def prog(x):
        return mp.fori_loop(0, x, lambda i, v: v, x)

    with pytest.raises(
        TraceError,
        match=r"expected a Python int upper bound, got TracedValue.*"
        r"mp.while_loop",
    ):
        _trace(prog, F32_AT_0)
    with pytest.raises(TraceError, match=r"upper bound 4294967296 does not fit in i32"):
        _trace(lambda x: mp.fori_loop(0, 2**32, lambda i, v: v, x), F32_AT_0)
    with pytest.raises(TraceError, match=r"mp.fori_loop init\[1\] is int, expected a party value"):
        _trace(lambda x: mp.fori_loop(3, 3, lambda i, s: s, (x, 1)), F32_AT_0)  # even if empty
    with pytest.raises(
        TraceError,
        match=r"mp.fori_loop: output is f32\[\] @\{0\} from init, but f32\[\] @\{1\} from body_fn",
    ):
        _trace(lambda x: mp.fori_loop(0, 3, lambda i, v: mp.p2p(0, 1, v), x), F32_AT_0)


def test_a_user_loop_using_the_counter_kernel_is_run_step_by_step(make_cluster):
    """The interpreter counts mp.fori_loop's steps on the host; a user loop that uses the
    counter's results elsewhere must not be mistaken for one."""
    from mpplug.kernels import builtin

    cluster = make_cluster(2)
    step = builtin.counter_pfunction(4)

    @mp.function
    def sums_the_indices(x):
        def body(state):
            i, _, acc = state
            following, more = mp.run_pfunc(step, i)
            return following, more, mp.run_jax(lambda a, n: a + n, acc, following)

        start = (mp.constant(np.int32(0)), mp.constant(True), x)
        return mp.while_loop(lambda s: s[1], body, start)[2]

    out = cluster.evaluate(sums_the_indices, cluster.put(0, np.int32(0)))
    assert _held(cluster, out) == [10, None]  # 1 + 2 + 3 + 4


@mp.function
def endless(x):
    return mp.while_loop(lambda v: mp.constant(True, parties=[1]), lambda v: v, x)


@pytest.mark.parametrize("kind", ["simulator", "driver"])
def test_an_endless_loop_stops_when_the_execution_is_given_up(kind):
    from mpplug.remote.driver import Driver

    from .clusters import POOL

    if kind == "simulator":
        cluster = Simulator(2, timeout=1.0, execute_timeout=2.0)
    else:
        cluster = Driver(POOL.get(2).config, timeout=1.0, execute_timeout=2.0)
    with cluster:
        start = time.monotonic()
        with pytest.raises(mp.PartyUnavailableError, match="no answer"):
            cluster.evaluate(endless, cluster.put(1, np.float32(0.0)))
        assert time.monotonic() - start < 6.0
        if kind == "driver":  # the party was told to abort: it runs nothing any more
            _wait_idle(cluster, 1)
        start = time.monotonic()  # the party is free again: its loop saw the abort
        assert [int(v) for v in cluster.fetch(cluster.evaluate(mp.function(mp.prank)))] == [0, 1]
        assert time.monotonic() - start < 3.0


def _wait_idle(driver, rank: int) -> None:
    from mpplug.protos import service_pb2 as pb

    deadline = time.monotonic() + 5.0
    while driver._stubs[rank].Status(pb.StatusRequest(), timeout=5.0).executions:
        assert time.monotonic() < deadline, f"party {rank} still runs an execution"
        time.sleep(0.05)


def test_nesting_deeper_than_the_limit_is_refused_at_trace_time():
    def nest(depth, v, flag):
        if depth == 0:
            return mp.run_jax(lambda a: a + 1, v)
        return mp.cond(flag, lambda a: nest(depth - 1, a, flag), lambda a: a, v)

    _trace(lambda x, f: nest(32, x, f), F32_AT_0, BOOL_AT_0)
    with pytest.raises(TraceError, match=r"regions nest deeper than 32"):
        _trace(lambda x, f: nest(33, x, f), F32_AT_0, BOOL_AT_0)


# -- the IR and its wire form ----------------------------------------------------------------


def _relay_program():
    @mp.function
    def relay(x, flag):
        pred = mp.bcast(0, flag, to=[0, 1])

        def body(i, v):
            there = mp.cond(pred, lambda a: mp.p2p(0, 1, a), lambda a: mp.p2p(0, 1, a), v)
            return mp.p2p(1, 0, mp.run_jax(lambda a, i: a + i, there, i))

        return mp.fori_loop(0, 4, body, x)

    i32_at_0 = mp.MPObject(mp.TensorType("int32"), {0})
    return mp.compile(relay, i32_at_0, BOOL_AT_0, world_size=2)


def test_nested_regions_print_indented_and_round_trip_through_bytes():
    from mpplug.protos import values_pb2 as pb

    program = _relay_program()
    text = program.ir()
    assert "\n    body {\n" in text
    assert "\n      %5 = cond(%4, %2) @{0,1} : i32[] @{1}\n        then {\n" in text
    assert "\n          %1 = shuffle[1<-0](%0) @{1} : i32[]\n" in text  # a branch, nested twice
    again = mp.Program.from_bytes(program.to_bytes())
    assert again.to_bytes() == program.to_bytes() and again.ir() == text
    assert pb.Graph.FromString(program.to_bytes()).version == 2
    straight = mp.compile(mp.function(lambda x: mp.p2p(0, 1, x)), F32_AT_0, world_size=2)
    assert pb.Graph.FromString(straight.to_bytes()).version == 1  # old parties still run it


def test_graph_versions_are_checked():
    from mpplug.protos import values_pb2 as pb

    msg = pb.Graph.FromString(_relay_program().to_bytes())
    msg.version = 1  # what an old party reads: COND and WHILE are unknown to version 1
    with pytest.raises(InvalidProgramError, match=r"a WHILE op needs graph version 2, got 1"):
        Graph.from_bytes(msg.SerializeToString())
    msg.version = 4
    with pytest.raises(InvalidProgramError, match=r"got 4: .* newer mpplug than this one"):
        Graph.from_bytes(msg.SerializeToString())
    msg.version = 3  # the tables' version: this program has none
    needs_2 = r"version 3 given, but its ops need exactly version 2"
    with pytest.raises(InvalidProgramError, match=needs_2):
        Graph.from_bytes(msg.SerializeToString())
    straight = mp.compile(mp.function(lambda x: mp.p2p(0, 1, x)), F32_AT_0, world_size=2)
    msg = pb.Graph.FromString(straight.to_bytes())
    msg.version = 2
    with pytest.raises(
        InvalidProgramError, match=r"version 2 given, but its ops need exactly version 1"
    ):
        Graph.from_bytes(msg.SerializeToString())


def _loop_op(msg):
    return next(op for op in msg.ops if op.kind == op.WHILE)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (
            lambda loop: loop.regions[1].ops[2].parties.append(1),
            r"op %5 region 1 op %2: parameter 2 is i32\[\] @\{0,1\}, its operand is i32\[\] "
            r"@\{0\}",
        ),
        (
            lambda loop: loop.out_parties[2].parties.append(1),
            r"the loop-carried inputs differ from the outputs",
        ),
        (lambda loop: loop.parties.remove(1), r"parties \{0\} differ from those taking part"),
        (lambda loop: loop.regions.pop(), r"a while op has 2 regions, got 1"),
        (
            lambda loop: loop.regions[1].outputs.pop(),
            r"region 1: its outputs differ from the op's in number, type or holders",
        ),
        (
            lambda loop: loop.regions[1].ops[5].regions[0].ops[1].routes[0].__setattr__("src", 1),
            r"region 1 op %5 region 0 op %1: route 1<-1: party 1 holds no operand",
        ),
    ],
)
def test_malformed_regions_are_rejected_with_the_path_to_the_op(corrupt, message):
    from mpplug.protos import values_pb2 as pb

    msg = pb.Graph.FromString(_relay_program().to_bytes())
    corrupt(_loop_op(msg))
    with pytest.raises(InvalidProgramError, match=message):
        Graph.from_bytes(msg.SerializeToString())


def test_a_peer_value_with_a_malformed_scope_is_refused():
    import grpc

    from mpplug.config import ClusterSpec
    from mpplug.core.serde import tensor_type_to_proto
    from mpplug.protos import service_pb2 as spb
    from mpplug.protos import service_pb2_grpc as rpc_pb

    from .clusters import in_process

    spec = ClusterSpec.local(2)
    f32 = tensor_type_to_proto(mp.TensorType("float32"))
    with (
        in_process(spec, ["P0"]),
        grpc.insecure_channel(spec.parties[0].endpoint) as channel,
    ):
        peer = rpc_pb.PeerServiceStub(channel)
        for scope, ok in (([3, 1, 37], True), ([3, 1], False), ([0, 0, 0] * 33, False)):
            header = spb.PeerHeader(exec_id="s1:e1", op=2, src=1, dst=0, type=f32, scope=scope)
            chunk = spb.PeerChunk(header=header, data=b"\0" * 4)
            if ok:
                peer.SendSmall(chunk, timeout=5.0)
                continue
            with pytest.raises(grpc.RpcError) as info:
                peer.SendSmall(chunk, timeout=5.0)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "expected a scope of (op, region, iteration) triples" in info.value.details()


def test_keys_tell_branches_and_iterations_apart():
    from mpplug.runtime.communicator import Key

    a = Key("e", 4, 0, 1, (2, 1, 36))
    b = Key("e", 4, 0, 1, (2, 1, 37))
    c = Key("e", 4, 0, 1, (2, 0, 37))
    assert len({a, b, c, Key("e", 4, 0, 1)}) == 4
    assert str(b) == "e/2.1.37/4/0->1"


def test_secure_work_in_a_loop_draws_fresh_randomness_every_iteration():
    """The same product in five iterations: with correlated randomness reused across
    iterations the parties would receive the same messages each time, telling them the inputs
    repeat. Every key and every share message must differ."""
    from .mpc_views import RecordingSimulator

    @mp.function
    def square_five_times(x):
        def body(i, state):
            x, _ = state
            return x, mp.mpc.run(lambda v: v * v, x)

        sealed = mp.mpc.seal(x)
        return mp.fori_loop(0, 5, body, (sealed, mp.mpc.run(lambda v: v * 0, sealed)))[1]

    with RecordingSimulator(3) as sim:
        out, received = sim.evaluate_recorded(
            square_five_times, sim.put(0, np.float32([1.5, -2.0]))
        )
        result = sim.evaluate(mp.function(lambda s: mp.mpc.reveal(s, to=0)), out)
        np.testing.assert_allclose(sim.fetch(result, party=0), [2.25, 4.0], atol=1e-3)
    # PRF keys are 8 u32 words; everything else is shares (u64) or truncation bits (u32)
    is_key = [r.value.dtype == np.uint32 and r.value.shape == (8,) for r in received]
    keys = [r.value.tobytes() for r, key in zip(received, is_key, strict=True) if key]
    shares = [r.value.tobytes() for r, key in zip(received, is_key, strict=True) if not key]
    assert len(keys) == 3 * 6  # the first key exchange, then one per iteration
    assert len(set(keys)) == len(keys)
    assert len(shares) >= 3 * 5 and len(set(shares)) == len(shares)
