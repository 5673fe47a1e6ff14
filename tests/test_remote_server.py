"""A party server under bad requests, health probes and two drivers at once.

Requests go straight to a party's RPCs: garbage, truncated, unknown sessions, wrong types.
Each gets INVALID_ARGUMENT or NOT_FOUND with a message saying what is wrong, and the party
keeps serving.
"""

from __future__ import annotations

import gc
import hashlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import mpplug as mp
from mpplug.config import ClusterSpec, free_port
from mpplug.core import DType, TensorType
from mpplug.core.memory import numpy_huge_pages
from mpplug.core.serde import tensor_type_to_proto
from mpplug.errors import ConfigError, MPPlugError
from mpplug.kernels import jax_exec
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.protos import values_pb2
from mpplug.remote.driver import Driver
from mpplug.remote.launch import LocalParties
from mpplug.remote.rpc import MISSING_KEY, WIRE_VERSION
from mpplug.remote.server import NUMPY_HUGEPAGE_ENV, PartyServer, plain_pages_for_numpy
from mpplug.remote.status import query_status
from mpplug.remote.streaming import CHUNK_BYTES, MAX_MESSAGE_BYTES

from .clusters import POOL

SERVICES = [pb.DESCRIPTOR.services_by_name[s] for s in ("PartyService", "PeerService")]
F32_3 = tensor_type_to_proto(TensorType(DType.FLOAT32, (3,)))


@mp.function
def add_one(x: mp.MPObject) -> mp.MPObject:
    return mp.run_jax(lambda a: a + 1, x)


@pytest.fixture
def parties() -> Iterator[LocalParties]:
    """A pooled 2-party cluster; afterwards it must still be up and running programs."""
    parties = POOL.get(2)
    yield parties
    assert parties.alive(), parties.logs()
    with Driver(parties.config, timeout=10.0) as driver:
        out = driver.evaluate(add_one, driver.put(0, np.float32(1.0)))
        assert float(driver.fetch(out, party=0)) == 2.0


@pytest.fixture
def channel(parties: LocalParties) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(parties.spec.parties[0].endpoint) as channel:
        yield channel


@pytest.fixture
def stub(channel: grpc.Channel) -> rpc_pb.PartyServiceStub:
    return rpc_pb.PartyServiceStub(channel)


@pytest.fixture
def driver(parties: LocalParties) -> Iterator[Driver]:
    with Driver(parties.config, timeout=10.0) as driver:
        yield driver


def _raw_call(channel: grpc.Channel, service: str, method: str, payload: bytes) -> None:
    """Call `method` with `payload` as the raw request bytes, reading the whole reply."""
    descriptor = pb.DESCRIPTOR.services_by_name[service].methods_by_name[method]
    path = f"/{descriptor.containing_service.full_name}/{method}"
    if descriptor.client_streaming:
        call = channel.stream_unary(path)
        call(iter([payload]), timeout=5.0)
    elif descriptor.server_streaming:
        list(channel.unary_stream(path)(payload, timeout=5.0))
    else:
        channel.unary_unary(path)(payload, timeout=5.0)


def _error(fn: object, *args: object, **kwargs: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)  # type: ignore[operator]
    return info.value


def _put(session: str, name: str, ttype: values_pb2.TensorType, *data: bytes) -> list[pb.PutChunk]:
    first = pb.PutChunk(header=pb.PutHeader(session=session, name=name, type=ttype))
    if data:
        first.data = data[0]
    return [first, *(pb.PutChunk(data=d) for d in data[1:])]


# -- health and status --------------------------------------------------------------------
def test_health_service_reports_serving_for_the_server_and_each_service(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ["", *(s.full_name for s in SERVICES)]:
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5.0)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    unknown = _error(health.Check, health_pb2.HealthCheckRequest(service="nope"), timeout=5.0)
    assert unknown.code() is grpc.StatusCode.NOT_FOUND


def test_health_list_names_every_service_serving(channel):
    reply = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=5.0)
    expected = {"", *(s.full_name for s in SERVICES)}
    assert set(reply.statuses) >= expected
    assert all(
        reply.statuses[name].status == health_pb2.HealthCheckResponse.SERVING for name in expected
    )


def test_an_error_quoting_a_huge_field_is_cut_so_the_caller_still_gets_it(stub):
    error = _error(stub.KeepAlive, pb.KeepAliveRequest(session="x" * 70_000), timeout=5.0)
    assert error.code() is grpc.StatusCode.NOT_FOUND  # not RESOURCE_EXHAUSTED from metadata
    assert error.details().endswith(" characters)") and len(error.details()) < 1100


@pytest.mark.parametrize("method", ["Check", "List", "Watch"])
def test_undecodable_bytes_to_the_health_service_are_invalid_argument(channel, method):
    path = f"/grpc.health.v1.Health/{method}"
    call = channel.unary_stream(path) if method == "Watch" else channel.unary_unary(path)
    with pytest.raises(grpc.RpcError) as info:
        reply = call(b"\xff\xff\xff\xff\x0f", timeout=5.0)
        if method == "Watch":
            next(iter(reply))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "does not decode as grpc.health.v1." in info.value.details()


def test_status_names_the_party_and_counts_open_sessions(parties, stub):
    reply = stub.Status(pb.StatusRequest(), timeout=5.0)
    assert (reply.party, reply.rank, reply.world_size) == ("P0", 0, 2)
    before = query_status(parties.spec, "P0")
    assert before.serving and before.health == "SERVING"
    with Driver(parties.config, timeout=10.0):
        during = query_status(parties.spec, "P0")
    assert during.sessions == before.sessions + 1
    assert "rank 0 of 2" in during.detail


def test_status_of_a_party_nobody_listens_for_is_unreachable(parties):
    spec = ClusterSpec.local(1)  # a free port that nothing serves
    status = query_status(spec, "P0", timeout=1.0)
    assert status.health == "UNREACHABLE" and status.sessions is None
    assert "UNAVAILABLE" in status.detail


def test_a_party_server_reports_a_taken_port_and_stops_cleanly():
    spec = ClusterSpec.local(1)
    first = PartyServer(spec, "P0", timeout=5.0)
    first.start()
    second = PartyServer(spec, "P0")
    data = spec.to_dict()
    data["parties"][0]["bulk"] = f"127.0.0.1:{free_port()}"
    other_bulk = ClusterSpec.from_dict(data)
    third = PartyServer(other_bulk, "P0")
    try:
        assert first.port == spec.parties[0].port
        with pytest.raises(ConfigError, match=r"party P0: cannot listen for bulk values on"):
            second.start()
        with pytest.raises(ConfigError, match=r"party P0: cannot listen on 127\.0\.0\.1:"):
            third.start()  # its bulk port was bound, and is let go again
        with socket.create_server(other_bulk.parties[0].bulk_listen):  # type: ignore[arg-type]
            pass
        assert query_status(spec, "P0").serving
    finally:
        first.stop(grace=0.5)
    first.wait()
    assert query_status(spec, "P0", timeout=1.0).health == "UNREACHABLE"
    second.start()  # the failed start left nothing behind: the port is free, the server fresh
    try:
        assert query_status(spec, "P0").serving
    finally:
        second.stop(grace=0.0)


def test_a_started_party_has_its_module_check_helper_running_before_any_program():
    jax_exec._CHECKER.close()  # as in a fresh process: no helper yet
    server = PartyServer(ClusterSpec.local(1), "P0", timeout=10.0)
    server.start()
    try:
        helper = jax_exec._CHECKER._process
        assert helper is not None and helper.poll() is None
    finally:
        server.stop(grace=0.0)


def test_the_server_command_explains_a_bad_cluster_file(tmp_path):
    missing = str(tmp_path / "no.yaml")
    done = subprocess.run(
        [sys.executable, "-m", "mpplug.remote.server", "--config", missing, "--party", "P0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "error: cannot read cluster file" in done.stderr


# -- garbage and truncated messages -------------------------------------------------------
@pytest.mark.parametrize(
    ("service", "method"),
    [(s.name, m.name) for s in SERVICES for m in s.methods if m.name != "Status"],
)
def test_undecodable_request_bytes_are_invalid_argument(channel, service, method):
    garbage = _error(_raw_call, channel, service, method, b"\xff\xff\xff\xff\x0f")
    assert garbage.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "does not decode as mpplug." in garbage.details()
    valid = pb.ExecuteRequest(
        session="s" * 40, exec_id="e" * 32, digest="d" * 64
    ).SerializeToString()
    truncated = _error(_raw_call, channel, service, method, valid[:-7])
    assert truncated.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "does not decode" in truncated.details()


def test_a_stream_of_chunks_cut_short_or_overflowing_is_invalid_argument(driver, stub):
    short = _error(stub.Put, iter(_put(driver.session, "x", F32_3, b"\0" * 8)), timeout=5.0)
    assert short.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "ended after 8 of 12 declared bytes" in short.details()
    over = _error(
        stub.Put, iter(_put(driver.session, "x", F32_3, b"\0" * 8, b"\0" * 8)), timeout=5.0
    )
    assert over.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "more than the 12 bytes declared" in over.details()
    headless = _error(stub.Put, iter([pb.PutChunk(data=b"\0" * 12)]), timeout=5.0)
    assert "the first message has no header" in headless.details()
    empty = _error(stub.Put, iter([]), timeout=5.0)
    assert "the stream is empty" in empty.details()
    twice = _put(driver.session, "x", F32_3, b"\0" * 4, b"\0" * 8)
    twice[1].header.CopyFrom(twice[0].header)
    again = _error(stub.Put, iter(twice), timeout=5.0)
    assert "message 1 repeats the header" in again.details()


@pytest.mark.parametrize(
    ("ttype", "message"),
    [
        (values_pb2.TensorType(dtype=values_pb2.DTYPE_UNSPECIFIED, shape=[3]), "a DType enum"),
        (values_pb2.TensorType(dtype=values_pb2.FLOAT32, shape=[-3]), "non-negative"),
        (values_pb2.TensorType(dtype=values_pb2.FLOAT32, shape=[1] * 40), "rank <= 32"),
        (values_pb2.TensorType(dtype=values_pb2.FLOAT32, shape=[2**31] * 3), "over the limit"),
    ],
)
def test_put_with_a_bad_type_is_invalid_argument(driver, stub, ttype, message):
    error = _error(stub.PutSmall, _put(driver.session, "x", ttype, b"")[0], timeout=5.0)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()


ABSURD_SHAPES = [
    ([2**63 - 1], "is 9223372036854775807 bytes, over the limit"),
    ([2**62, 2**62, 0], "spans over 2^63 bytes"),
    ([2**63 - 1, 2, 0], "spans over 2^63 bytes"),
    ([2**40, 2**40, 0, 2**40], "spans over 2^63 bytes"),
]


@pytest.mark.parametrize(("shape", "message"), ABSURD_SHAPES)
def test_absurd_shapes_are_invalid_argument_in_every_call_that_takes_a_value(
    driver, channel, stub, shape, message
):
    """Checked before any allocation or reshape: nothing reaches numpy."""
    ttype = values_pb2.TensorType(dtype=values_pb2.UINT8, shape=shape)
    header = pb.PeerHeader(exec_id="s1:e1", op=1, src=1, dst=0, type=ttype)
    peer = rpc_pb.PeerServiceStub(channel)
    for call, request in [
        (stub.PutSmall, _put(driver.session, "x", ttype, b"")[0]),
        (stub.Put, iter(_put(driver.session, "x", ttype, b"", b""))),
        (peer.SendSmall, pb.PeerChunk(header=header)),
        (peer.Send, iter([pb.PeerChunk(header=header), pb.PeerChunk(data=b"")])),
    ]:
        error = _error(call, request, timeout=5.0)
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert message in error.details()
        assert f"u8[{','.join(map(str, shape))}]" in error.details() or "shape" in error.details()


# -- sessions, programs and executions ----------------------------------------------------
def test_every_call_naming_an_unknown_session_is_not_found(stub):
    calls = [
        lambda: stub.CloseSession(pb.CloseSessionRequest(session="nope"), timeout=5.0),
        lambda: stub.KeepAlive(pb.KeepAliveRequest(session="nope"), timeout=5.0),
        lambda: stub.PutSmall(_put("nope", "x", F32_3, b"\0" * 12)[0], timeout=5.0),
        lambda: list(stub.Fetch(pb.FetchRequest(session="nope", name="x"), timeout=5.0)),
        lambda: stub.Release(pb.ReleaseRequest(session="nope", names=["x"]), timeout=5.0),
        lambda: stub.Abort(pb.AbortRequest(session="nope", exec_id="e1"), timeout=5.0),
        lambda: stub.Execute(pb.ExecuteRequest(session="nope", exec_id="e1"), timeout=5.0),
        lambda: stub.LoadProgram(
            iter([pb.ProgramChunk(header=pb.ProgramHeader(session="nope"))]), timeout=5.0
        ),
    ]
    for call in calls:
        error = _error(call)
        assert error.code() is grpc.StatusCode.NOT_FOUND
        assert "no open session 'nope'" in error.details()
        assert (MISSING_KEY, "session") in error.trailing_metadata()


def test_opening_a_session_twice_or_for_another_cluster_is_invalid_argument(driver, stub):
    again = pb.OpenSessionRequest(
        session=driver.session, parties=["P0", "P1"], wire_version=WIRE_VERSION
    )
    assert "already open" in _error(stub.OpenSession, again, timeout=5.0).details()
    other = pb.OpenSessionRequest(
        session="fresh", parties=["A", "B", "C"], wire_version=WIRE_VERSION
    )
    error = _error(stub.OpenSession, other, timeout=5.0)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "['A', 'B', 'C']" in error.details() and "['P0', 'P1']" in error.details()
    bad_id = pb.OpenSessionRequest(
        session="no spaces", parties=["P0", "P1"], wire_version=WIRE_VERSION
    )
    assert "session: expected 1-64" in _error(stub.OpenSession, bad_id, timeout=5.0).details()


def test_garbage_program_bytes_are_invalid_argument(driver, stub):
    garbage = b"\x08\x01\x12\x05hello\x1a\xff not a graph"
    header = pb.ProgramHeader(
        session=driver.session, digest=hashlib.sha256(garbage).hexdigest(), size=len(garbage)
    )
    chunk = pb.ProgramChunk(header=header, data=garbage)
    error = _error(stub.LoadProgram, iter([chunk]), timeout=5.0)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "do not decode as a Graph" in error.details()
    chunk.header.digest = "0" * 64
    mismatch = _error(stub.LoadProgram, iter([chunk]), timeout=5.0)
    assert "the bytes received have digest" in mismatch.details()
    assert f"the header says {'0' * 64}" in mismatch.details()


def test_program_bytes_that_are_not_canonical_are_refused(driver, stub):
    x = driver.put(0, np.float32(1.0))
    program = driver.compile(add_one, x)
    odd = program.to_bytes() + b"\x98\x06\x01"  # an unknown field 99: the same program
    header = pb.ProgramHeader(
        session=driver.session, digest=hashlib.sha256(odd).hexdigest(), size=len(odd)
    )
    error = _error(stub.LoadProgram, iter([pb.ProgramChunk(header=header, data=odd)]), timeout=5.0)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (
        f"expected the program's canonical bytes (Graph.to_bytes(), digest {program.digest})"
        in (error.details())
    )


def test_execute_checks_the_program_the_arguments_and_their_types(driver, stub):
    x = driver.put(0, np.zeros(3, dtype=np.float32))
    driver.evaluate(add_one, x)  # ships the program
    digest = driver.compile(add_one, x).digest
    wrong = driver.put(0, np.zeros(3, dtype=np.int32))

    def execute(
        digest: str = digest, inputs: Sequence[str] = (x.name,), timeout: float = 5.0
    ) -> grpc.RpcError:
        request = pb.ExecuteRequest(
            session=driver.session,
            exec_id="e1",
            digest=digest,
            inputs=inputs,
            outputs=["y"],
            timeout=timeout,
        )
        return _error(stub.Execute, request, timeout=5.0)

    unknown = execute(digest="f" * 64)
    assert unknown.code() is grpc.StatusCode.NOT_FOUND
    assert (MISSING_KEY, "program") in unknown.trailing_metadata()
    types = execute(inputs=[wrong.name])
    assert types.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"argument 0 ('{wrong.name}'): expected f32[3], got i32[3]" in types.details()
    count = execute(inputs=[x.name, x.name])
    assert "takes 1 arguments, got 2 input names" in count.details()
    missing = execute(inputs=["never-put"])
    assert missing.code() is grpc.StatusCode.NOT_FOUND
    assert "no value named 'never-put'" in missing.details()
    assert "timeout" in execute(timeout=-1.0).details()


def test_peer_values_with_impossible_routing_are_refused(channel):
    peer = rpc_pb.PeerServiceStub(channel)
    for header, message in [
        (pb.PeerHeader(exec_id="s1:e1", op=1, src=1, dst=1), "this is party 0, not 1"),
        (pb.PeerHeader(exec_id="s1:e1", op=1, src=0, dst=0), "a source among the other parties"),
        (pb.PeerHeader(exec_id="s1:e1", op=1, src=7, dst=0), "a source among the other parties"),
        (pb.PeerHeader(exec_id="../x", op=1, src=1, dst=0), "exec_id: expected"),
    ]:
        header.type.CopyFrom(F32_3)
        error = _error(peer.SendSmall, pb.PeerChunk(header=header, data=b"\0" * 12), timeout=5.0)
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.details()


# -- values, handles and sessions ---------------------------------------------------------
def test_values_over_the_message_limit_stream_both_ways(driver):
    value = np.random.default_rng(0).standard_normal((3, MAX_MESSAGE_BYTES // 8 + 5))
    assert value.nbytes > MAX_MESSAGE_BYTES > CHUNK_BYTES
    handle = driver.put(1, value)
    moved = driver.evaluate(mp.function(lambda v: mp.p2p(1, 0, v)), handle)
    np.testing.assert_array_equal(driver.fetch(moved, party=0), value)


def test_a_program_is_shipped_once_per_digest_and_again_if_a_party_lost_it(driver):
    shipped = []
    for rank, uploads in enumerate(driver._streams):
        for method in ("LoadProgram", "LoadProgramSmall"):  # a small program goes unary
            load = getattr(uploads, method)

            def counting(chunks, *, rank=rank, load=load, **kwargs):
                shipped.append(rank)
                return load(chunks, **kwargs)

            setattr(uploads, method, counting)
    x = driver.put(0, np.float32(1.0))
    for _ in range(3):
        x = driver.evaluate(add_one, x)
    assert shipped == [0]  # party 1 takes no part in add_one at party 0
    assert float(driver.fetch(x, party=0)) == 4.0

    @mp.function
    def fresh(v: mp.MPObject) -> mp.MPObject:
        return mp.p2p(0, 1, mp.run_jax(lambda a: a * 10, v))

    digest = driver.compile(fresh, x).digest
    driver._shipped[1].add(digest)  # the driver believes party 1 holds it; it does not
    out = driver.evaluate(fresh, x)
    assert float(driver.fetch(out, party=1)) == 40.0
    assert sorted(shipped[1:]) == [0, 1]


def test_dropped_handles_are_released_at_the_party(driver, stub):
    kept = driver.put(0, np.float32(1.0))
    dropped = driver.put(0, np.float32(2.0))
    name = dropped.name
    del dropped
    gc.collect()
    driver.fetch(kept, party=0)  # carries the release along
    error = _error(list, stub.Fetch(pb.FetchRequest(session=driver.session, name=name)))
    assert error.code() is grpc.StatusCode.NOT_FOUND
    assert (MISSING_KEY, "value") in error.trailing_metadata()


def test_two_drivers_on_one_cluster_never_see_each_others_values(parties, stub):
    with Driver(parties.config, timeout=10.0) as a, Driver(parties.config, timeout=10.0) as b:
        secret = a.put(0, np.float32(42.0))
        error = _error(list, stub.Fetch(pb.FetchRequest(session=b.session, name=secret.name)))
        assert error.code() is grpc.StatusCode.NOT_FOUND
        assert f"session {b.session} holds no value named" in error.details()

        results: dict[str, list[float]] = {"a": [], "b": []}

        def work(driver: Driver, key: str, start: float) -> None:
            value = driver.put(0, np.float32(start))
            for _ in range(10):
                value = driver.evaluate(add_one, value)
                results[key].append(float(driver.fetch(value, party=0)))

        threads = [
            threading.Thread(target=work, args=(a, "a", 0.0)),
            threading.Thread(target=work, args=(b, "b", 100.0)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60.0)
        assert results == {
            "a": [float(i) for i in range(1, 11)],
            "b": [100.0 + i for i in range(1, 11)],
        }
        a.close()
        assert float(b.fetch(b.evaluate(add_one, b.put(0, np.float32(1.0))), party=0)) == 2.0
        with pytest.raises(MPPlugError, match="closed"):
            a.fetch(secret)


def test_fetching_a_value_the_party_does_not_hold_is_a_clear_error(driver, stub):
    handle = driver.put(0, np.float32(3.0))
    stub.Release(pb.ReleaseRequest(session=driver.session, names=[handle.name]), timeout=5.0)
    with pytest.raises(MPPlugError, match=r"party P0 refused Fetch: NOT_FOUND: .*no value named"):
        driver.fetch(handle, party=0)


def test_party_processes_turn_numpys_huge_page_advice_off_unless_told(monkeypatch, parties):
    said = "NumPy's huge-page advice off (NUMPY_MADVISE_HUGEPAGE unset)" in parties.log(
        "P0", tail=1 << 30
    )
    assert said is (NUMPY_HUGEPAGE_ENV not in os.environ)  # the parties share our environment
    before = numpy_huge_pages(True)
    try:
        monkeypatch.setenv(NUMPY_HUGEPAGE_ENV, "1")
        assert plain_pages_for_numpy() is False
        assert numpy_huge_pages(True) is True  # the user's choice stands
        monkeypatch.delenv(NUMPY_HUGEPAGE_ENV)
        assert plain_pages_for_numpy() is True
        assert numpy_huge_pages(True) is False
        assert plain_pages_for_numpy() is True  # turned on again above
    finally:
        numpy_huge_pages(before)
