"""The party-to-party data plane under abuse and failure: mailboxes that cannot be flooded,
aborts that cut sends to a dead peer short, and executions that other sessions cannot touch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from mpplug_testkernels import sleep_pfunction

import mpplug as mp
from mpplug.config import ClusterSpec, ServerLimits
from mpplug.core import DType, TensorType
from mpplug.core.serde import tensor_type_to_proto
from mpplug.errors import ExecutionAborted
from mpplug.frontend.tracer import trace
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.driver import Driver
from mpplug.remote.rpc import check_id
from mpplug.runtime.communicator import MAX_REASON_CHARS, Key, Mailbox, MailboxFull

from .clusters import in_process, lone_p0

F32_3 = tensor_type_to_proto(TensorType(DType.FLOAT32, (3,)))


@mp.function
def hand_over() -> mp.MPObject:
    return mp.p2p(0, 1, mp.prank())


@mp.function
def late_hand_over(x: mp.MPObject) -> mp.MPObject:
    """Party 0 sleeps a second and a half, then sends x to party 1, which waits for it."""
    (late,) = mp.run_pfunc(sleep_pfunction(1.5), x)
    return mp.p2p(0, 1, late)


@mp.function
def crowded(x: mp.MPObject, y: mp.MPObject) -> mp.MPObject:
    """Party 1 naps a second before it takes the two values party 0 sends it meanwhile."""
    (late,) = mp.run_pfunc(sleep_pfunction(1.0), y)
    a = mp.p2p(0, 1, x)
    b = mp.p2p(0, 1, mp.run_jax_at(0, lambda v: v * 2, x))
    return mp.run_jax_at(1, lambda s, u, v: s + u + v, late, a, b)


# -- the mailbox ----------------------------------------------------------------------------
def test_values_for_a_finished_execution_are_dropped_then_and_later():
    mailbox = Mailbox(0)
    mailbox.start("s:e1")
    mailbox.deliver(Key("s:e1", 1, 1, 0), "never received", 8)
    mailbox.finish("s:e1")
    mailbox.deliver(Key("s:e1", 2, 1, 0), "too late", 8)
    assert mailbox.pending() == 0 and mailbox.pending_bytes(1) == 0


def test_values_for_an_execution_that_never_starts_expire():
    mailbox = Mailbox(0, unclaimed_ttl=1.0)
    mailbox.deliver(Key("s:orphan", 1, 1, 0), "a", 8)
    mailbox.deliver(Key("s:running", 1, 1, 0), "b", 8)
    mailbox.start("s:running")
    assert mailbox.expire() == 0  # too young
    time.sleep(1.2)
    assert mailbox.expire() == 1
    assert mailbox.pending() == 1 and mailbox.pending_bytes(1) == 8
    assert mailbox.take(Key("s:running", 1, 1, 0), timeout=1.0) == "b"


def test_each_source_may_have_only_so_many_bytes_waiting():
    mailbox = Mailbox(0, max_pending_bytes=100)
    mailbox.deliver(Key("s:e", 1, 1, 0), "a", 60)
    full = r"party 1 already has 60 bytes waiting here or on their way, the limit is 100"
    with pytest.raises(MailboxFull, match=full):
        mailbox.deliver(Key("s:e", 2, 1, 0), "b", 60)
    mailbox.deliver(Key("s:e", 2, 2, 0), "c", 60)  # another source has its own room
    assert mailbox.take(Key("s:e", 1, 1, 0), timeout=1.0) == "a"
    mailbox.deliver(Key("s:e", 2, 1, 0), "b", 60)
    assert mailbox.pending_bytes(1) == 60
    mailbox.deliver(Key("s:e", 3, 3, 0), "huge", 1000)  # one value of any size, if none wait
    with pytest.raises(MailboxFull):
        mailbox.reserve(3, 1, "value x")


def test_values_on_their_way_count_against_their_source_until_delivered_or_released():
    mailbox = Mailbox(0, max_pending_bytes=100)
    mailbox.reserve(1, 60, "value a")
    with pytest.raises(MailboxFull, match=r"value b \(60 bytes\) refused: party 1 already has 60"):
        mailbox.reserve(1, 60, "value b")  # two at once may not pass the limit together
    mailbox.deliver(Key("s:e", 1, 1, 0), "a", 60, reserved=True)
    assert mailbox.pending_bytes(1) == 60
    assert mailbox.take(Key("s:e", 1, 1, 0), timeout=1.0) == "a"
    mailbox.reserve(1, 60, "value c")
    mailbox.release(1, 60)  # its bytes never came
    mailbox.finish("s:done")
    mailbox.reserve(1, 60, "value d")
    mailbox.deliver(Key("s:done", 1, 1, 0), "d", 60, reserved=True)  # dropped, and uncounted
    assert mailbox.pending_bytes(1) == 0 and mailbox.pending() == 0


def test_an_abort_reason_is_cut_short():
    mailbox = Mailbox(0)
    mailbox.abort("s:e", "x" * 100_000)
    with pytest.raises(ExecutionAborted) as info:
        mailbox.take(Key("s:e", 1, 1, 0), timeout=1.0)
    assert str(info.value) == f"party 0: execution s:e aborted ({'x' * MAX_REASON_CHARS})"


def test_ids_with_a_trailing_newline_are_refused():
    assert check_id("e1", "exec_id") == "e1"
    with pytest.raises(ValueError, match=r"exec_id: expected 1-64 letters.*got 'e1\\n'"):
        check_id("e1\n", "exec_id")


# -- a party's peer service -----------------------------------------------------------------
def _send(stub: rpc_pb.PeerServiceStub, exec_id: str, op: int) -> None:
    header = pb.PeerHeader(exec_id=exec_id, op=op, src=1, dst=0, type=F32_3)
    stub.SendSmall(pb.PeerChunk(header=header, data=b"\0" * 12), timeout=5.0)


def test_a_peer_flooding_a_party_is_refused_until_its_values_expire():
    spec = ClusterSpec.local(2)  # only P0 runs; the test sends as P1
    limits = ServerLimits(pending_bytes_per_peer=16, unclaimed_value_s=1.0)
    with (
        in_process(spec, ["P0"], limits=limits),
        grpc.insecure_channel(spec.parties[0].endpoint) as channel,
    ):
        peer = rpc_pb.PeerServiceStub(channel)
        _send(peer, "s1:never-runs", 1)
        with pytest.raises(grpc.RpcError) as info:
            _send(peer, "s1:never-runs", 2)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "party 1 has 12 bytes waiting here already" in info.value.details()
        deadline = time.monotonic() + 10.0
        while True:  # once the values of an execution that never started are dropped
            try:
                _send(peer, "s1:never-runs-either", 1)
                break
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the waiting values never expired"
                time.sleep(0.1)


def test_a_send_refused_by_a_full_mailbox_is_retried_until_the_receiver_takes_its_values():
    spec = ClusterSpec.local(2)
    limits = ServerLimits(pending_bytes_per_peer=16)  # room for one f32[3] from each peer
    with in_process(spec, limits=limits), Driver(spec, timeout=10.0) as driver:
        x = driver.put(0, np.ones(3, dtype=np.float32))
        y = driver.put(1, np.float32(10.0))
        out = driver.evaluate(crowded, x, y)
        np.testing.assert_array_equal(driver.fetch(out, party=1), np.full(3, 13.0))


# -- aborts ---------------------------------------------------------------------------------
@pytest.fixture
def p0_of_two() -> Iterator[tuple[ClusterSpec, rpc_pb.PartyServiceStub]]:
    """P0 of a two-party cluster whose P1 never starts, with a session "s1" open."""
    spec = ClusterSpec.local(2)
    with lone_p0(spec, timeout=60.0) as stub:
        yield spec, stub


def test_an_abort_cuts_short_a_send_to_a_dead_peer(p0_of_two):
    spec, stub = p0_of_two
    program, _ = trace(hand_over, (), world_size=2, party_names=spec.names, platforms=["cpu"])
    data = program.to_bytes()
    header = pb.ProgramHeader(session="s1", digest=program.digest, size=len(data))
    stub.LoadProgram(iter([pb.ProgramChunk(header=header, data=data)]), timeout=5.0)
    execute = pb.ExecuteRequest(
        session="s1", exec_id="e1", digest=program.digest, outputs=["y"], timeout=60.0
    )
    running = stub.Execute.future(execute, timeout=60.0)
    time.sleep(1.0)  # P0 is sending to P1, which is not there: the send waits for it
    assert not running.done()
    start = time.monotonic()
    stub.Abort(pb.AbortRequest(session="s1", exec_id="e1", reason="P1 is gone"), timeout=5.0)
    reply = running.result(timeout=10.0)
    assert time.monotonic() - start < 5.0
    assert reply.WhichOneof("outcome") == "aborted"
    assert "execution s1:e1 aborted while sending s1:e1/" in reply.aborted.message


def test_another_session_cannot_abort_an_execution_of_the_same_id():
    spec = ClusterSpec.local(2)
    with in_process(spec), Driver(spec, timeout=10.0) as owner, Driver(spec, timeout=10.0) as other:
        started: list[str] = []
        send_execute = owner._send_execute

        def spying(attempt) -> None:
            started.append(attempt.request.exec_id)
            send_execute(attempt)

        owner._send_execute = spying
        x = owner.put(0, np.float32(7.0))
        outcome: list[object] = []
        running = threading.Thread(
            target=lambda: outcome.append(owner.evaluate(late_hand_over, x)), daemon=True
        )
        running.start()
        deadline = time.monotonic() + 10.0
        while not started:
            assert time.monotonic() < deadline, "the execution never started"
            time.sleep(0.02)
        time.sleep(0.3)
        for stub in other._stubs:  # the same execution id, but in the other session
            stub.Abort(
                pb.AbortRequest(session=other.session, exec_id=started[0], reason="not yours"),
                timeout=5.0,
            )
        running.join(timeout=20.0)
        assert len(outcome) == 1, "the execution failed or hung"
        assert float(owner.fetch(outcome[0], party=1)) == 7.0
