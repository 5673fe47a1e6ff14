"""A driver and a party of different wire versions refuse each other when the session opens,
with a message naming both versions, before either reads any other message of the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

import mpplug as mp
from mpplug.config import ClusterSpec
from mpplug.errors import WireVersionError
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote import driver as driver_module
from mpplug.remote.driver import Driver
from mpplug.remote.launch import LocalParties
from mpplug.remote.rpc import WIRE_VERSION

from .clusters import POOL


@pytest.fixture
def parties() -> LocalParties:
    return POOL.get(2)


@mp.function
def add_one(x: mp.MPObject) -> mp.MPObject:
    return mp.run_jax(lambda a: a + 1, x)


@pytest.mark.parametrize(
    ("sent", "named"),
    [
        (0, "no wire version (a release from before wire versions)"),
        (WIRE_VERSION + 1, f"wire version {WIRE_VERSION + 1}"),
    ],
)
def test_a_party_refuses_a_driver_of_another_wire_version(parties, sent, named):
    with grpc.insecure_channel(parties.spec.parties[1].endpoint) as channel:
        request = pb.OpenSessionRequest(session="s1", parties=["P0", "P1"], wire_version=sent)
        with pytest.raises(grpc.RpcError) as info:
            rpc_pb.PartyServiceStub(channel).OpenSession(request, timeout=5.0)
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == (
        f"party P1 speaks mpplug wire version {WIRE_VERSION}, but the driver speaks {named}; "
        f"run one mpplug release on the driver and every party"
    )


def test_a_driver_of_another_wire_version_gets_a_typed_error_and_a_current_one_works(
    parties, monkeypatch
):
    monkeypatch.setattr(driver_module, "WIRE_VERSION", WIRE_VERSION + 1)
    with pytest.raises(WireVersionError) as info:
        Driver(parties.config, timeout=5.0)
    assert f"speaks mpplug wire version {WIRE_VERSION}, but the driver speaks wire version " in (
        str(info.value)
    )
    monkeypatch.undo()
    with Driver(parties.config, timeout=5.0) as driver:
        out = driver.evaluate(add_one, driver.put(0, np.float32(1.0)))
        assert float(driver.fetch(out, party=0)) == 2.0


class _PartyOfAnotherRelease(rpc_pb.PartyServiceServicer):
    """A party that opens every session and answers with its own wire version."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.calls: list[str] = []

    def OpenSession(self, request, context):
        self.calls.append("OpenSession")
        return pb.OpenSessionReply(party="P0", rank=0, idle_timeout=60.0, wire_version=self.version)

    def CloseSession(self, request, context):
        self.calls.append("CloseSession")
        return pb.CloseSessionReply()


@pytest.fixture
def other_release() -> Iterator[tuple[ClusterSpec, list[_PartyOfAnotherRelease]]]:
    """A 1-party cluster whose party is an older (or newer) release that checks nothing."""
    spec = ClusterSpec.local(1)
    servicer = _PartyOfAnotherRelease(0)
    server = grpc.server(ThreadPoolExecutor(4))
    rpc_pb.add_PartyServiceServicer_to_server(servicer, server)
    server.add_insecure_port(spec.parties[0].listen)
    server.start()
    try:
        yield spec, [servicer]
    finally:
        server.stop(0).wait()


@pytest.mark.parametrize(
    ("version", "named"),
    [(0, "no wire version (a release from before wire versions)"), (WIRE_VERSION + 7, None)],
)
def test_a_driver_refuses_a_party_of_another_wire_version(other_release, version, named):
    spec, (party,) = other_release
    party.version = version
    with pytest.raises(WireVersionError) as info:
        Driver(spec, timeout=5.0)
    assert str(info.value) == (
        f"this driver speaks mpplug wire version {WIRE_VERSION}, but party P0 speaks "
        f"{named or f'wire version {version}'}; run one mpplug release on the driver and "
        f"every party"
    )
    assert party.calls == ["OpenSession", "CloseSession"]  # nothing else was sent to it
