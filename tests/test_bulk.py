"""The bulk data plane: values over a chunk move party to party over a connection of their
own, checked as PeerService checks them, and a bad, stalled, aborted or unauthorized sender is
refused or cut without taking the listener down. Listeners run in this process, on loopback.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from mpplug.config import ClusterSpec, TLSFiles, free_port
from mpplug.errors import CommTimeoutError, ExecutionAborted, PartyUnavailableError, WireError
from mpplug.protos import service_pb2 as pb
from mpplug.remote.bulk import (
    EAGER,
    EAGER_BYTES,
    IDLE_LINKS_PER_PEER,
    JOINED_BYTES,
    MAGIC,
    READ_AHEAD_BYTES,
    Link,
    Links,
    Listener,
    client_context,
)
from mpplug.remote.certs import DRIVER, with_tls, write_dev_certs
from mpplug.remote.limits import Slots, StreamWatch
from mpplug.remote.peer import PEER_SERVICE, PeerCommunicator, PeerServicer
from mpplug.remote.rpc import add_service
from mpplug.remote.streaming import CHUNK_BYTES
from mpplug.runtime import codec
from mpplug.runtime.communicator import Key, Mailbox

EXEC = "s:e"
_REQUEST_BYTES = 8  # b"MPB2" and the header's length
BIG = np.random.default_rng(0).integers(0, 256, 3 * CHUNK_BYTES + 3, dtype=np.uint8)


def _key(op: int = 1, src: int = 0, dst: int = 1) -> Key:
    return Key(EXEC, op, src, dst)


def _header(key: Key, value: np.ndarray) -> bytes:
    return pb.PeerHeader(
        exec_id=key.exec_id, op=key.op, src=key.src, dst=key.dst, type=codec.encode_type(value)
    ).SerializeToString()


def _offer(sock: socket.socket, header: bytes) -> None:
    sock.sendall(MAGIC + struct.pack(">I", len(header)) + header)


def _reply(sock: socket.socket) -> tuple[grpc.StatusCode, str]:
    head = _exactly(sock, 5)
    number, length = struct.unpack(">BI", head)
    codes = {code.value[0]: code for code in grpc.StatusCode}
    return codes[number], _exactly(sock, length).decode()


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = sock.recv(size - len(data))
        assert part, f"the listener closed the connection after {len(data)} of {size} bytes"
        data += part
    return data


def _closed_by_listener(sock: socket.socket, within: float = 5.0) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


class Receiver:
    """Party `rank` of `spec` taking bulk values into its own mailbox (on `port` instead of
    its bulk port, if given)."""

    def __init__(
        self,
        spec: ClusterSpec,
        rank: int = 1,
        *,
        connections: int = 8,
        stall_s: float = 10.0,
        max_pending_bytes: int | None = None,
        port: int | None = None,
    ) -> None:
        self.mailbox = Mailbox(rank, max_pending_bytes=max_pending_bytes)
        self.inbox = PeerServicer(
            spec, rank, self.mailbox, slots=Slots("value streams", 4), watch=StreamWatch(60.0)
        )
        party = spec.parties[rank]
        address = party.bulk_listen
        assert address is not None
        self.listener = Listener(
            (address[0], port or address[1]),
            self.inbox,
            tls=party.tls,
            connections=connections,
            stall_s=stall_s,
            name=party.name,
        )
        self.address = ("127.0.0.1", self.listener.port)
        self.listener.start()

    def connect(self, identity: TLSFiles | None = None) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=5.0)
        if identity is not None:
            context = client_context(identity)
            sock = context.wrap_socket(sock)
        return sock


@contextlib.contextmanager
def receiving(spec: ClusterSpec, rank: int = 1, **options: object) -> Iterator[Receiver]:
    receiver = Receiver(spec, rank, **options)  # type: ignore[arg-type]
    try:
        yield receiver
    finally:
        receiver.listener.stop()


@contextlib.contextmanager
def sender(spec: ClusterSpec, rank: int = 0, timeout: float = 5.0) -> Iterator[PeerCommunicator]:
    comm = PeerCommunicator(spec, rank, Mailbox(rank), tls=spec.parties[rank].tls, timeout=timeout)
    try:
        yield comm
    finally:
        comm.close()


def _bulk_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "-bulk" in t.name]


# -- values arrive, over the bulk port --------------------------------------------------------
def test_a_value_over_a_chunk_arrives_intact_over_one_kept_connection():
    spec = ClusterSpec.local(2)  # nothing serves gRPC: the values can only come in bulk
    matrix = np.arange(2 * CHUNK_BYTES, dtype=np.float32).reshape(1024, -1)
    with receiving(spec) as receiver, sender(spec) as comm:
        comm.send(_key(1), BIG)
        comm.send(_key(2), matrix)
        np.testing.assert_array_equal(receiver.mailbox.take(_key(1), 1.0), BIG)
        got = receiver.mailbox.take(_key(2), 1.0)
        assert got.dtype == np.float32 and got.shape == matrix.shape
        np.testing.assert_array_equal(got, matrix)
        assert receiver.listener.open_connections() == 1


def test_small_values_take_the_bulk_connection_too():
    """A round of mp.mpc sends kilobytes: they go over the kept connection, not gRPC."""
    spec = ClusterSpec.local(2)  # nothing serves gRPC
    small = [np.arange(n, dtype=np.uint64) for n in (0, 1, 1000)]
    with receiving(spec) as receiver, sender(spec) as comm:
        for op, value in enumerate(small):
            comm.send(_key(op), value)
        for op, value in enumerate(small):
            np.testing.assert_array_equal(receiver.mailbox.take(_key(op), 1.0), value)
        assert receiver.listener.open_connections() == 1


def test_concurrent_small_values_use_the_kept_links_or_grpc_never_new_connections():
    """Past IDLE_LINKS_PER_PEER small values on their way to one peer, the next goes over
    gRPC: sixteen concurrent executions neither open nor drop a connection per value."""
    links = Links(ClusterSpec.local(2), None)
    taken = [links.take_small(1) for _ in range(IDLE_LINKS_PER_PEER)]
    assert all(link is not None for link in taken)
    assert links.take_small(1) is None
    links.release_small(1)
    assert links.take_small(1) is not None

    spec = ClusterSpec.local(2)
    with receiving(spec) as receiver, sender(spec) as comm:
        server = grpc.server(ThreadPoolExecutor(16))  # PeerService into the same mailbox
        add_service(server, receiver.inbox, PEER_SERVICE, receiver.inbox.RAW_REQUESTS)
        server.add_insecure_port(spec.parties[1].endpoint)
        server.start()
        try:
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda op: comm.send(_key(op), np.full(100, op)), range(64)))
            comm.settle(EXEC)
            for op in range(64):
                got = receiver.mailbox.take(_key(op), 1.0)
                np.testing.assert_array_equal(got, np.full(100, op))
            assert receiver.listener.open_connections() <= IDLE_LINKS_PER_PEER
        finally:
            server.stop(0)


def test_a_party_without_a_bulk_port_gets_large_values_over_grpc():
    data = ClusterSpec.local(2).to_dict()
    del data["parties"][1]["bulk"]
    spec = ClusterSpec.from_dict(data)
    mailbox = Mailbox(1)
    servicer = PeerServicer(spec, 1, mailbox, slots=Slots("streams", 4), watch=StreamWatch(60))
    server = grpc.server(ThreadPoolExecutor(4))
    add_service(server, servicer, PEER_SERVICE, servicer.RAW_REQUESTS)
    server.add_insecure_port(spec.parties[1].endpoint)
    server.start()
    try:
        with sender(spec) as comm:
            comm.send(_key(), BIG)
        np.testing.assert_array_equal(mailbox.take(_key(), 1.0), BIG)
    finally:
        server.stop(0)


def test_a_kept_connection_the_receiver_closed_is_replaced():
    spec = ClusterSpec.local(2)
    with sender(spec) as comm:
        with receiving(spec) as receiver:
            comm.send(_key(1), BIG)
            np.testing.assert_array_equal(receiver.mailbox.take(_key(1), 1.0), BIG)
        with receiving(spec) as restarted:  # the kept connection died with the first listener
            comm.send(_key(2), BIG)
            np.testing.assert_array_equal(restarted.mailbox.take(_key(2), 1.0), BIG)


def test_a_small_value_goes_with_its_header_and_is_answered_once():
    spec = ClusterSpec.local(2)
    small = np.arange(1000, dtype=np.uint64)
    with receiving(spec) as receiver, receiver.connect() as sock:
        for op in (1, 2):  # the connection goes on after each
            sock.sendall(EAGER + struct.pack(">I", len(_header(_key(op), small))))
            sock.sendall(_header(_key(op), small) + small.tobytes())
            assert _reply(sock) == (grpc.StatusCode.OK, "")
            np.testing.assert_array_equal(receiver.mailbox.take(_key(op), 1.0), small)


def _eager(op: int, value: np.ndarray) -> bytes:
    header = _header(_key(op), value)
    return EAGER + struct.pack(">I", len(header)) + header + value.tobytes()


def test_requests_are_taken_whole_however_their_bytes_arrive():
    """The listener reads ahead of what it needs (a small value and its header come in one
    read): a request in pieces, a value larger than one read, and two requests written back
    to back are each taken whole, in order."""
    spec = ClusterSpec.local(2)
    small = np.arange(1000, dtype=np.uint64)
    large = np.arange(READ_AHEAD_BYTES // 2, dtype=np.uint64)  # four reads' worth
    with receiving(spec) as receiver, receiver.connect() as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pieces = _eager(1, small)
        for start, stop in ((0, 3), (3, 20), (20, len(pieces) - 5), (len(pieces) - 5, None)):
            sock.sendall(pieces[start:stop])  # in the prefix, the header, the value
            time.sleep(0.02)
        assert _reply(sock) == (grpc.StatusCode.OK, "")
        sock.sendall(_eager(2, large))
        assert _reply(sock) == (grpc.StatusCode.OK, "")
        sock.sendall(_eager(3, small) + _eager(4, small[::-1].copy()))
        assert [_reply(sock), _reply(sock)] == [(grpc.StatusCode.OK, "")] * 2
        np.testing.assert_array_equal(receiver.mailbox.take(_key(1), 1.0), small)
        np.testing.assert_array_equal(receiver.mailbox.take(_key(2), 1.0), large)
        np.testing.assert_array_equal(receiver.mailbox.take(_key(3), 1.0), small)
        np.testing.assert_array_equal(receiver.mailbox.take(_key(4), 1.0), small[::-1])
        assert receiver.listener.open_connections() == 1


class _Writes(socket.socket):
    """A socket that notes the size of each `sendall`."""

    sizes: list[int]

    def sendall(self, data: Any, flags: int = 0) -> None:
        self.sizes.append(len(memoryview(data).cast("B")))
        super().sendall(data, flags)


@pytest.mark.parametrize(("size", "writes"), [(JOINED_BYTES, 1), (JOINED_BYTES + 1, 2)])
def test_a_small_value_is_written_with_its_header_at_once(size: int, writes: int):
    ours, theirs = socket.socketpair()
    sock = _Writes(fileno=ours.detach())
    sock.sizes = []
    link = Link(1, "P1", ("127.0.0.1", 0))
    link.sock = sock
    value = np.arange(size, dtype=np.uint8)
    header = _header(_key(), value)
    with sock, theirs:
        link.send(header, memoryview(value), time.monotonic() + 5.0, 5.0, None, answer_later=True)
        expected = _REQUEST_BYTES + len(header) + size
        assert len(sock.sizes) == writes and sum(sock.sizes) == expected
        assert _exactly(theirs, expected) == EAGER + struct.pack(">I", len(header)) + header + (
            value.tobytes()
        )


def test_a_refused_small_value_is_answered_its_bytes_dropped_and_the_connection_closed():
    spec = ClusterSpec.local(2)
    small = np.arange(1000, dtype=np.uint64)
    with receiving(spec, max_pending_bytes=small.nbytes) as receiver:
        with receiver.connect() as sock:  # a value too large to go with its header
            header = _header(_key(2), BIG)
            sock.sendall(EAGER + struct.pack(">I", len(header)) + header + BIG[:1000].tobytes())
            code, message = _reply(sock)
            assert code is grpc.StatusCode.INVALID_ARGUMENT
            assert f"{BIG.nbytes} bytes sent with their header, over the {EAGER_BYTES}" in message
            sock.shutdown(socket.SHUT_WR)
            assert _closed_by_listener(sock)
        assert receiver.mailbox.pending_bytes(0) == 0  # its room given back
        receiver.mailbox.deliver(_key(9), small, small.nbytes)
        with receiver.connect() as sock:
            header = _header(_key(1), small)
            sock.sendall(EAGER + struct.pack(">I", len(header)) + header + small.tobytes())
            code, message = _reply(sock)
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"party 0 has {small.nbytes} bytes waiting here already" in message
            sock.shutdown(socket.SHUT_WR)
            assert _closed_by_listener(sock)
        assert receiver.mailbox.pending_bytes(0) == small.nbytes  # only the one delivered

        # The communicator reconnects and tries again until the first value is taken: the
        # send returns once the value is written, and `settle` reads the refusals.
        threading.Timer(0.3, receiver.mailbox.take, (_key(9), 1.0)).start()
        with sender(spec) as comm:
            comm.send(_key(1), small)
            comm.settle(EXEC)
            np.testing.assert_array_equal(receiver.mailbox.take(_key(1), 1.0), small)
            comm.send(Key("no-session", 2, 0, 1), small)
            with pytest.raises(WireError, match="expected '<session>:<execution id>'"):
                comm.settle("no-session")  # refused, not tried again
            assert all(link.sock is not None for link in comm._links._idle.get(1, []))


def test_a_small_value_is_sent_ahead_and_a_refusal_named_under_its_own_key():
    """A small value returns once written; its answer is read before the execution's next
    value to that peer, and a refusal raises there, naming the value refused."""
    spec = ClusterSpec.local(2)
    small = np.arange(1000, dtype=np.uint64)
    with receiving(spec) as receiver, sender(spec) as comm:
        for op in (1, 2, 3):
            comm.send(_key(op), small)
        comm.settle(EXEC)
        for op in (1, 2, 3):
            np.testing.assert_array_equal(receiver.mailbox.take(_key(op), 1.0), small)
        comm.send(Key("no-session", 1, 0, 1), small)  # refused by the receiver, read later
        with pytest.raises(WireError, match="refused value no-session/1/0->1"):
            comm.send(Key("no-session", 2, 0, 1), small)
        comm.send(_key(4), small)  # another execution is not touched by it
        comm.settle(EXEC)
        np.testing.assert_array_equal(receiver.mailbox.take(_key(4), 1.0), small)


@contextlib.contextmanager
def answering_second(spec: ClusterSpec) -> Iterator[list[bytes]]:
    """P1's bulk port answered by a receiver that reads a small value and closes without an
    answer, then reads it again on the next connection and answers OK; yields the payloads."""
    address = spec.parties[1].bulk_listen
    assert address is not None
    server = socket.create_server(("127.0.0.1", address[1]))
    got: list[bytes] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            for answer in (False, True):
                conn, _ = server.accept()
                with conn:
                    (length,) = struct.unpack(">I", _exactly(conn, 8)[4:])
                    _exactly(conn, length)
                    got.append(_exactly(conn, 8000))
                    if answer:
                        conn.sendall(struct.pack(">BI", 0, 0))
                        conn.recv(1)  # until the sender closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        server.close()
        thread.join(5.0)


def test_a_value_sent_ahead_whose_connection_fails_before_its_answer_is_sent_again():
    spec = ClusterSpec.local(2)
    small = np.arange(1000, dtype=np.uint64)
    with answering_second(spec) as got, sender(spec) as comm:
        comm.send(_key(), small)
        comm.settle(EXEC)
        comm.close()
    assert got == [small.tobytes(), small.tobytes()]


def test_an_abort_cuts_short_waiting_for_the_answer_to_a_value_sent_ahead():
    spec = ClusterSpec.local(2)
    small = np.arange(1000, dtype=np.uint64)
    address = spec.parties[1].bulk_listen
    assert address is not None
    with socket.create_server(("127.0.0.1", address[1])), sender(spec, timeout=60.0) as comm:
        comm.send(_key(), small)  # written into the socket buffers; never answered
        threading.Timer(0.5, comm.cancel, (EXEC,)).start()
        started = time.monotonic()
        with pytest.raises(ExecutionAborted, match="aborted while sending"):
            comm.settle(EXEC)
        assert time.monotonic() - started < 5.0


# -- what the listener refuses ----------------------------------------------------------------
def test_a_refused_value_is_answered_typed_and_the_connection_goes_on():
    spec = ClusterSpec.local(2)
    with receiving(spec) as receiver, receiver.connect() as sock:
        _offer(sock, _header(_key(dst=0), BIG))
        wrong_party = f"value {EXEC}/1/0->0 sent to party 1: this is party 1, not 0"
        assert _reply(sock) == (grpc.StatusCode.INVALID_ARGUMENT, wrong_party)
        _offer(sock, b"\xff\xff")
        code, message = _reply(sock)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "the header does not decode as a PeerHeader" in message
        _offer(sock, _header(_key(), BIG))
        assert _reply(sock) == (grpc.StatusCode.OK, "")
        sock.sendall(BIG)
        assert _reply(sock) == (grpc.StatusCode.OK, "")
        np.testing.assert_array_equal(receiver.mailbox.take(_key(), 1.0), BIG)


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        (b"HTTP" + struct.pack(">I", 0), "expected b'MPB1' or b'MPB2', got b'HTTP'"),
        (MAGIC + struct.pack(">I", 1 << 20), "a header of 1048576 bytes, over the 65536 allowed"),
    ],
    ids=["bad magic", "header too long"],
)
def test_a_frame_out_of_protocol_is_answered_then_cut(prefix, expected):
    spec = ClusterSpec.local(2)
    with receiving(spec) as receiver:
        with receiver.connect() as sock:
            sock.sendall(prefix)
            assert _reply(sock) == (grpc.StatusCode.INVALID_ARGUMENT, expected)
            assert _closed_by_listener(sock)
        with sender(spec) as comm:  # still serving
            comm.send(_key(), BIG)


def test_a_source_over_its_waiting_bytes_is_refused_before_sending_them():
    spec = ClusterSpec.local(2)
    with receiving(spec, max_pending_bytes=BIG.nbytes) as receiver, sender(spec) as comm:
        comm.send(_key(1), BIG)
        with receiver.connect() as sock:
            _offer(sock, _header(_key(2), BIG))
            code, message = _reply(sock)
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"party 0 has {BIG.nbytes} bytes waiting here already" in message

        # The communicator tries again until the receiver has taken the first value.
        threading.Timer(0.3, receiver.mailbox.take, (_key(1), 1.0)).start()
        comm.send(_key(2), BIG)
        np.testing.assert_array_equal(receiver.mailbox.take(_key(2), 1.0), BIG)


def test_values_offered_at_once_cannot_pass_the_limit_together():
    spec = ClusterSpec.local(2)
    with (
        receiving(spec, max_pending_bytes=BIG.nbytes) as receiver,
        receiver.connect() as first,
        receiver.connect() as second,
    ):
        _offer(first, _header(_key(1), BIG))
        assert _reply(first) == (grpc.StatusCode.OK, "")
        _offer(second, _header(_key(2), BIG))  # the first value's bytes are still on their way
        code, message = _reply(second)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "waiting here already or on their way" in message
        first.sendall(BIG)
        assert _reply(first) == (grpc.StatusCode.OK, "")
        assert receiver.mailbox.pending_bytes(0) == BIG.nbytes


def test_a_value_cut_off_midway_gives_its_room_back():
    spec = ClusterSpec.local(2)
    with receiving(spec, max_pending_bytes=BIG.nbytes) as receiver:
        with receiver.connect() as sock:
            _offer(sock, _header(_key(1), BIG))
            assert _reply(sock) == (grpc.StatusCode.OK, "")
            sock.sendall(BIG[:100])
        _wait_for(lambda: receiver.listener.open_connections() == 0)
        assert receiver.mailbox.pending_bytes(0) == 0


def test_a_value_that_stalls_midway_is_cut_and_the_listener_keeps_serving():
    spec = ClusterSpec.local(2)
    with receiving(spec, stall_s=0.5) as receiver:
        with receiver.connect() as sock:
            _offer(sock, _header(_key(1), BIG))
            assert _reply(sock) == (grpc.StatusCode.OK, "")
            sock.sendall(BIG[:CHUNK_BYTES])
            started = time.monotonic()
            assert _closed_by_listener(sock)
            assert time.monotonic() - started < 3.0
        with sender(spec) as comm:
            comm.send(_key(2), BIG)
        np.testing.assert_array_equal(receiver.mailbox.take(_key(2), 1.0), BIG)
        with pytest.raises(CommTimeoutError):  # the value cut short never reached the mailbox
            receiver.mailbox.take(_key(1), 0.2)


def test_one_connection_over_the_limit_closes_the_longest_idle_one():
    spec = ClusterSpec.local(2)
    with receiving(spec, connections=2) as receiver:
        first, second = receiver.connect(), receiver.connect()
        _wait_for(lambda: receiver.listener.open_connections() == 2)
        third = receiver.connect()
        assert _closed_by_listener(first)
        _offer(third, _header(_key(), BIG))  # the newcomer is served
        assert _reply(third) == (grpc.StatusCode.OK, "")

        # With every connection moving a value, one more is closed itself.
        _offer(second, _header(_key(2), BIG))
        assert _reply(second) == (grpc.StatusCode.OK, "")
        fourth = receiver.connect()
        assert _closed_by_listener(fourth)
        for sock in (first, second, third, fourth):
            sock.close()


def test_the_connection_idle_for_longest_is_the_one_closed():
    spec = ClusterSpec.local(2)
    with receiving(spec, connections=2) as receiver:
        first, second = receiver.connect(), receiver.connect()
        _wait_for(lambda: receiver.listener.open_connections() == 2)
        time.sleep(0.05)
        _offer(first, _header(_key(), BIG))  # the first moves a value: idle again only now
        assert _reply(first) == (grpc.StatusCode.OK, "")
        first.sendall(BIG)
        assert _reply(first) == (grpc.StatusCode.OK, "")
        third = receiver.connect()
        assert _closed_by_listener(second)
        _offer(first, _header(_key(2), BIG))
        assert _reply(first) == (grpc.StatusCode.OK, "")
        for sock in (first, second, third):
            sock.close()


def test_stopping_cuts_every_connection_and_leaves_no_thread():
    spec = ClusterSpec.local(2)
    before = _bulk_threads()
    receiver = Receiver(spec)
    idle, busy = receiver.connect(), receiver.connect()
    _offer(busy, _header(_key(), BIG))
    assert _reply(busy) == (grpc.StatusCode.OK, "")
    busy.sendall(BIG[:100])
    _wait_for(lambda: receiver.listener.open_connections() == 2)
    started = time.monotonic()
    receiver.listener.stop()
    assert time.monotonic() - started < 2.0
    assert _closed_by_listener(idle) and _closed_by_listener(busy)
    assert _bulk_threads() == before
    idle.close()
    busy.close()


# -- aborts --------------------------------------------------------------------------------
@contextlib.contextmanager
def never_reading(spec: ClusterSpec) -> Iterator[None]:
    """P1's bulk port answered by a receiver that says go ahead, then reads nothing more."""
    address = spec.parties[1].bulk_listen
    assert address is not None
    server = socket.create_server(("127.0.0.1", address[1]))
    held: list[socket.socket] = []

    def go_ahead() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            held.append(conn)
            (length,) = struct.unpack(">I", _exactly(conn, 8)[4:])
            _exactly(conn, length)
            conn.sendall(struct.pack(">BI", 0, 0))

    thread = threading.Thread(target=go_ahead, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.close()
        for conn in held:
            conn.close()
        thread.join(5.0)


def test_an_abort_cuts_short_a_send_the_receiver_stopped_reading():
    spec = ClusterSpec.local(2)
    huge = np.zeros(256 * CHUNK_BYTES, dtype=np.uint8)  # far more than socket buffers hold
    with never_reading(spec), sender(spec, timeout=60.0) as comm:
        threading.Timer(0.5, comm.cancel, (EXEC,)).start()
        started = time.monotonic()
        with pytest.raises(ExecutionAborted, match="aborted while sending"):
            comm.send(_key(), huge)
        assert time.monotonic() - started < 5.0


# -- mutual TLS ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_spec(tmp_path_factory: pytest.TempPathFactory) -> tuple[ClusterSpec, dict[str, TLSFiles]]:
    spec = ClusterSpec.local(3)
    files = write_dev_certs(spec, Path(tmp_path_factory.mktemp("certs")))
    return with_tls(spec, files), files


def test_with_tls_values_arrive_from_the_parties_as_themselves(tls_spec):
    spec, files = tls_spec
    with receiving(spec) as receiver:
        with sender(spec, rank=0) as p0, sender(spec, rank=2) as p2:
            p0.send(_key(1, src=0), BIG)
            p2.send(_key(2, src=2), BIG)
        for key in (_key(1, src=0), _key(2, src=2)):
            np.testing.assert_array_equal(receiver.mailbox.take(key, 1.0), BIG)

        with receiver.connect(files[DRIVER]) as sock:
            _offer(sock, _header(_key(3), BIG))
            code, message = _reply(sock)
            assert code is grpc.StatusCode.PERMISSION_DENIED
            assert "accepts values only from the other parties ['P0', 'P2']" in message
            assert "names 'driver'" in message

        with receiver.connect(files["P2"]) as sock:
            _offer(sock, _header(_key(4, src=0), BIG))
            code, message = _reply(sock)
            assert code is grpc.StatusCode.PERMISSION_DENIED
            assert "claims to come from 'P0', but the caller's certificate names 'P2'" in message


def test_with_tls_a_client_without_a_certificate_is_refused_at_the_handshake(tls_spec):
    spec, files = tls_spec
    with receiving(spec) as receiver:
        context = ssl.create_default_context(cafile=str(files["P0"].ca))
        context.check_hostname = False
        with (
            socket.create_connection(receiver.address, timeout=5.0) as raw,
            pytest.raises((ssl.SSLError, ConnectionError)),
            context.wrap_socket(raw) as sock,  # TLS 1.3 reports it at the first read
        ):
            _offer(sock, _header(_key(), BIG))
            sock.recv(1)
        with sender(spec) as comm:
            comm.send(_key(), BIG)


def test_with_tls_connections_that_never_shake_hands_count_and_are_cut(tls_spec):
    spec, _ = tls_spec
    receiver = Receiver(spec, connections=2)
    silent = [socket.create_connection(receiver.address) for _ in range(3)]
    assert _closed_by_listener(silent[0])  # the longest waiting made room for the third
    _wait_for(lambda: receiver.listener.open_connections() == 2)
    started = time.monotonic()
    receiver.listener.stop()
    assert time.monotonic() - started < 2.0
    assert all(_closed_by_listener(sock) for sock in silent[1:])
    for sock in silent:
        sock.close()


def test_with_tls_an_abort_cuts_short_a_handshake_that_never_ends(tls_spec):
    spec, _ = tls_spec
    address = spec.parties[1].bulk_listen
    assert address is not None
    with (
        socket.create_server(("127.0.0.1", address[1])),  # accepts, never answers
        sender(spec, timeout=30.0) as comm,
    ):
        threading.Timer(0.3, comm.cancel, (EXEC,)).start()
        started = time.monotonic()
        with pytest.raises(ExecutionAborted, match="aborted while sending"):
            comm.send(_key(), BIG)
        assert time.monotonic() - started < 3.0


class Tap:
    """A TCP relay from `port` to a listener at `to`, keeping every byte the sender wrote."""

    def __init__(self, port: int, to: tuple[str, int]) -> None:
        self.seen = bytearray()
        self._server = socket.create_server(("127.0.0.1", port))
        self._to = to
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        with contextlib.suppress(OSError):
            inbound, _ = self._server.accept()
            outbound = socket.create_connection(self._to)
            back = threading.Thread(target=self._pipe, args=(outbound, inbound, None))
            back.start()
            self._pipe(inbound, outbound, self.seen)
            back.join()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, seen: bytearray | None) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                if seen is not None:
                    seen += data
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._server.close()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_what_crosses_the_wire_is_the_value_only_without_tls(tls, tls_spec):
    spec = tls_spec[0] if tls else ClusterSpec.local(3)
    listener_port = free_port()
    receiver = Receiver(spec, port=listener_port)  # senders dial the tap at P1's bulk port
    tap = Tap(spec.parties[1].bulk_listen[1], ("127.0.0.1", listener_port))  # type: ignore[index]
    try:
        with sender(spec) as comm:
            comm.send(_key(), BIG)
        np.testing.assert_array_equal(receiver.mailbox.take(_key(), 1.0), BIG)
    finally:
        receiver.listener.stop()
        tap.close()
    assert len(tap.seen) > BIG.nbytes
    assert (bytes(BIG[:4096]) in tap.seen) is not tls


def test_with_tls_a_sender_refuses_a_listener_that_is_not_the_party_it_dials(tls_spec):
    spec, _ = tls_spec
    # P2's listener on P1's bulk port: the sender expects a certificate naming P1.
    data = spec.to_dict()
    data["parties"][2]["bulk"] = data["parties"][1]["bulk"]
    data["parties"][1]["bulk"] = f"127.0.0.1:{free_port()}"
    impostor_spec = ClusterSpec.from_dict(data)
    with (
        receiving(impostor_spec, rank=2),
        sender(spec, timeout=1.0) as comm,
        pytest.raises(PartyUnavailableError) as info,
    ):
        comm.send(_key(), BIG)
    assert info.value.party == "P1"
    assert "presented a certificate naming 'P2', not party 'P1'" in str(info.value)


def _wait_for(condition: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)
