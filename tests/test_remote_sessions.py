"""Sessions on a lease and handles released in batches: a session no call names is closed with
its values, a live driver keeps its own open, a dropped one closes it, and dropped handles
reach parties the driver is not otherwise calling.

Party servers run in this process (tests/clusters.in_process) so each test sets its limits.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

import mpplug as mp
from mpplug.config import ClusterSpec, ServerLimits
from mpplug.core import DType, TensorType
from mpplug.core.serde import tensor_type_to_proto
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote import driver as driver_module
from mpplug.remote.driver import Driver
from mpplug.remote.rpc import MISSING_KEY, WIRE_VERSION

from .clusters import in_process

F32 = tensor_type_to_proto(TensorType(DType.FLOAT32, ()))
PARTIES = ["P0", "P1"]


@mp.function
def add_one(x: mp.MPObject) -> mp.MPObject:
    return mp.run_jax(lambda a: a + 1, x)


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `condition()` held; AssertionError after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not true after {timeout:g}s")
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture
def spec() -> ClusterSpec:
    return ClusterSpec.local(PARTIES)


@pytest.fixture
def stubs(spec: ClusterSpec) -> Iterator[list[rpc_pb.PartyServiceStub]]:
    channels = [grpc.insecure_channel(p.endpoint) for p in spec.parties]
    yield [rpc_pb.PartyServiceStub(channel) for channel in channels]
    for channel in channels:
        channel.close()


def sessions(stub: rpc_pb.PartyServiceStub) -> int:
    return int(stub.Status(pb.StatusRequest(), timeout=5.0).sessions)


def put(stub: rpc_pb.PartyServiceStub, session: str, name: str) -> None:
    header = pb.PutHeader(session=session, name=name, type=F32)
    stub.PutSmall(pb.PutChunk(header=header, data=np.float32(1).tobytes()), timeout=5.0)


def fetch_error(stub: rpc_pb.PartyServiceStub, session: str, name: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Fetch(pb.FetchRequest(session=session, name=name), timeout=5.0))
    return info.value


def test_a_session_no_call_names_is_closed_with_its_values_and_calls_renew_it(spec, stubs):
    with in_process(spec, ["P0"], session_idle_timeout=2.0):
        stub = stubs[0]
        opened = stub.OpenSession(
            pb.OpenSessionRequest(session="idle", parties=PARTIES, wire_version=WIRE_VERSION)
        )
        assert opened.idle_timeout == 2.0
        stub.OpenSession(
            pb.OpenSessionRequest(session="busy", parties=PARTIES, wire_version=WIRE_VERSION)
        )
        put(stub, "idle", "x")
        put(stub, "busy", "x")
        assert sessions(stub) == 2
        start = time.monotonic()
        # "busy" is renewed every 0.2 s, "idle" is not: wait (generously, the machine may be
        # loaded) until the idle one is gone, and check it did not go before its lease.
        while sessions(stub) == 2 and time.monotonic() - start < 15.0:
            stub.KeepAlive(pb.KeepAliveRequest(session="busy"), timeout=5.0)
            time.sleep(0.2)
        assert time.monotonic() - start >= 2.0
        assert sessions(stub) == 1
        gone = fetch_error(stub, "idle", "x")
        assert gone.code() is grpc.StatusCode.NOT_FOUND
        assert (MISSING_KEY, "session") in gone.trailing_metadata()
        assert list(stub.Fetch(pb.FetchRequest(session="busy", name="x"), timeout=5.0))


@pytest.mark.slow
def test_a_driver_keeps_its_session_open_while_it_is_idle(spec):
    with in_process(spec, session_idle_timeout=2.0), Driver(spec, timeout=10.0) as driver:
        assert driver.keepalive_interval == pytest.approx(2.0 / 3)
        x = driver.put(1, np.float32(41.0))
        time.sleep(4.5)  # over twice the lease, with no call of the caller's
        assert float(driver.fetch(driver.evaluate(add_one, x), party=1)) == 42.0


def test_a_driver_dropped_without_close_closes_its_sessions(spec, stubs):
    with in_process(spec):
        driver = Driver(spec, timeout=10.0)
        driver.put(0, np.float32(1.0))
        assert [sessions(stub) for stub in stubs] == [1, 1]
        del driver
        gc.collect()
        assert [sessions(stub) for stub in stubs] == [0, 0]


def test_sessions_over_the_limit_are_resource_exhausted(spec, stubs):
    limits = ServerLimits(sessions=2)
    with in_process(spec, ["P0"], limits=limits, session_idle_timeout=60.0):
        for session in ("s1", "s2"):
            stubs[0].OpenSession(
                pb.OpenSessionRequest(session=session, parties=PARTIES, wire_version=WIRE_VERSION)
            )
        with pytest.raises(grpc.RpcError) as info:
            stubs[0].OpenSession(
                pb.OpenSessionRequest(session="s3", parties=PARTIES, wire_version=WIRE_VERSION)
            )
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "has 2 sessions open, its limit" in info.value.details()
        assert "idle ones close after 60s" in info.value.details()


def test_dropped_handles_reach_a_party_the_driver_is_not_calling(spec, stubs, monkeypatch):
    monkeypatch.setattr(driver_module, "RELEASE_MAX_NAMES", 100)
    with in_process(spec), Driver(spec, timeout=10.0) as driver:
        sent: list[list[str]] = []
        release = driver._stubs[1].Release

        class Recording:
            def future(self, request: pb.ReleaseRequest, **kwargs: object) -> grpc.Future:
                sent.append(list(request.names))
                return release.future(request, **kwargs)

        driver._stubs[1].Release = Recording()
        handles = [driver.put(1, np.float32(i)) for i in range(driver_module.RELEASE_FLUSH)]
        names = [h.name for h in handles]
        x = driver.put(0, np.float32(0.0))
        del handles
        gc.collect()
        driver.evaluate(add_one, x)  # runs on party 0 only; party 1 gets a Release of its own
        assert [len(batch) for batch in sent] == [100, 100, 56]
        assert sorted(name for batch in sent for name in batch) == sorted(names)

        def released() -> bool:
            return fetch_error(stubs[1], driver.session, names[-1]).code() is (
                grpc.StatusCode.NOT_FOUND
            )

        wait_until(released, 5.0, "the last dropped value released at party 1")
        assert fetch_error(stubs[1], driver.session, names[0]).code() is (grpc.StatusCode.NOT_FOUND)


def test_a_few_dropped_handles_ride_along_with_the_next_call_to_their_party(spec, stubs):
    with in_process(spec), Driver(spec, timeout=10.0) as driver:
        kept = driver.put(0, np.float32(1.0))
        dropped = [driver.put(0, np.float32(i)) for i in range(10)]
        names = [h.name for h in dropped]
        del dropped
        gc.collect()
        driver.fetch(kept, party=0)  # under RELEASE_FLUSH: no Release, they go with this Fetch
        for name in names:
            assert fetch_error(stubs[0], driver.session, name).code() is (grpc.StatusCode.NOT_FOUND)
