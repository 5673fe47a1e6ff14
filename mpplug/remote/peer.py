"""The party-to-party data plane: a gRPC `Communicator` and the peer service feeding its mailbox.

A send streams the tensor straight to the destination's PeerService (or, to a party with a
bulk port, over a bulk connection: mpplug.remote.bulk), which validates it and delivers it
into that party's Mailbox; the driver never relays values. A send whose
connection fails is tried again on a new one until its deadline. Sends in flight for an
execution are cancelled when it is aborted, so a dead peer does not hold the party until the
send's deadline.

A small value over a bulk connection is sent ahead: the execution goes on while it travels,
and its answer is read before the execution's next value to that peer (which reuses the
connection) or at `settle`, which a party calls before it reports an execution done. A value
refused is reported then, under its own key; one whose connection failed is sent again.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import grpc

from mpplug.config import ClusterSpec, TLSFiles
from mpplug.core.validate import MAX_REGION_DEPTH
from mpplug.errors import ExecutionAborted, PartyUnavailableError, WireError
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.bulk import EAGER_BYTES, Admitted, DeadlinePassed, Link, Links, Refused
from mpplug.remote.channels import keepalive_for, open_channel
from mpplug.remote.limits import Slots, StreamWatch
from mpplug.remote.rpc import (
    BadRequest,
    Exhausted,
    Forbidden,
    check_scoped_id,
    handle_errors,
    raw_stub,
    status_of,
)
from mpplug.remote.streaming import (
    as_bytes_view,
    encode_chunks,
    fits_one_chunk,
    read_chunks,
    receive_tensor,
    transfer_deadline,
)
from mpplug.remote.tls import channel_credentials, peer_common_name
from mpplug.runtime import codec
from mpplug.runtime.communicator import ABORTED_MEMORY, Communicator, Key, Mailbox, MailboxFull

PEER_SERVICE = pb.DESCRIPTOR.services_by_name["PeerService"]

_UNREACHED = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # still busy at the deadline
)

_RETRIED = (
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # the receiver is busy
    # The connection failed: the receiver restarted, or the connection died while the network
    # was down and is only found dead now that it is used again. The next try dials anew. A
    # value delivered twice goes under the same key; one left over is dropped when the
    # execution ends.
    grpc.StatusCode.UNAVAILABLE,
)


class _Failed(Exception):
    """One try at a send failed with `code`, as a PeerService call would."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class _Cancellable(Protocol):
    def cancel(self) -> Any: ...


RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0
"""A send answered with one of _RETRIED is retried, waiting from RETRY_FIRST_S doubling up to
RETRY_MAX_S between tries, until its deadline."""


@dataclass
class _Kept:
    """A bulk link an execution keeps to one peer, and the value last sent ahead on it whose
    answer is not read yet (kept to send again), if any."""

    link: Link
    key: Key | None = None
    header: pb.PeerHeader | None = None
    array: Any = None
    give_up: float = 0.0


class PeerCommunicator(Communicator):
    """Sends through each peer's PeerService (channels opened on first use, then reused);
    receives from the local mailbox that this party's PeerServicer fills."""

    def __init__(
        self,
        spec: ClusterSpec,
        rank: int,
        mailbox: Mailbox,
        *,
        tls: TLSFiles | None,
        timeout: float,
    ) -> None:
        self.rank = rank
        self.world_size = spec.world_size
        self.timeout = timeout
        self._spec = spec
        self._mailbox = mailbox
        self._credentials = channel_credentials(tls) if tls is not None else None
        self._channels: dict[int, grpc.Channel] = {}
        self._peers: dict[int, SimpleNamespace] = {}
        self._lock = threading.Lock()
        self._links = Links(spec, tls)
        self._sending: dict[str, set[_Cancellable]] = {}
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._cond = threading.Condition()
        self._kept: dict[str, dict[int, list[_Kept]]] = {}
        """The bulk links each execution keeps to each peer for its small values."""

    def send(self, key: Key, value: Any) -> None:
        """Deliver `value` to party `key.dst`; a small one over a bulk link returns once
        written (`settle` waits for its answer)."""
        kept = self._take_kept(key.exec_id, key.dst)
        value_type, array = codec.encode(value)
        header = pb.PeerHeader(
            exec_id=key.exec_id,
            op=key.op,
            src=key.src,
            dst=key.dst,
            type=value_type,
            scope=key.scope,
        )
        give_up = time.monotonic() + transfer_deadline(self.timeout, array.nbytes)
        small = fits_one_chunk(array.nbytes) and array.nbytes <= EAGER_BYTES
        if small and self._links.reaches(key.dst):
            kept = kept or self._new_kept(key.dst)
            if kept is not None and self._sent_ahead(kept, key, header, array, give_up):
                self._put_kept(key.exec_id, key.dst, kept)
                return
        elif kept is not None:
            self._put_kept(key.exec_id, key.dst, kept)
        self._deliver(key, header, array, give_up)

    def settle(self, exec_id: str) -> None:
        """Wait for the answers to the values `exec_id` sent ahead; raise as `send` would."""
        with self._cond:
            held = self._kept.pop(exec_id, {})
        left = [(dst, kept) for dst, kepts in held.items() for kept in kepts]
        try:
            while left:
                dst, kept = left.pop()
                settled = self._settle(exec_id, dst, kept)
                if settled is not None:
                    self._put_kept(exec_id, dst, settled)
        finally:
            for dst, kept in left:  # `finish` lets them go
                self._put_kept(exec_id, dst, kept)

    def _take_kept(self, exec_id: str, dst: int) -> _Kept | None:
        """A link the execution keeps to `dst`, for this thread alone, its answer read."""
        with self._cond:
            kepts = self._kept.get(exec_id, {}).get(dst)
            if not kepts:
                return None
            kept = kepts.pop()
        return self._settle(exec_id, dst, kept)

    def _put_kept(self, exec_id: str, dst: int, kept: _Kept) -> None:
        with self._cond:
            self._kept.setdefault(exec_id, {}).setdefault(dst, []).append(kept)

    def _new_kept(self, dst: int) -> _Kept | None:
        link = self._links.take_small(dst)
        return _Kept(link) if link is not None else None

    def _let_go(self, kept: _Kept, dst: int) -> None:
        """Give a kept link back to the idle ones (closed if an answer on it is unread)."""
        if kept.key is None and kept.link.sock is not None:
            self._links.give_back(kept.link)
        else:
            kept.link.close()
        self._links.release_small(dst)

    def _sent_ahead(
        self, kept: _Kept, key: Key, header: pb.PeerHeader, array: Any, give_up: float
    ) -> bool:
        """Write a small value on `kept` without waiting for its answer; False if the write
        failed before the value went (the caller sends it as usual)."""
        link = kept.link
        try:
            self._track(key, link)
        except ExecutionAborted:
            self._let_go(kept, key.dst)
            raise
        try:
            link.send(
                header.SerializeToString(),
                as_bytes_view(array),
                give_up,
                self.timeout,
                self._links.context,
                answer_later=True,
            )
        except BaseException as exc:
            self._untrack(key.exec_id, link)
            link.close()
            self._let_go(kept, key.dst)
            if link.cancelled or key.exec_id in self._cancelled:
                raise self._aborted(key) from None
            if isinstance(exc, (OSError, ssl.SSLError)):
                return False
            raise
        kept.key, kept.header, kept.array, kept.give_up = key, header, array, give_up
        return True

    def _settle(self, exec_id: str, dst: int, kept: _Kept) -> _Kept | None:
        """Read the answer to the value sent ahead on `kept`, if any: `kept` once it is taken;
        a refusal raises as `send` would; a failed connection sends the value again (None)."""
        key, header, array, give_up = kept.key, kept.header, kept.array, kept.give_up
        if key is None or header is None:
            return kept
        kept.key = kept.header = kept.array = None
        refused: Refused | None = None
        try:
            kept.link.settle(self.timeout)
            return kept
        except Refused as exc:
            refused = exc
        except (OSError, ssl.SSLError):
            kept.link.close()
        finally:
            self._untrack(exec_id, kept.link)
        self._let_go(kept, dst)
        if kept.link.cancelled or exec_id in self._cancelled:
            raise self._aborted(key)
        if refused is not None and refused.code not in _RETRIED:
            peer = self._spec.parties[dst].name
            raise WireError(f"party {peer} refused value {key}: {refused}")
        self._deliver(key, header, array, give_up)
        return None

    def _deliver(self, key: Key, header: pb.PeerHeader, array: Any, give_up: float) -> None:
        """Send and wait for the answer, trying again on a new connection until `give_up`."""
        bulk = self._links.reaches(key.dst)
        pause = RETRY_FIRST_S
        while True:
            try:
                if bulk:
                    self._send_bulk(key, header, array, give_up)
                else:
                    self._send_call(key, header, array, give_up)
                return
            except _Failed as exc:
                if exc.code in _RETRIED and self._pause(key, pause, give_up):
                    pause = min(2 * pause, RETRY_MAX_S)
                    continue
                peer = self._spec.parties[key.dst].name
                if exc.code in _UNREACHED:
                    raise PartyUnavailableError(
                        peer, f"party {self.rank} could not send {key}: {exc}"
                    ) from None
                raise WireError(f"party {peer} refused value {key}: {exc}") from None

    def _send_call(self, key: Key, header: pb.PeerHeader, array: Any, give_up: float) -> None:
        """One try over PeerService; _Failed with the call's status if it fails."""
        chunks = encode_chunks(header, array)
        left = max(give_up - time.monotonic(), 0.0)
        service = self._peer(key.dst)
        if fits_one_chunk(array.nbytes):
            call = service.SendSmall.future(next(chunks), timeout=left, wait_for_ready=True)
        else:
            call = service.Send.future(chunks, timeout=left, wait_for_ready=True)
        try:
            self._track(key, call)
            call.result()
        except grpc.FutureCancelledError:
            raise self._aborted(key) from None
        except grpc.RpcError as exc:
            raise _Failed(*status_of(exc)) from None
        finally:
            self._untrack(key.exec_id, call)

    def _send_bulk(self, key: Key, header: pb.PeerHeader, array: Any, give_up: float) -> None:
        """One try over a bulk connection (another at once if a kept one turns out closed
        before it took the value); _Failed as a PeerService call would fail. A value of one
        chunk or less goes over PeerService when the peer's kept links are all busy."""
        head, payload = header.SerializeToString(), as_bytes_view(array)
        small = fits_one_chunk(array.nbytes)
        while True:
            link = self._links.take_small(key.dst) if small else self._links.take(key.dst)
            if link is None:
                self._send_call(key, header, array, give_up)
                return
            try:
                if self._sent_over(link, key, head, payload, give_up):
                    return
            finally:
                if small:
                    self._links.release_small(key.dst)

    def _sent_over(
        self, link: Link, key: Key, head: bytes, payload: memoryview, give_up: float
    ) -> bool:
        """Send over `link`, then keep it; False if it was a kept one found closed before the
        value went (try another)."""
        try:
            self._track(key, link)
            link.send(head, payload, give_up, self.timeout, self._links.context)
        except Refused as exc:
            if link.sock is not None:  # a refused eager value's link is closed, not kept
                self._links.give_back(link)
            raise _Failed(exc.code, exc.details) from None
        except (OSError, ssl.SSLError) as exc:
            link.close()
            if link.cancelled or key.exec_id in self._cancelled:
                raise self._aborted(key) from None
            if link.reused and not isinstance(exc, TimeoutError):
                return False  # closed while kept; the value never went
            code = (
                grpc.StatusCode.DEADLINE_EXCEEDED
                if isinstance(exc, DeadlinePassed)
                else grpc.StatusCode.UNAVAILABLE  # down, cut off or stalled: tried again
            )
            raise _Failed(code, f"bulk connection: {exc or type(exc).__name__}") from None
        except BaseException:
            link.close()
            raise
        finally:
            self._untrack(key.exec_id, link)
        self._links.give_back(link)
        return True

    def recv(self, key: Key, timeout: float) -> Any:
        return self._mailbox.take(key, timeout)

    def check(self, exec_id: str) -> None:
        self._mailbox.check(exec_id)

    def cancel(self, exec_id: str) -> None:
        """Cancel the sends of `exec_id` in flight, and refuse its later ones."""
        with self._cond:
            self._cancelled[exec_id] = None
            while len(self._cancelled) > ABORTED_MEMORY:
                self._cancelled.popitem(last=False)
            calls = self._sending.pop(exec_id, set())
            self._cond.notify_all()
        for call in calls:
            call.cancel()

    def finish(self, exec_id: str) -> None:
        """`exec_id` has ended here: cancel any of its sends still in flight, and give back
        the links it kept (closing those with an answer unread)."""
        with self._cond:
            calls = self._sending.pop(exec_id, set())
            held = self._kept.pop(exec_id, {})
        for call in calls:
            call.cancel()
        for dst, kepts in held.items():
            for kept in kepts:
                self._let_go(kept, dst)

    def _track(self, key: Key, call: _Cancellable) -> None:
        with self._cond:
            if key.exec_id not in self._cancelled:
                self._sending.setdefault(key.exec_id, set()).add(call)
                return
        call.cancel()
        raise self._aborted(key)

    def _untrack(self, exec_id: str, call: _Cancellable) -> None:
        with self._cond:
            calls = self._sending.get(exec_id)
            if calls is not None:
                calls.discard(call)
                if not calls:
                    del self._sending[exec_id]

    def _pause(self, key: Key, seconds: float, give_up: float) -> bool:
        """Wait `seconds` before trying again; False if that would pass `give_up`. Raises
        ExecutionAborted if the execution is cancelled meanwhile."""
        if time.monotonic() + seconds >= give_up:
            return False
        with self._cond:
            if self._cond.wait_for(lambda: key.exec_id in self._cancelled, timeout=seconds):
                raise self._aborted(key)
        return True

    def _aborted(self, key: Key) -> ExecutionAborted:
        return ExecutionAborted(
            f"party {self.rank}: execution {key.exec_id} aborted while sending {key}"
        )

    def _peer(self, rank: int) -> SimpleNamespace:
        """The PeerService of party `rank`, its channel opened on first use."""
        peer = self._peers.get(rank)
        if peer is None:
            with self._lock:
                if rank not in self._peers:
                    channel = open_channel(
                        self._spec.parties[rank].endpoint,
                        self._credentials,
                        keepalive_for(self.timeout),
                    )
                    self._channels[rank] = channel
                    self._peers[rank] = raw_stub(channel, PEER_SERVICE)
                peer = self._peers[rank]
        return peer

    def close(self) -> None:
        with self._cond:
            held = [kept for kepts in self._kept.values() for ks in kepts.values() for kept in ks]
            self._kept.clear()
        for kept in held:
            kept.link.close()
        self._links.close()
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._peers.clear()


class PeerServicer(rpc_pb.PeerServiceServicer):
    """Accepts values sent to this party, checks them and puts them in its mailbox.

    With TLS, only the other parties may send, and the sender's certificate must name the
    party the value claims to come from. Send streams take one of `slots` while open and are
    cancelled by `watch` when they stall.
    """

    RAW_REQUESTS = ("Send", "SendSmall")
    """Methods that read their chunk messages themselves (streaming.read_chunks)."""

    def __init__(
        self,
        spec: ClusterSpec,
        rank: int,
        mailbox: Mailbox,
        *,
        slots: Slots,
        watch: StreamWatch,
    ) -> None:
        self._names = spec.names
        self._tls = spec.tls
        self._rank = rank
        self._mailbox = mailbox
        self._slots = slots
        self._watch = watch

    @handle_errors
    def Send(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> pb.SendReply:
        caller = self._caller(context)
        self._slots.hold_for(context)
        return self._receive(self._watch.watch(context, chunks), caller)

    @handle_errors
    def SendSmall(self, chunk: bytes, context: grpc.ServicerContext) -> pb.SendReply:
        return self._receive(iter([chunk]), self._caller(context))

    def _caller(self, context: grpc.ServicerContext) -> str | None:
        caller = peer_common_name(context) if self._tls else None
        self.check_caller(caller)
        return caller

    def _receive(self, chunks: Iterator[bytes], caller: str | None) -> pb.SendReply:
        header, parts = read_chunks(chunks, pb.PeerChunk, f"value sent to party {self._rank}")
        admitted = self.admit(header, caller)
        try:
            value = receive_tensor(admitted.ttype, parts, admitted.where)
            value = codec.finish(admitted.header, value, admitted.where)
        except BaseException:
            self.release(admitted)
            raise
        self.deliver(admitted, value)
        return pb.SendReply()

    def check_caller(self, caller: str | None) -> None:
        """With TLS, refuse a caller (the CN of its certificate) that is not one of the other
        parties."""
        if not self._tls:
            return
        others = [name for rank, name in enumerate(self._names) if rank != self._rank]
        if caller not in others:
            raise Forbidden(
                f"party {self._rank} accepts values only from the other parties {others}, "
                f"but the caller's certificate names {caller!r}"
            )

    def admit(self, header: pb.PeerHeader, caller: str | None) -> Admitted:
        """The value `header` announces, checked: its ids, that it is for this party and
        comes from the caller, its type, and that its source has room for it here, which is
        reserved for it: `deliver` or `release` it."""
        key = Key(
            check_scoped_id(header.exec_id, "exec_id"),
            header.op,
            header.src,
            header.dst,
            tuple(header.scope),
        )
        where = f"value {key} sent to party {self._rank}"
        if len(key.scope) % 3 or len(key.scope) > 3 * MAX_REGION_DEPTH:
            raise BadRequest(
                f"{where}: expected a scope of (op, region, iteration) triples, at most "
                f"{MAX_REGION_DEPTH} deep, got {len(key.scope)} numbers"
            )
        if key.dst != self._rank:
            raise BadRequest(f"{where}: this is party {self._rank}, not {key.dst}")
        if not (0 <= key.src < len(self._names)) or key.src == self._rank:
            raise BadRequest(
                f"{where}: expected a source among the other parties, got party {key.src}"
            )
        if caller is not None and caller != self._names[key.src]:
            raise Forbidden(
                f"{where}: claims to come from {self._names[key.src]!r}, but the caller's "
                f"certificate names {caller!r}"
            )
        ttype = codec.decode_type(header.type, where)
        try:
            self._mailbox.reserve(key.src, ttype.nbytes, where)
        except MailboxFull:
            raise Exhausted(
                f"{where}: party {key.src} has {self._mailbox.pending_bytes(key.src)} bytes "
                f"waiting here already or on their way; {ttype.nbytes} more would pass the "
                f"limit of {self._mailbox.max_pending_bytes}"
            ) from None
        return Admitted(key, ttype, where, header.type)

    def deliver(self, admitted: Admitted, value: Any) -> None:
        """Put an admitted value in the mailbox for its execution to take."""
        self._mailbox.deliver(admitted.key, value, admitted.ttype.nbytes, reserved=True)

    def release(self, admitted: Admitted) -> None:
        """Give back the room of an admitted value that never came whole."""
        self._mailbox.release(admitted.key.src, admitted.ttype.nbytes)
