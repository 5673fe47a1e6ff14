"""The bulk data plane: a value larger than a chunk goes party to party over a TCP (with the
cluster's mutual TLS) connection of its own, from the sender's array into the receiver's buffer.

Python gRPC copies a streamed value several times on each side and moves well under what the
socket can; here each byte crosses the kernel once each way. Connections stay open and are
reused, one value at a time each. Per value, integers big-endian:

    sender:   b"MPB1", header length (u32), a serialized PeerHeader
    receiver: status (u8, a grpc.StatusCode number), message length (u32), message (UTF-8):
              OK is the go-ahead; any other status refuses the value and the connection goes on
    sender:   the header type's nbytes of raw value bytes, nothing more
    receiver: status, message: OK once the value is in the mailbox

The receiver checks a value exactly as PeerService does (who may send, ids, type, room) before
it lets a byte of it in. With TLS each end's certificate must be signed by the cluster CA and
name the party the other end expects: the sender checks that it reached the party it dials,
the receiver that the value claims to come from the party that connected.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import struct
import threading
import time
from typing import Any, NamedTuple, Protocol

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from mpplug.config import ClusterSpec, TLSFiles
from mpplug.core import TensorType
from mpplug.protos import service_pb2 as pb
from mpplug.remote.rpc import REFUSALS, BadRequest, refusal_of
from mpplug.remote.streaming import as_bytes_view
from mpplug.runtime import codec
from mpplug.runtime.communicator import Key

log = logging.getLogger(__name__)

MAGIC = b"MPB1"
_REQUEST = struct.Struct(">4sI")
_REPLY = struct.Struct(">BI")
MAX_HEADER_BYTES = 1 << 16
"""The longest PeerHeader a receiver reads (a real one is well under a kilobyte)."""
MAX_REPLY_BYTES = 1 << 14
"""The longest reply message a sender reads (refusals are cut to 1024 characters)."""
SLICE_BYTES = 8 << 20
"""A sender checks its deadline and the link's progress every this many bytes."""
IDLE_LINKS_PER_PEER = 4
"""Open connections a sender keeps per peer between values."""
IDLE_CONNECTION_S = 300.0
"""A receiver closes a connection that brings no value for this long."""

_STATUS = {code.value[0]: code for code in grpc.StatusCode}
_OK = grpc.StatusCode.OK


class Refused(Exception):
    """The receiver answered with `code` (not OK): the value was not taken."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Admitted(NamedTuple):
    """A value let in by its header: its key, its type, and how errors name it."""

    key: Key
    ttype: TensorType
    where: str


class Inbox(Protocol):
    """Where values go: PeerServicer checks and delivers them, for PeerService and here."""

    def check_caller(self, caller: str | None) -> None: ...

    def admit(self, header: pb.PeerHeader, caller: str | None) -> Admitted: ...

    def deliver(self, admitted: Admitted, value: Any) -> None: ...


# -- TLS ------------------------------------------------------------------------------------
def client_context(files: TLSFiles) -> ssl.SSLContext:
    """Dial as `files.cert`; trust only peers signed by `files.ca` (their names are checked
    against the party dialled, see `common_name`)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    context.check_hostname = False  # the certificate's CN must name the party instead
    return context


def server_context(files: TLSFiles) -> ssl.SSLContext:
    """Serve as `files.cert`; accept only clients with a certificate signed by `files.ca`."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def common_name(sock: socket.socket) -> str | None:
    """The CN of the verified certificate of the other end of a TLS socket."""
    if not isinstance(sock, ssl.SSLSocket):
        return None
    cert: dict[str, Any] = dict(sock.getpeercert() or {})
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def _cut_off(sock: socket.socket) -> None:
    """Shut the connection under any thread blocked on it. The plain socket's shutdown: an
    SSLSocket's own drops its TLS state first, and a racing send would then go out in clear."""
    with contextlib.suppress(OSError):  # already closed, or never connected
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


# -- framing --------------------------------------------------------------------------------
def _read_exact(sock: socket.socket, size: int, *, at_start: bool = False) -> bytes | None:
    """Exactly `size` bytes; None if the connection ends before the first one and
    `at_start`; ConnectionError if it ends anywhere else."""
    data = bytearray()
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            if at_start and not data:
                return None
            raise ConnectionError(f"connection closed after {len(data)} of {size} bytes")
        data += part
    return bytes(data)


def _read_into(sock: socket.socket, buffer: memoryview) -> None:
    filled, size = 0, len(buffer)
    while filled < size:
        got = sock.recv_into(buffer[filled:], size - filled)
        if not got:
            raise ConnectionError(f"connection closed after {filled} of {size} value bytes")
        filled += got


def _reply(sock: socket.socket, code: grpc.StatusCode, message: str = "") -> None:
    data = message.encode()[:MAX_REPLY_BYTES]
    sock.sendall(_REPLY.pack(code.value[0], len(data)) + data)


def _read_reply(sock: socket.socket) -> tuple[grpc.StatusCode, str]:
    head = _read_exact(sock, _REPLY.size)
    assert head is not None
    number, length = _REPLY.unpack(head)
    if length > MAX_REPLY_BYTES:
        raise ConnectionError(f"a reply of {length} bytes, over the {MAX_REPLY_BYTES} allowed")
    message = _read_exact(sock, length) or b""
    code = _STATUS.get(number)
    if code is None:
        raise ConnectionError(f"a reply with status {number}, which is no gRPC status code")
    return code, message.decode(errors="replace")


# -- sending --------------------------------------------------------------------------------
class Link:
    """One open connection to a peer's bulk listener; `cancel` cuts it from any thread."""

    def __init__(self, sock: socket.socket, rank: int) -> None:
        self.sock = sock
        self.rank = rank
        self.reused = False
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        _cut_off(self.sock)

    def close(self) -> None:
        _cut_off(self.sock)
        self.sock.close()

    def idle_and_open(self) -> bool:
        """Whether the connection is still usable: an idle link has nothing to read, so a
        readable one was closed (or written to) by the other end."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def send(self, header: bytes, payload: memoryview, give_up: float, stall_s: float) -> None:
        """Offer the value, then move its bytes once the receiver says go ahead. Refused if it
        says otherwise (the link stays usable); OSError if the connection fails or stalls for
        `stall_s`, or `give_up` passes."""
        self._wait(give_up, stall_s)
        self.sock.sendall(_REQUEST.pack(MAGIC, len(header)) + header)
        self._answer(give_up, stall_s)
        self.reused = False  # a failure from here on is no stale connection: the value is offered
        for start in range(0, len(payload), SLICE_BYTES):
            self._wait(give_up, stall_s)
            self.sock.sendall(payload[start : start + SLICE_BYTES])
        self._wait(give_up, stall_s)
        self._answer(give_up, stall_s)

    def _wait(self, give_up: float, stall_s: float) -> None:
        left = give_up - time.monotonic()
        if left <= 0:
            raise TimeoutError("the send's deadline passed")
        self.sock.settimeout(min(left, stall_s))

    def _answer(self, give_up: float, stall_s: float) -> None:
        self._wait(give_up, stall_s)
        code, message = _read_reply(self.sock)
        if code is not _OK:
            raise Refused(code, message)


class Links:
    """Connections from this party to the other parties' bulk listeners, opened on first use
    and kept (up to IDLE_LINKS_PER_PEER per peer) for the next values."""

    def __init__(self, spec: ClusterSpec, rank: int, tls: TLSFiles | None) -> None:
        self._spec = spec
        self._rank = rank
        self._context = client_context(tls) if tls is not None else None
        self._idle: dict[int, list[Link]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def reaches(self, rank: int) -> bool:
        """Whether party `rank` takes values over a bulk connection."""
        return self._spec.parties[rank].bulk is not None

    def take(self, rank: int, timeout: float) -> Link:
        """An open link to party `rank`: an idle one, or a new one (OSError if it cannot be
        made within `timeout`, ssl.SSLError if the party is not who it should be)."""
        with self._lock:
            idle = self._idle.get(rank, [])
            while idle:
                link = idle.pop()
                if link.idle_and_open():
                    link.reused = True
                    return link
                link.close()
        return self._dial(rank, timeout)

    def _dial(self, rank: int, timeout: float) -> Link:
        party = self._spec.parties[rank]
        assert party.bulk is not None
        host, port = party.bulk.rsplit(":", 1)
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._context is not None:
                sock = self._context.wrap_socket(sock)
                if common_name(sock) != party.name:
                    raise ssl.SSLError(
                        f"the bulk listener at {party.bulk} presented a certificate naming "
                        f"{common_name(sock)!r}, not party {party.name!r}"
                    )
        except BaseException:
            _cut_off(sock)
            sock.close()
            raise
        return Link(sock, rank)

    def give_back(self, link: Link) -> None:
        """Keep `link` for the next value to its party (or close it if enough are kept)."""
        with self._lock:
            idle = self._idle.setdefault(link.rank, [])
            if not self._closed and not link.cancelled and len(idle) < IDLE_LINKS_PER_PEER:
                idle.append(link)
                return
        link.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = [link for idle in self._idle.values() for link in idle]
            self._idle.clear()
        for link in links:
            link.close()


# -- receiving ------------------------------------------------------------------------------
class _Connection:
    __slots__ = ("idle", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.idle = True


class Listener:
    """A party's bulk listener: a thread accepting connections and one serving each.

    At most `connections` are open at once; one more closes the longest-idle one to make
    room, or is closed itself if all of them are moving values. A connection that stalls for
    `stall_s` mid-value, or brings nothing for IDLE_CONNECTION_S, is closed.
    """

    def __init__(
        self,
        address: tuple[str, int],
        inbox: Inbox,
        *,
        tls: TLSFiles | None,
        connections: int,
        stall_s: float,
        name: str,
    ) -> None:
        self._inbox = inbox
        self._context = server_context(tls) if tls is not None else None
        self._limit = connections
        self._stall_s = stall_s
        self._name = name
        host, port = address
        if host in ("::", "[::]") and socket.has_dualstack_ipv6():
            server = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            server = socket.create_server((host.strip("[]"), port), family=family)
        self._server = server
        self.port: int = server.getsockname()[1]
        self._open: dict[int, _Connection] = {}  # by id
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopped = False
        self._acceptor = threading.Thread(
            target=self._accept, name=f"mpplug-{name}-bulk", daemon=True
        )

    def start(self) -> None:
        self._acceptor.start()

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def stop(self) -> None:
        """Stop accepting and cut every connection (values mid-way are lost: their sends
        fail, and their executions with them)."""
        with self._lock:
            self._stopped = True
            cut = [conn.sock for conn in self._open.values()]
            threads = list(self._threads)
        _cut_off(self._server)
        self._server.close()
        for sock in cut:
            _cut_off(sock)
        if self._acceptor.is_alive():
            self._acceptor.join()
        for thread in threads:
            thread.join()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # stopped
            with self._lock:
                if self._stopped:
                    sock.close()
                    return
                if not self._make_room():
                    log.warning(
                        "party %s: refused a bulk connection: all %d are moving values",
                        self._name,
                        self._limit,
                    )
                    sock.close()
                    continue
                conn = _Connection(sock)
                self._open[id(conn)] = conn
                thread = threading.Thread(
                    target=self._serve, args=(conn,), name=f"mpplug-{self._name}-bulk-in"
                )
                self._threads.add(thread)
            thread.start()

    def _make_room(self) -> bool:
        """With the lock held: whether one more connection may open, closing the first idle
        one if the limit is reached."""
        if len(self._open) < self._limit:
            return True
        for conn in self._open.values():
            if conn.idle:
                conn.idle = False  # its thread sees the connection end
                _cut_off(conn.sock)
                return True
        return False

    def _serve(self, conn: _Connection) -> None:
        sock = conn.sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._stall_s)
            if self._context is not None:
                sock = conn.sock = self._context.wrap_socket(sock, server_side=True)
            caller = common_name(sock)
            try:
                self._inbox.check_caller(caller)
            except REFUSALS as exc:
                code, message, _ = refusal_of(exc)
                _reply(sock, code, message)
                return
            while self._take_value(conn, caller):
                pass
        except (OSError, ConnectionError, ValueError) as exc:
            log.debug("party %s: bulk connection ended: %s", self._name, exc)
        finally:
            with self._lock:
                self._open.pop(id(conn), None)
                self._threads.discard(threading.current_thread())
            _cut_off(sock)
            sock.close()

    def _take_value(self, conn: _Connection, caller: str | None) -> bool:
        """Serve one value on `conn`; False when the connection should close."""
        sock = conn.sock
        sock.settimeout(IDLE_CONNECTION_S)
        first = _read_exact(sock, 1, at_start=True)
        with self._lock:
            if first is None or not conn.idle or self._stopped:
                return False  # closed by the peer, to make room, or by stop
            conn.idle = False
        sock.settimeout(self._stall_s)
        magic, length = _REQUEST.unpack(first + (_read_exact(sock, _REQUEST.size - 1) or b""))
        if magic != MAGIC:
            _reply(sock, grpc.StatusCode.INVALID_ARGUMENT, f"expected {MAGIC!r}, got {magic!r}")
            return False
        if length > MAX_HEADER_BYTES:
            message = f"a header of {length} bytes, over the {MAX_HEADER_BYTES} allowed"
            _reply(sock, grpc.StatusCode.INVALID_ARGUMENT, message)
            return False
        raw = _read_exact(sock, length) or b""
        try:
            try:
                header = pb.PeerHeader.FromString(raw)
            except DecodeError as exc:
                raise BadRequest(f"the header does not decode as a PeerHeader: {exc}") from None
            admitted = self._inbox.admit(header, caller)
        except REFUSALS as exc:
            code, message, _ = refusal_of(exc)
            _reply(sock, code, message)
            return self._idle_again(conn)
        _reply(sock, _OK)
        buffer = np.empty(admitted.ttype.nbytes, dtype=np.uint8)
        _read_into(sock, as_bytes_view(buffer))
        try:
            value = codec.from_buffer(admitted.ttype, buffer, admitted.where)
            self._inbox.deliver(admitted, value)
        except REFUSALS as exc:
            code, message, _ = refusal_of(exc)
            _reply(sock, code, message)
            return self._idle_again(conn)
        _reply(sock, _OK)
        return self._idle_again(conn)

    def _idle_again(self, conn: _Connection) -> bool:
        with self._lock:
            conn.idle = not self._stopped
            return conn.idle
