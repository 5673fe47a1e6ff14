"""A party under callers that hold on: idle streams and long executions take their own slots,
the rest is refused RESOURCE_EXHAUSTED at once, health, Status and Execute keep answering, and
streams that stall are cancelled.

Party servers run in this process (tests/clusters.in_process) so each test sets its limits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mpplug_testkernels import sleep_pfunction

import mpplug as mp
from mpplug.config import ClusterSpec, ServerLimits
from mpplug.errors import ConfigError, MPPlugError
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.driver import Driver
from mpplug.remote.streaming import CHUNK_BYTES

from .clusters import in_process

IDLE_S = 3.0


@mp.function
def add_one(x: mp.MPObject) -> mp.MPObject:
    return mp.run_jax(lambda a: a + 1, x)


@mp.function
def nap(x: mp.MPObject) -> mp.MPObject:
    (out,) = mp.run_pfunc(sleep_pfunction(2.0), x)
    return out


def silent(release: threading.Event) -> Iterator[bytes]:
    """A request stream that sends nothing until `release` is set."""
    release.wait()
    yield from ()


def serving(channel: grpc.Channel) -> bool:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5.0)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown: lets the client threads feeding silent streams finish."""
    event = threading.Event()
    yield event
    event.set()


def test_idle_streams_do_not_stop_a_party_answering_health_status_and_execute(release):
    spec = ClusterSpec.local(1)
    limits = ServerLimits(stream_idle_s=IDLE_S)
    with (
        in_process(spec, limits=limits),
        Driver(spec, timeout=10.0) as driver,
        grpc.insecure_channel(spec.parties[0].endpoint) as channel,
    ):
        x = driver.put(0, np.float32(1.0))
        driver.evaluate(add_one, x)  # the program is shipped before the streams crowd in
        methods = {
            "Put": channel.stream_unary("/mpplug.PartyService/Put"),
            "LoadProgram": channel.stream_unary("/mpplug.PartyService/LoadProgram"),
            "Send": channel.stream_unary("/mpplug.PeerService/Send"),
        }
        calls = {
            name: [method.future(silent(release), timeout=60.0) for _ in range(40)]
            for name, method in methods.items()
        }  # 120 streams that never send, twice the server's 64 threads
        held = limits.uploads + limits.peer_streams  # Put and LoadProgram share the uploads
        deadline = time.monotonic() + 10.0
        while sum(c.done() for cs in calls.values() for c in cs) < 120 - held:
            assert time.monotonic() < deadline, "the streams over the limits were not refused"
            time.sleep(0.05)
        refused = [c for cs in calls.values() for c in cs if c.done()]
        assert {c.code() for c in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert "its limit; try again when one has finished" in refused[0].details()

        start = time.monotonic()
        assert serving(channel)
        status = rpc_pb.PartyServiceStub(channel).Status(pb.StatusRequest(), timeout=5.0)
        assert status.sessions == 1
        y = driver.evaluate(add_one, driver.evaluate(add_one, x))
        assert float(driver.fetch(y, party=0)) == 3.0
        assert time.monotonic() - start < IDLE_S, "answered only once the streams were cut"

        for call in [c for cs in calls.values() for c in cs]:
            with pytest.raises(grpc.RpcError) as info:
                call.result(timeout=IDLE_S + 5.0)
            assert info.value.code() in (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.CANCELLED,
            )
        big = np.arange(CHUNK_BYTES, dtype=np.float32)  # a Put stream of four chunks
        np.testing.assert_array_equal(driver.fetch(driver.put(0, big), party=0), big)


def test_executions_over_the_limit_are_refused_while_peers_and_health_still_answer():
    spec = ClusterSpec.local(1)
    with (
        in_process(spec, limits=ServerLimits(executes=1)),
        Driver(spec, timeout=10.0) as first,
        Driver(spec, timeout=10.0) as second,
        grpc.insecure_channel(spec.parties[0].endpoint) as channel,
    ):
        x = first.put(0, np.float32(1.0))
        y = second.put(0, np.float32(5.0))
        second.evaluate(add_one, y)
        napping = threading.Thread(target=first.evaluate, args=(nap, x))
        napping.start()
        try:
            time.sleep(0.5)
            with pytest.raises(MPPlugError, match=r"RESOURCE_EXHAUSTED: .*1 executions already"):
                second.evaluate(add_one, y)
            assert serving(channel)
        finally:
            napping.join()
        assert float(second.fetch(second.evaluate(add_one, y), party=0)) == 6.0


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"executes": 60, "peer_streams": 20}, "must leave 8 of the 96 workers free"),
        ({"uploads": 0}, "uploads: expected a positive int, got 0"),
        ({"stream_idle_s": float("inf")}, "stream_idle_s: expected seconds > 0"),
        ({"max_rpcs": 10}, "max_rpcs: expected at least workers (96), got 10"),
    ],
)
def test_limits_that_would_let_one_kind_of_call_starve_the_rest_are_refused(limits, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ServerLimits(**limits)
