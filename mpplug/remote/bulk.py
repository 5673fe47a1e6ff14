"""The bulk data plane: a value for a party with a bulk port goes party to party over a TCP
(with the cluster's mutual TLS) connection of its own, from the sender's array into the
receiver's buffer.

Python gRPC copies a streamed value several times on each side and moves well under what the
socket can; here each byte crosses the kernel once each way, and a small value (an `mp.mpc`
round's) waits about half as long as a unary gRPC call. Connections stay open and are reused,
one value at a time each. Per value over EAGER_BYTES, integers big-endian:

    sender:   b"MPB1", header length (u32), a serialized PeerHeader
    receiver: status (u8, a grpc.StatusCode number), message length (u32), message (UTF-8):
              OK is the go-ahead; any other status refuses the value and the connection goes on
    sender:   the header type's nbytes of raw value bytes, nothing more
    receiver: status, message: OK once the value is in the mailbox

A value of EAGER_BYTES or less (an `mp.mpc` round's, mostly) takes one round trip, not two:

    sender:   b"MPB2", header length (u32), a serialized PeerHeader, then at once the value's
              nbytes (at most EAGER_BYTES) of raw bytes
    receiver: status, message: OK once the value is in the mailbox; any other status refuses
              the value, whose bytes the receiver then drops until the sender closes

and its sender may read that answer later (`send(..., answer_later=True)`, then `settle`),
before anything else goes over the link: it goes on with its execution while the value
travels, so a round of `mp.mpc` costs one way across the network, not a round trip.

The receiver checks a value exactly as PeerService does (who may send, ids, type, room) before
it keeps a byte of it. With TLS each end's certificate must be signed by the cluster CA and
name the party the other end expects: the sender checks that it reached the party it dials,
the receiver that the value claims to come from the party that connected.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
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

from mpplug.config import ClusterSpec, TLSFiles, split_endpoint
from mpplug.core import TensorType
from mpplug.core.memory import fresh_bytes
from mpplug.protos import service_pb2 as pb
from mpplug.protos import values_pb2
from mpplug.remote.rpc import REFUSALS, BadRequest, refusal_of
from mpplug.remote.streaming import as_bytes_view
from mpplug.runtime import codec
from mpplug.runtime.communicator import Key

log = logging.getLogger(__name__)

MAGIC = b"MPB1"
EAGER = b"MPB2"
EAGER_BYTES = 1 << 20
"""The largest value sent with its header, before the receiver admits it (a refused one costs
the sender a new connection; a larger one waits for the go-ahead)."""
_REQUEST = struct.Struct(">4sI")
_REPLY = struct.Struct(">BI")
MAX_HEADER_BYTES = 1 << 16
"""The longest PeerHeader a receiver reads (a real one is well under a kilobyte)."""
READ_AHEAD_BYTES = MAX_HEADER_BYTES + _REQUEST.size
"""What a receiver reads at once: a request and a small value's bytes, often in one call."""
JOINED_BYTES = 1 << 16
"""A sender writes an eager value of at most this many bytes with its header in one call."""
MAX_REPLY_BYTES = 1 << 14
"""The longest reply message a sender reads (refusals are cut to 1024 characters)."""
SLICE_BYTES = 8 << 20
"""A sender checks its deadline and the link's progress every this many bytes."""
IDLE_LINKS_PER_PEER = 2
"""Open connections a sender keeps per peer between values."""
IDLE_CONNECTION_S = 300.0
"""A receiver closes a connection that brings no value for this long."""
KEPT_LINK_S = IDLE_CONNECTION_S / 2
"""A sender drops a kept connection idle for this long rather than race the receiver's close."""
HANDSHAKE_S = 10.0
"""The longest a receiver waits for a TLS handshake (or the stall limit, if shorter)."""
CONNECT_POLL_MS = 50
"""How often a connecting sender looks whether its send was cancelled."""
ACCEPT_RETRY_S = 0.1
"""The pause after accept fails (out of file descriptors, say) before accepting again."""

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
    header: values_pb2.TensorType


class Inbox(Protocol):
    """Where values go: PeerServicer checks and delivers them, for PeerService and here.
    `admit` reserves room for the value; `deliver` or `release` gives it back."""

    def check_caller(self, caller: str | None) -> None: ...

    def admit(self, header: pb.PeerHeader, caller: str | None) -> Admitted: ...

    def deliver(self, admitted: Admitted, value: Any) -> None: ...

    def release(self, admitted: Admitted) -> None: ...


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
def _read_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes; ConnectionError if the connection ends first."""
    data = bytearray()
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
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


def _drain(sock: socket.socket) -> None:
    """Read and drop what a sender still sends after its eager value was refused (at most
    EAGER_BYTES), until it closes the connection, so that the refusal reaches it whole."""
    left = EAGER_BYTES
    with contextlib.suppress(OSError):
        while left > 0:
            got = sock.recv(min(left, 1 << 16))
            if not got:
                return
            left -= len(got)


def _reply(sock: socket.socket, code: grpc.StatusCode, message: str = "") -> None:
    data = message.encode()[:MAX_REPLY_BYTES]
    sock.sendall(_REPLY.pack(code.value[0], len(data)) + data)


def _read_reply(sock: socket.socket) -> tuple[grpc.StatusCode, str]:
    number, length = _REPLY.unpack(_read_exact(sock, _REPLY.size))
    if length > MAX_REPLY_BYTES:
        raise ConnectionError(f"a reply of {length} bytes, over the {MAX_REPLY_BYTES} allowed")
    message = _read_exact(sock, length)
    code = _STATUS.get(number)
    if code is None:
        raise ConnectionError(f"a reply with status {number}, which is no gRPC status code")
    return code, message.decode(errors="replace")


# -- sending --------------------------------------------------------------------------------
class DeadlinePassed(TimeoutError):
    """A send's whole deadline passed (a stall alone is a plain TimeoutError)."""


def _keep_alive(sock: socket.socket, idle_s: float) -> None:
    """Probe an idle connection after `idle_s`, so a peer gone without a word (a host lost, a
    NAT that forgot the connection) is noticed by the kernel."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    seconds = max(1, int(idle_s))
    for option, value in (
        ("TCP_KEEPIDLE", seconds),
        ("TCP_KEEPINTVL", seconds),
        ("TCP_KEEPCNT", 3),
    ):
        if hasattr(socket, option):  # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class Link:
    """A connection to party `rank`'s bulk listener, opened by its first `send`; `cancel`
    cuts it from any thread, while it connects, shakes hands or moves bytes."""

    def __init__(self, rank: int, name: str, address: tuple[str, int]) -> None:
        self.rank = rank
        self.name = name
        self.address = address
        self.sock: socket.socket | None = None
        self.reused = False
        self.cancelled = False
        self.idle_since = 0.0
        self.owed_until: float | None = None
        """The deadline of the value sent whose answer is not read yet, if one is."""

    def cancel(self) -> None:
        self.cancelled = True
        if self.sock is not None:
            _cut_off(self.sock)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            _cut_off(sock)
            sock.close()

    def idle_and_open(self) -> bool:
        """Whether the connection is still usable: an idle link has nothing to read, so one
        with an event was closed (or written to) by the other end."""
        if self.sock is None or self.owed_until is not None:
            return False
        poller = select.poll()
        poller.register(self.sock, select.POLLIN | select.POLLPRI)
        return not poller.poll(0)

    def send(
        self,
        header: bytes,
        payload: memoryview,
        give_up: float,
        stall_s: float,
        context: ssl.SSLContext | None,
        *,
        answer_later: bool = False,
    ) -> None:
        """Connect if not connected, offer the value, then move its bytes once the receiver
        says go ahead. Refused if it says otherwise (the link stays usable); OSError if the
        connection fails or stalls for `stall_s` (DeadlinePassed once `give_up` passes).
        With `answer_later`, a value of EAGER_BYTES or less returns once written: `settle`
        reads its answer."""
        assert self.owed_until is None, "settle the value sent before sending another"
        if self.sock is None:
            self._connect(give_up, stall_s, context)
        sock = self.sock
        assert sock is not None
        self._wait(sock, give_up, stall_s)
        if len(payload) <= EAGER_BYTES:
            request = _REQUEST.pack(EAGER, len(header)) + header
            if len(payload) <= JOINED_BYTES:  # one write, which the receiver reads at once
                sock.sendall(b"".join((request, payload)))
            else:
                sock.sendall(request)
                sock.sendall(payload)
            self.owed_until = give_up
            if not answer_later:
                self.settle(stall_s)
            return
        sock.sendall(_REQUEST.pack(MAGIC, len(header)) + header)
        self._answer(sock, give_up, stall_s)
        self.reused = False  # a failure from here on is no stale connection: the value is offered
        for start in range(0, len(payload), SLICE_BYTES):
            self._wait(sock, give_up, stall_s)
            sock.sendall(payload[start : start + SLICE_BYTES])
        self._answer(sock, give_up, stall_s)

    def settle(self, stall_s: float) -> None:
        """Read the answer to the eager value sent last, if not read yet: Refused (and the
        link closed, as the receiver closes it) or OSError as `send` would fail."""
        give_up, self.owed_until = self.owed_until, None
        if give_up is None:
            return
        if self.sock is None:
            raise ConnectionAbortedError("the link was closed before its answer came")
        try:
            self._answer(self.sock, give_up, stall_s)
        except Refused:
            self.close()
            raise

    def _connect(self, give_up: float, stall_s: float, context: ssl.SSLContext | None) -> None:
        family, kind, proto, _, address = socket.getaddrinfo(
            *self.address, type=socket.SOCK_STREAM
        )[0]
        sock = socket.socket(family, kind, proto)
        self.sock = sock
        if self.cancelled:
            raise ConnectionAbortedError("the send was cancelled")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keep_alive(sock, stall_s / 4)
        sock.setblocking(False)
        error = sock.connect_ex(address)
        if error not in (0, errno.EINPROGRESS):
            raise OSError(error, os.strerror(error))
        poller = select.poll()
        poller.register(sock, select.POLLOUT)
        while not poller.poll(CONNECT_POLL_MS):  # a cancel cannot cut a connect short
            if self.cancelled:
                raise ConnectionAbortedError("the send was cancelled")
            self._wait(sock, give_up, stall_s)
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            raise OSError(error, os.strerror(error))
        if context is not None:
            sock.setblocking(True)
            self.sock = sock = context.wrap_socket(sock, do_handshake_on_connect=False)
            if self.cancelled:
                raise ConnectionAbortedError("the send was cancelled")
            self._wait(sock, give_up, stall_s)
            sock.do_handshake()
            if common_name(sock) != self.name:
                raise ssl.SSLError(
                    f"the bulk listener at {self.address[0]}:{self.address[1]} presented a "
                    f"certificate naming {common_name(sock)!r}, not party {self.name!r}"
                )

    @staticmethod
    def _wait(sock: socket.socket, give_up: float, stall_s: float) -> None:
        left = give_up - time.monotonic()
        if left <= 0:
            raise DeadlinePassed("the send's deadline passed")
        timeout = min(left, stall_s)
        if sock.gettimeout() != timeout:  # setting it is a system call
            sock.settimeout(timeout)

    def _answer(self, sock: socket.socket, give_up: float, stall_s: float) -> None:
        self._wait(sock, give_up, stall_s)
        code, message = _read_reply(sock)
        if code is not _OK:
            raise Refused(code, message)


class Links:
    """Connections from this party to the other parties' bulk listeners, opened on first use
    and kept (up to IDLE_LINKS_PER_PEER per peer, for up to KEPT_LINK_S) for the next values."""

    def __init__(self, spec: ClusterSpec, tls: TLSFiles | None) -> None:
        self._spec = spec
        self.context = client_context(tls) if tls is not None else None
        self._idle: dict[int, list[Link]] = {}
        self._small: dict[int, int] = {}
        """Values of one chunk or less on their way to each peer over a link."""
        self._lock = threading.Lock()
        self._closed = False

    def reaches(self, rank: int) -> bool:
        """Whether party `rank` takes values over a bulk connection."""
        return self._spec.parties[rank].bulk is not None

    def take(self, rank: int) -> Link:
        """A link to party `rank`: a kept one still open, or a new one (connected by its
        first send)."""
        stale = time.monotonic() - KEPT_LINK_S
        with self._lock:
            idle = self._idle.get(rank, [])
            while idle:
                link = idle.pop()
                if link.idle_since > stale and link.idle_and_open():
                    link.reused = True
                    return link
                link.close()
        party = self._spec.parties[rank]
        assert party.bulk is not None
        return Link(rank, party.name, split_endpoint(party.bulk, f"party {party.name} bulk"))

    def take_small(self, rank: int) -> Link | None:
        """A link for a value of one chunk or less (`release_small` once it is sent), or None
        while IDLE_LINKS_PER_PEER such values to `rank` are on their way already: the caller
        sends it over gRPC instead, so concurrent executions reuse the kept links and never
        open connections to drop them after one value."""
        with self._lock:
            if self._small.get(rank, 0) >= IDLE_LINKS_PER_PEER:
                return None
            self._small[rank] = self._small.get(rank, 0) + 1
        return self.take(rank)

    def release_small(self, rank: int) -> None:
        with self._lock:
            self._small[rank] -= 1

    def give_back(self, link: Link) -> None:
        """Keep `link` for the next value to its party (or close it if enough are kept)."""
        link.idle_since = time.monotonic()
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
    """An accepted connection, and what was read from it ahead of its use (a request's
    header and a small value arrive together: one read takes both); `idle_since` is None
    while it moves a value."""

    __slots__ = ("_ahead", "_end", "_start", "idle_since", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.idle_since: float | None = time.monotonic()
        self._ahead = bytearray(READ_AHEAD_BYTES)
        self._start = self._end = 0

    def buffered(self) -> int:
        """Bytes read ahead and not used yet (TLS's own decrypted ones included)."""
        pending = self.sock.pending() if isinstance(self.sock, ssl.SSLSocket) else 0
        return self._end - self._start + pending

    def read_ahead(self) -> int:
        """Read what has come (waiting for a byte up to the socket's timeout) after what is
        buffered; 0 if the connection ended."""
        if self._end == len(self._ahead):
            self._to_front()
        got = self.sock.recv_into(memoryview(self._ahead)[self._end :])
        self._end += got
        return got

    def _to_front(self) -> None:
        """Move the bytes not used yet to the front of the buffer."""
        kept = self._end - self._start
        self._ahead[:kept] = self._ahead[self._start : self._end]
        self._start, self._end = 0, kept

    def read(self, size: int) -> bytes:
        """Exactly `size` bytes (at most READ_AHEAD_BYTES); ConnectionError if the connection
        ends first."""
        while self._end - self._start < size:
            if len(self._ahead) - self._start < size:
                self._to_front()
            if not self.read_ahead():
                have = self._end - self._start
                raise ConnectionError(f"connection closed after {have} of {size} bytes")
        data = bytes(self._ahead[self._start : self._start + size])
        self._start += size
        return data

    def read_into(self, buffer: memoryview) -> None:
        """Fill `buffer`: with what was read ahead first, then straight from the socket."""
        have = min(self._end - self._start, len(buffer))
        buffer[:have] = self._ahead[self._start : self._start + have]
        self._start += have
        _read_into(self.sock, buffer[have:])


class Listener:
    """A party's bulk listener: a thread accepting connections and one serving each.

    At most `connections` are open at once; one more closes the one idle for longest
    (a TLS handshake not yet done counts as idle) to make room, or is closed itself if all
    are moving values. A connection that stalls for `stall_s` mid-value, or brings nothing
    for IDLE_CONNECTION_S, is closed.
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
        if host == "::" and socket.has_dualstack_ipv6():
            server = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            server = socket.create_server((host, port), family=family)
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
        _cut_off(self._server)
        self._server.close()
        for sock in cut:
            _cut_off(sock)
        if self._acceptor.is_alive():
            self._acceptor.join()
        with self._lock:  # no thread starts once the acceptor has ended
            threads = list(self._threads)
        for thread in threads:
            thread.join()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError as exc:
                if self._stopped:
                    return
                log.warning("party %s: accepting a bulk connection failed: %s", self._name, exc)
                time.sleep(ACCEPT_RETRY_S)  # out of file descriptors, say: let some close
                continue
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        with self._lock:
            if self._stopped or not self._make_room():
                if not self._stopped:
                    log.warning(
                        "party %s: refused a bulk connection: all %d are moving values",
                        self._name,
                        self._limit,
                    )
                sock.close()
                return
            conn = _Connection(sock)
            thread = threading.Thread(
                target=self._serve,
                args=(conn,),
                name=f"mpplug-{self._name}-bulk-in",
                daemon=True,
            )
            try:
                thread.start()
            except RuntimeError as exc:  # no more threads
                log.warning("party %s: refused a bulk connection: %s", self._name, exc)
                sock.close()
                return
            self._open[id(conn)] = conn
            self._threads = {t for t in self._threads if t.is_alive()}  # stop joins the rest
            self._threads.add(thread)

    def _make_room(self) -> bool:
        """With the lock held: whether one more connection may open, closing the one idle
        for longest if the limit is reached."""
        if len(self._open) < self._limit:
            return True
        idle = [conn for conn in self._open.values() if conn.idle_since is not None]
        if not idle:
            return False
        oldest = min(idle, key=lambda conn: conn.idle_since or 0.0)
        oldest.idle_since = None  # its thread sees the connection end
        _cut_off(oldest.sock)
        return True

    def _serve(self, conn: _Connection) -> None:
        try:
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keep_alive(conn.sock, self._stall_s / 4)
            if self._context is not None:
                self._shake_hands(conn)
            caller = common_name(conn.sock)
            conn.sock.settimeout(self._stall_s)  # mid-value; between values, `idle` waits
            try:
                self._inbox.check_caller(caller)
            except REFUSALS as exc:
                code, message, _ = refusal_of(exc)
                _reply(conn.sock, code, message)
                return
            idle = select.poll()
            idle.register(conn.sock, select.POLLIN | select.POLLPRI)
            while self._take_value(conn, caller, idle):
                pass
        except (OSError, ValueError) as exc:  # the connection failed, stalled or was cut
            log.debug("party %s: bulk connection ended: %s", self._name, exc)
        except Exception:
            log.exception("party %s: bulk connection failed", self._name)
        finally:
            with self._lock:
                self._open.pop(id(conn), None)
            _cut_off(conn.sock)
            conn.sock.close()

    def _shake_hands(self, conn: _Connection) -> None:
        """Wrap the connection in TLS first, so that a cut from another thread reaches the
        handshake, then shake hands within HANDSHAKE_S."""
        assert self._context is not None
        wrapped = self._context.wrap_socket(
            conn.sock, server_side=True, do_handshake_on_connect=False
        )
        with self._lock:
            conn.sock = wrapped
            if self._stopped or conn.idle_since is None:
                raise ConnectionAbortedError("closed before its handshake")
        wrapped.settimeout(min(HANDSHAKE_S, self._stall_s))
        wrapped.do_handshake()

    def _take_value(self, conn: _Connection, caller: str | None, idle: select.poll) -> bool:
        """Serve one value on `conn` (`idle` polls its socket); False when the connection
        should close."""
        sock = conn.sock
        came = conn.buffered()
        if not came:
            if not idle.poll(IDLE_CONNECTION_S * 1000):
                return False  # nothing came for IDLE_CONNECTION_S
            came = conn.read_ahead()
        with self._lock:
            if not came or conn.idle_since is None or self._stopped:
                return False  # closed by the peer, to make room, or by stop
            conn.idle_since = None
        magic, length = _REQUEST.unpack(conn.read(_REQUEST.size))
        if magic not in (MAGIC, EAGER):
            message = f"expected {MAGIC!r} or {EAGER!r}, got {magic!r}"
            _reply(sock, grpc.StatusCode.INVALID_ARGUMENT, message)
            return False
        if length > MAX_HEADER_BYTES:
            message = f"a header of {length} bytes, over the {MAX_HEADER_BYTES} allowed"
            _reply(sock, grpc.StatusCode.INVALID_ARGUMENT, message)
            return False
        raw = conn.read(length)
        eager = magic == EAGER
        try:
            try:
                header = pb.PeerHeader.FromString(raw)
            except DecodeError as exc:
                raise BadRequest(f"the header does not decode as a PeerHeader: {exc}") from None
            admitted = self._inbox.admit(header, caller)
            if eager and admitted.ttype.nbytes > EAGER_BYTES:
                self._inbox.release(admitted)
                raise BadRequest(
                    f"{admitted.where}: {admitted.ttype.nbytes} bytes sent with their header, "
                    f"over the {EAGER_BYTES} allowed"
                )
        except REFUSALS as exc:
            code, message, _ = refusal_of(exc)
            _reply(sock, code, message)
            return self._after_refusal(conn, eager)
        try:
            value = self._receive(conn, admitted, eager)
        except BaseException:
            self._inbox.release(admitted)
            raise
        if value is None:
            return self._after_refusal(conn, eager)
        self._inbox.deliver(admitted, value)
        _reply(sock, _OK)
        return self._idle_again(conn)

    def _receive(
        self, conn: _Connection, admitted: Admitted, eager: bool
    ) -> np.ndarray[Any, Any] | None:
        """The admitted value's bytes, read into a buffer of their size (once the sender is
        told to go ahead, unless they came `eager`ly with the header); None (and the sender
        told why) if no buffer can be had."""
        try:
            buffer = fresh_bytes(admitted.ttype.nbytes)
        except MemoryError:
            message = f"{admitted.where}: no memory for its {admitted.ttype.nbytes} bytes"
            _reply(conn.sock, grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            self._inbox.release(admitted)
            return None
        if not eager:
            _reply(conn.sock, _OK)
        conn.read_into(as_bytes_view(buffer))
        value = codec.from_buffer(admitted.ttype, buffer, admitted.where)
        return codec.finish(admitted.header, value, admitted.where)

    def _after_refusal(self, conn: _Connection, eager: bool) -> bool:
        """Whether `conn` goes on after a refused value: not after an eager one, whose bytes
        follow (they are let come until the sender closes)."""
        if eager:
            _drain(conn.sock)
            return False
        return self._idle_again(conn)

    def _idle_again(self, conn: _Connection) -> bool:
        with self._lock:
            if self._stopped:
                return False
            conn.idle_since = time.monotonic()
            return True
