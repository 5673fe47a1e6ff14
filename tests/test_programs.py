"""Tracing `@mp.function` programs: the Graph they become, its text and bytes, and the
errors raised at trace time (never on a party)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import mpplug as mp
from mpplug.core import graph as graph_module
from mpplug.core import serde
from mpplug.core.graph import Graph
from mpplug.errors import InvalidProgramError, TraceError

I32 = mp.TensorType("int32", ())
F32x3 = mp.TensorType("float32", (3,))


def at(party, ttype=F32x3):
    return mp.MPObject(ttype, party)


@mp.function
def scaled_sum(x, y, *, scale=2.0):
    y0 = mp.p2p(1, 0, y)
    return mp.run_jax(lambda a, b, s: (a + b) * s, x, y0, scale)


def test_ir_prints_one_op_a_line_with_parties_functions_and_types():
    program = mp.compile(scaled_sum, at(0), at(1), world_size=2)
    assert program.ir().splitlines() == [
        "program scaled_sum(world_size=2) {",
        "  %0 = input[0] @{0} : f32[3]",
        "  %1 = input[1] @{1} : f32[3]",
        "  %2 = shuffle[0<-1](%1) @{0} : f32[3]",
        "  %3 = call jax.exec:lambda(%0, %2) @{0} : f32[3]",
        "  return %3",
        "}",
    ]


def test_same_program_always_gives_the_same_bytes():
    first = mp.compile(scaled_sum, at(0), at(1), world_size=2)
    second = mp.compile(scaled_sum, at(0), at(1), world_size=2)
    assert first.to_bytes() == second.to_bytes()
    assert first.digest == second.digest and len(first.digest) == 64


def test_program_bytes_round_trip_to_an_equal_graph():
    program = mp.compile(scaled_sum, at(0), at(1), world_size=2)
    decoded = mp.Program.from_bytes(program.to_bytes())
    assert decoded.graph == program.graph
    assert decoded.digest == program.digest
    assert decoded.input_types == [(F32x3, {0}), (F32x3, {1})]
    assert decoded.output_types == [(F32x3, {0})]


def test_canonical_bytes_decode_to_a_graph_that_keeps_them_and_others_are_written_again(
    monkeypatch: pytest.MonkeyPatch,
):
    program = mp.compile(scaled_sum, at(0), at(1), world_size=2)
    data = program.to_bytes()
    writes: list[Graph] = []
    write = graph_module._to_proto
    monkeypatch.setattr(graph_module, "_to_proto", lambda g: writes.append(g) or write(g))
    to_proto = serde.pfunction_to_proto
    monkeypatch.setattr(serde, "pfunction_to_proto", lambda f: writes.append(f) or to_proto(f))
    kept = Graph.from_bytes(data, canonical=True)
    assert kept == program.graph and kept.to_bytes() == data
    assert kept.digest == program.digest and writes == []  # not written again
    assert [f.digest for f in kept.functions] == [f.digest for f in program.graph.functions]
    assert writes == []  # nor any of its functions
    decoded = Graph.from_bytes(data)  # as a party server decodes: written again, checked
    assert decoded.digest == program.digest and decoded in writes


def test_static_arguments_are_baked_into_the_program():
    two = mp.compile(scaled_sum, at(0), at(1), world_size=2)
    three = mp.compile(lambda x, y: scaled_sum(x, y, scale=3.0), at(0), at(1), world_size=2)
    assert two.digest != three.digest


def test_multi_output_ops_print_indexed_results():
    @mp.function
    def split(x):
        return mp.run_jax(lambda a: (a.min(), a.max()), x)

    text = mp.compile(split, at(0), world_size=1).ir()
    assert "%1#0, %1#1 = call jax.exec:lambda(%0) @{0} : f32[], f32[]" in text
    assert "return %1#0, %1#1" in text


def test_a_function_called_inside_another_is_inlined():
    @mp.function
    def outer(x, y):
        return scaled_sum(x, y, scale=1.0), mp.prank()

    text = mp.compile(outer, at(0), at(1), world_size=2).ir()
    assert "shuffle[0<-1]" in text and "call mpplug.rank:rank() @{0,1} : i32[]" in text


def test_tracing_runs_no_jax_computation():
    calls = []

    def record(a):
        calls.append(type(a).__name__)
        return a + 1

    mp.compile(mp.function(lambda x: mp.run_jax(record, x)), at(0), world_size=1)
    assert len(calls) == 1 and "Tracer" in calls[0]


def test_constants_prank_and_prand_place_where_asked():
    @mp.function
    def prog():
        c = mp.constant(np.arange(3, dtype=np.int16), parties=[1])
        return c, mp.prank(), mp.prand((2, 2), parties=[0, 2])

    text = mp.compile(prog, world_size=3).ir()
    assert "call mpplug.constant:constant() @{1} : i16[3]" in text
    assert "call mpplug.rank:rank() @{0,1,2} : i32[]" in text
    assert "call mpplug.random:random() @{0,2} : u32[2,2]" in text


def test_host_arrays_passed_to_run_jax_become_constants_at_the_target():
    @mp.function
    def prog(x):
        return mp.run_jax(lambda a, w: a @ w, x, np.eye(3, dtype=np.float32))

    text = mp.compile(prog, at(0), world_size=2).ir()
    assert "call mpplug.constant:constant() @{0} : f32[3,3]" in text


def test_parties_can_be_named_when_the_cluster_is_known():
    @mp.function
    def prog(x):
        return mp.p2p("bob", "alice", x)

    program = mp.compile(prog, at(1), world_size=2, party_names=["alice", "bob"])
    assert "shuffle[0<-1](%0) @{0}" in program.ir()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (lambda x: mp.run_jax(lambda: 1.0), r"no party-value argument tells where to run"),
        (lambda x: mp.run_jax_at(1, jnp.sin, x), r"held by \{0\}, not by \{1\}.*mp.p2p"),
        (lambda x: mp.run_jax_at(5, jnp.sin, x), r"party 5 outside 0..1"),
        (
            lambda x: mp.p2p(1, 0, x),
            r"mp.p2p\(1, 0, x\): party 1 does not hold the value \(held by \{0\}\)",
        ),
        (lambda x: mp.p2p("carol", 0, x), r"unknown party name 'carol'"),
        (
            lambda x: mp.converge(x, x),
            r"mp.converge: value 1 is held by \{0\}, overlapping another value at \{0\}",
        ),
        (
            lambda x: mp.converge(x, mp.p2p(0, 1, mp.run_jax(jnp.sum, x))),
            r"mp.converge: the values must share one type",
        ),
        (lambda x: mp.prand((-1,)), r"mp.prand\(shape=\(-1,\), .*non-negative"),
        (lambda x: bool(x) and x, r"no truth value while tracing"),
        (lambda x: {"t": mp.TensorType("f32", ())}, r"returned a type .* at output\['t'\]"),
    ],
)
def test_trace_errors_name_the_op_parties_and_types(body, message):
    with pytest.raises(TraceError, match=message):
        mp.compile(mp.function(body), at(0), world_size=2)


def test_primitives_outside_a_program_are_trace_errors():
    with pytest.raises(TraceError, match=r"mp.prank can only be used inside an @mp.function"):
        mp.prank()
    with pytest.raises(TraceError, match=r"function 'scaled_sum'"):
        scaled_sum(at(0), at(1))


def test_values_of_another_program_are_refused():
    leaked = []
    mp.compile(mp.function(lambda x: leaked.append(x) or x), at(0), world_size=1)
    with pytest.raises(TraceError, match="belongs to another program"):
        mp.compile(mp.function(lambda x: mp.run_jax(jnp.add, x, leaked[0])), at(0), world_size=1)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xff\xff", r"do not decode as a Graph"),
        (b"", r"expected graph version 1\.\.3, got 0$"),
    ],
)
def test_garbage_program_bytes_are_rejected(data, message):
    with pytest.raises(InvalidProgramError, match=message):
        mp.Program.from_bytes(data)


def test_malformed_graphs_are_rejected_with_the_op_named():
    from mpplug.protos import values_pb2 as pb

    program = mp.compile(scaled_sum, at(0), at(1), world_size=2)
    msg = pb.Graph.FromString(program.to_bytes())
    msg.ops[3].inputs[1].op = 7  # a reference forward in the graph
    with pytest.raises(InvalidProgramError, match=r"op %3 input 1: refers to op 7"):
        Graph.from_bytes(msg.SerializeToString())
    msg = pb.Graph.FromString(program.to_bytes())
    msg.ops[3].parties[:] = [1]  # call at a party that does not hold its inputs
    with pytest.raises(InvalidProgramError, match=r"op %3: input 0 is held by \{0\}"):
        Graph.from_bytes(msg.SerializeToString())
    msg = pb.Graph.FromString(program.to_bytes())
    msg.ops[2].parties[:] = [9]
    with pytest.raises(InvalidProgramError, match=r"within 0..1, got \[9\]"):
        Graph.from_bytes(msg.SerializeToString())


def test_static_arguments_equal_across_types_get_their_own_programs():
    @mp.function
    def scaled(x, k):
        return mp.run_jax(lambda a, s: a * s, x, k)

    with mp.Simulator(1) as sim:
        x = sim.put(0, np.float32(3.0))
        two, two_f, true, zero, minus_zero = (
            sim.evaluate(scaled, x, k) for k in (2, 2.0, True, 0.0, -0.0)
        )
        assert two.type == two_f.type == mp.TensorType("f32", ())
        assert float(sim.fetch(two, party=0)) == float(sim.fetch(two_f, party=0)) == 6.0
        assert float(sim.fetch(true, party=0)) == 3.0
        assert np.signbit(sim.fetch(minus_zero, party=0))
        assert not np.signbit(sim.fetch(zero, party=0))
        assert sim.compile(scaled, x, 2).digest != sim.compile(scaled, x, True).digest


def test_static_key_refuses_values_that_cannot_be_keyed_safely():
    from mpplug.frontend.tracer import static_key

    class Mutable:
        pass

    assert static_key(1) != static_key(1.0) != static_key(True)
    assert static_key(0.0) != static_key(-0.0)
    assert static_key(Mutable()) is None
    assert static_key([1]) is None
    assert static_key(np.sin) is not None and static_key("a") == (str, "a")
