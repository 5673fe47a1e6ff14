"""Execution streams: a driver sends every execution to a party on one long-lived ExecuteStream,
each request gets one reply naming it (refusals included) in the order executions end, a party
out of streams is served by Execute calls instead, ending a stream aborts its executions, and a
stopping party ends its streams once their executions have replied."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from mpplug_testkernels import sleep_pfunction

import mpplug as mp
from mpplug.config import ClusterSpec, ServerLimits
from mpplug.errors import PartyUnavailableError
from mpplug.frontend.tracer import Program, trace
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.driver import Driver
from mpplug.remote.server import PartyServer
from mpplug.runtime import codec

from .clusters import in_process, lone_p0
from .test_control_flow import _CountingStubs


@mp.function
def add_one(x: mp.MPObject) -> mp.MPObject:
    return mp.run_jax(lambda a: a + 1, x)


@mp.function
def rank_plus_one() -> mp.MPObject:
    return mp.run_jax(lambda r: r + 1, mp.prank())


@mp.function
def nap() -> mp.MPObject:
    (out,) = mp.run_pfunc(sleep_pfunction(2.0), mp.run_jax(lambda r: r * 1.0, mp.prank()))
    return out


@mp.function
def from_p1() -> mp.MPObject:
    """At P0, a receive from P1."""
    return mp.p2p(1, 0, mp.prank())


class Stream:
    """A raw ExecuteStream call: `send` a request, `reply` waits for the next reply."""

    def __init__(self, stub: rpc_pb.PartyServiceStub) -> None:
        self._requests: queue.SimpleQueue[pb.ExecuteRequest | None] = queue.SimpleQueue()
        self.call = stub.ExecuteStream(iter(self._requests.get, None))

    def send(self, **fields: object) -> None:
        self._requests.put(pb.ExecuteRequest(**fields))  # type: ignore[arg-type]

    def reply(self) -> pb.ExecuteReply:
        return next(self.call)

    def close(self) -> None:
        self._requests.put(None)


@pytest.fixture
def p0_of(request: pytest.FixtureRequest) -> Iterator[tuple[ClusterSpec, rpc_pb.PartyServiceStub]]:
    """P0 alone in process (of a cluster of `request.param` parties, two executions at a
    time), with session "s1" open."""
    spec = ClusterSpec.local(request.param)
    with lone_p0(spec, timeout=60.0, limits=ServerLimits(executes=2)) as stub:
        yield spec, stub


def load(stub: rpc_pb.PartyServiceStub, spec: ClusterSpec, fn: object) -> Program:
    program, _ = trace(
        fn, (), world_size=spec.world_size, party_names=spec.names, platforms=["cpu"]
    )
    data = program.to_bytes()
    header = pb.ProgramHeader(session="s1", digest=program.digest, size=len(data))
    stub.LoadProgram(iter([pb.ProgramChunk(header=header, data=data)]), timeout=5.0)
    return program


@pytest.mark.parametrize("p0_of", [1], indirect=True)
def test_each_request_gets_its_reply_and_a_refusal_does_not_end_the_stream(p0_of):
    spec, stub = p0_of
    program = load(stub, spec, rank_plus_one)
    stream = Stream(stub)
    run = {"digest": program.digest, "outputs": ["y"], "timeout": 10.0}
    try:
        stream.send(session="nope", exec_id="e1", **run)
        reply = stream.reply()
        assert reply.exec_id == "e1"
        assert (reply.refused.code, reply.refused.missing) == ("NOT_FOUND", "session")
        assert "nope" in reply.refused.message

        stream.send(session="s1", exec_id="not an id!", **run)
        reply = stream.reply()
        assert (reply.exec_id, reply.refused.code) == ("not an id!", "INVALID_ARGUMENT")
        assert "exec_id: expected 1-64 letters, digits" in reply.refused.message

        stream.send(session="s1", exec_id="e3", **{**run, "digest": "0" * 64})
        reply = stream.reply()
        assert (reply.exec_id, reply.refused.code, reply.refused.missing) == (
            "e3",
            "NOT_FOUND",
            "program",
        )

        stream.send(session="s1", exec_id="e4", inline_max_bytes=64, **run)
        reply = stream.reply()
        assert (reply.exec_id, reply.WhichOneof("outcome")) == ("e4", "completed")
        assert [v.name for v in reply.values] == ["y"]
        assert np.frombuffer(reply.values[0].data, np.int32).tolist() == [1]
    finally:
        stream.close()
    assert list(stream.call) == []  # the party ends the call once the requests end
    assert stream.call.code() is grpc.StatusCode.OK


@pytest.mark.parametrize("p0_of", [1], indirect=True)
def test_executions_on_one_stream_run_at_once_and_reply_as_they_end(p0_of):
    spec, stub = p0_of
    slow, quick = load(stub, spec, nap), load(stub, spec, rank_plus_one)
    stream = Stream(stub)
    try:
        start = time.monotonic()
        stream.send(session="s1", exec_id="slow", digest=slow.digest, outputs=["a"], timeout=9.0)
        stream.send(session="s1", exec_id="quick", digest=quick.digest, outputs=["b"], timeout=9.0)
        first = stream.reply()
        assert first.exec_id == "quick"
        assert first.WhichOneof("outcome") == "completed"
        assert time.monotonic() - start < 1.5  # not behind the two-second nap
        second = stream.reply()
        assert (second.exec_id, second.WhichOneof("outcome")) == ("slow", "completed")
        assert time.monotonic() - start >= 2.0
    finally:
        stream.close()


@pytest.mark.parametrize("p0_of", [2], indirect=True)
def test_ending_a_stream_aborts_the_executions_running_on_it(p0_of):
    spec, stub = p0_of  # P1 never starts: P0's receive from it waits
    waiting, quick = load(stub, spec, from_p1), load(stub, spec, rank_plus_one)
    stream = Stream(stub)
    for i in range(2):  # both execution slots, taken in the order the requests are read
        stream.send(
            session="s1", exec_id=f"w{i}", digest=waiting.digest, outputs=[f"y{i}"], timeout=600.0
        )
    stream.send(session="s1", exec_id="third", digest=quick.digest, outputs=["t"], timeout=5.0)
    reply = stream.reply()
    assert (reply.exec_id, reply.refused.code) == ("third", "RESOURCE_EXHAUSTED")
    request = pb.ExecuteRequest(
        session="s1", exec_id="after", digest=quick.digest, outputs=["z"], timeout=5.0
    )
    stream.call.cancel()
    deadline = time.monotonic() + 5.0
    while True:  # the waiting executions are aborted and give their slots back
        try:
            reply = stub.Execute(request, timeout=5.0)
            break
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "ending the stream did not abort its executions"
            time.sleep(0.05)
    assert reply.WhichOneof("outcome") == "completed"


@pytest.mark.parametrize("p0_of", [1], indirect=True)
def test_a_request_over_the_execution_limit_is_refused_on_the_stream(p0_of):
    spec, stub = p0_of
    slow = load(stub, spec, nap)
    value = np.float32(3.0)
    header = pb.PutHeader(session="s1", name="dropped", type=codec.encode_type(np.asarray(value)))
    stub.PutSmall(pb.PutChunk(header=header, data=value.tobytes()), timeout=5.0)
    stream = Stream(stub)
    try:
        for i in range(3):
            stream.send(
                session="s1",
                exec_id=f"e{i}",
                digest=slow.digest,
                outputs=[f"y{i}"],
                timeout=9.0,
                release=["dropped"] if i == 2 else [],
            )
        refused = stream.reply()
        assert (refused.exec_id, refused.refused.code) == ("e2", "RESOURCE_EXHAUSTED")
        assert "running 2 executions already" in refused.refused.message
        with pytest.raises(grpc.RpcError) as info:  # the refused request's releases still count
            list(stub.Fetch(pb.FetchRequest(session="s1", name="dropped"), timeout=5.0))
        assert info.value.code() is grpc.StatusCode.NOT_FOUND
        assert sorted(stream.reply().exec_id for _ in range(2)) == ["e0", "e1"]
    finally:
        stream.close()


def test_a_driver_sends_every_execution_on_one_stream_per_party():
    spec = ClusterSpec.local(2)
    with in_process(spec), Driver(spec, timeout=10.0) as driver:
        counts = _CountingStubs(driver)
        results = [driver.fetch(driver.evaluate(rank_plus_one)) for _ in range(5)]
        assert all([int(v) for v in values] == [1, 2] for values in results)
        assert counts.calls == {"ExecuteStream": 2, "Execute": 10, "LoadProgramSmall": 2}


def test_a_party_out_of_streams_serves_the_driver_with_execute_calls():
    spec = ClusterSpec.local(1)
    with (
        in_process(spec, limits=ServerLimits(execute_streams=1)),
        Driver(spec, timeout=10.0) as first,
        Driver(spec, timeout=10.0) as second,
    ):
        x = first.put(0, np.float32(1.0))
        assert float(first.fetch(first.evaluate(add_one, x), party=0)) == 2.0  # takes the stream
        y = second.put(0, np.float32(5.0))
        assert float(second.fetch(second.evaluate(add_one, y), party=0)) == 6.0
        assert second._execute_streams[0] is not None
        assert not second._execute_streams[0].open  # refused: RESOURCE_EXHAUSTED
        counts = _CountingStubs(second)
        ones = [float(second.fetch(second.evaluate(add_one, y), party=0)) for _ in range(3)]
        assert ones == [6.0, 6.0, 6.0]
        assert counts.calls == {"Execute": 3}  # calls of their own, no new stream for a while
        assert float(first.fetch(first.evaluate(add_one, x), party=0)) == 2.0


def test_after_a_stream_ends_the_next_execution_opens_a_new_one():
    spec = ClusterSpec.local(1)
    with in_process(spec), Driver(spec, timeout=10.0) as driver:
        x = driver.put(0, np.float32(1.0))
        assert float(driver.fetch(driver.evaluate(add_one, x), party=0)) == 2.0
        threads = threading.active_count()
        for _ in range(5):  # each broken stream's threads end with it
            broken = driver._execute_streams[0]
            assert broken is not None
            broken._call.cancel()
            deadline = time.monotonic() + 5.0
            while broken.open:
                assert time.monotonic() < deadline, "the cancelled stream still reads as open"
                time.sleep(0.01)
            assert float(driver.fetch(driver.evaluate(add_one, x), party=0)) == 2.0
            assert driver._execute_streams[0] is not broken
            assert driver._execute_streams[0].open
        deadline = time.monotonic() + 5.0
        while threading.active_count() > threads:
            assert time.monotonic() < deadline, f"{threading.active_count()} threads, was {threads}"
            time.sleep(0.05)


def test_a_stopping_party_ends_an_idle_stream_at_once_not_after_its_grace():
    spec = ClusterSpec.local(1)
    server = PartyServer(spec, "P0", timeout=10.0)
    server.start()
    try:
        with Driver(spec, timeout=10.0) as driver:
            x = driver.put(0, np.float32(1.0))
            assert float(driver.fetch(driver.evaluate(add_one, x), party=0)) == 2.0
            stream = driver._execute_streams[0]
            assert stream is not None and stream.open
            started = time.monotonic()
            server.stop(grace=30.0)
            while stream.open and time.monotonic() - started < 5.0:  # the driver's reader
                time.sleep(0.01)  # notices the closed stream a moment after stop returns
            assert not stream.open and time.monotonic() - started < 5.0
            with pytest.raises(PartyUnavailableError):
                driver.evaluate(add_one, x)
    finally:
        server.stop(grace=0.0)


def test_an_execution_running_as_its_party_stops_finishes_and_replies():
    spec = ClusterSpec.local(1)
    server = PartyServer(spec, "P0", timeout=10.0)
    server.start()
    stopping = threading.Timer(0.5, server.stop, kwargs={"grace": 30.0})
    try:
        with Driver(spec, timeout=10.0) as driver:
            driver.evaluate(rank_plus_one)  # the stream is open
            started = time.monotonic()
            stopping.start()
            assert float(driver.fetch(driver.evaluate(nap), party=0)) == 0.0  # a 2 s kernel
            stopping.join()
            assert time.monotonic() - started < 10.0
    finally:
        stopping.cancel()
        server.stop(grace=0.0)


def test_an_idle_party_gives_its_kept_memory_back_and_a_busy_one_does_not():
    spec = ClusterSpec.local(1)
    trims: list[float] = []
    server = PartyServer(spec, "P0", timeout=10.0)
    server.trim_when_idle(lambda: trims.append(time.monotonic()))
    server.start()
    try:
        deadline = time.monotonic() + 5.0
        while not trims:  # idle from the start: trimmed within two upkeep rounds
            assert time.monotonic() < deadline, "an idle party never gave memory back"
            time.sleep(0.05)
        with Driver(spec, timeout=10.0) as driver:
            driver.evaluate(rank_plus_one)
            started = time.monotonic()
            driver.fetch(driver.evaluate(nap), party=0)  # 2 s, running all along
            ended = time.monotonic()
        assert not [t for t in trims if started + 1.1 < t < ended], trims
    finally:
        server.stop(grace=0.0)
