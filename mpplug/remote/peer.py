"""The party-to-party data plane: a gRPC `Communicator` and the peer service feeding its mailbox.

A send streams the tensor straight to the destination's PeerService, which validates it and
delivers it into that party's Mailbox; the driver never relays values.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc

from mpplug.config import ClusterSpec, TLSFiles
from mpplug.errors import PartyUnavailableError, WireError
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.channels import keepalive_for, open_channel
from mpplug.remote.rpc import (
    BadRequest,
    Forbidden,
    check_id,
    handle_errors,
    raw_stub,
    status_of,
)
from mpplug.remote.streaming import (
    encode_chunks,
    fits_one_chunk,
    read_chunks,
    receive_tensor,
    transfer_deadline,
)
from mpplug.remote.tls import peer_common_name
from mpplug.runtime import codec
from mpplug.runtime.communicator import Communicator, Key, Mailbox

PEER_SERVICE = pb.DESCRIPTOR.services_by_name["PeerService"]


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
        self._tls = tls
        self._channels: dict[int, grpc.Channel] = {}
        self._peers: dict[int, SimpleNamespace] = {}
        self._lock = threading.Lock()

    def send(self, key: Key, value: Any) -> None:
        array = codec.as_host_array(value)
        header = pb.PeerHeader(
            exec_id=key.exec_id,
            op=key.op,
            src=key.src,
            dst=key.dst,
            type=codec.encode_type(array),
        )
        chunks = encode_chunks(header, array)
        service = self._peer(key.dst)
        deadline = transfer_deadline(self.timeout, array.nbytes)
        try:
            if fits_one_chunk(array.nbytes):
                service.SendSmall(next(chunks), timeout=deadline, wait_for_ready=True)
            else:
                service.Send(chunks, timeout=deadline, wait_for_ready=True)
        except grpc.RpcError as exc:
            peer = self._spec.parties[key.dst].name
            code, details = status_of(exc)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise PartyUnavailableError(
                    peer, f"party {self.rank} could not send {key}: {code.name}: {details}"
                ) from None
            raise WireError(f"party {peer} refused value {key}: {code.name}: {details}") from None

    def recv(self, key: Key, timeout: float) -> Any:
        return self._mailbox.take(key, timeout)

    def _peer(self, rank: int) -> SimpleNamespace:
        """The PeerService of party `rank`, its channel opened on first use."""
        peer = self._peers.get(rank)
        if peer is None:
            with self._lock:
                if rank not in self._peers:
                    channel = open_channel(
                        self._spec.parties[rank].endpoint, self._tls, keepalive_for(self.timeout)
                    )
                    self._channels[rank] = channel
                    self._peers[rank] = raw_stub(channel, PEER_SERVICE)
                peer = self._peers[rank]
        return peer

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._peers.clear()


class PeerServicer(rpc_pb.PeerServiceServicer):
    """Accepts values sent to this party, checks them and puts them in its mailbox.

    With TLS, the sender's certificate must name the party the value claims to come from.
    """

    RAW_REQUESTS = ("Send", "SendSmall")
    """Methods that read their chunk messages themselves (streaming.read_chunks)."""

    def __init__(self, spec: ClusterSpec, rank: int, mailbox: Mailbox) -> None:
        self._names = spec.names
        self._tls = spec.tls
        self._rank = rank
        self._mailbox = mailbox

    @handle_errors
    def Send(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> pb.SendReply:
        return self._receive(chunks, context)

    @handle_errors
    def SendSmall(self, chunk: bytes, context: grpc.ServicerContext) -> pb.SendReply:
        return self._receive(iter([chunk]), context)

    def _receive(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> pb.SendReply:
        where = f"value sent to party {self._rank}"
        header, parts = read_chunks(chunks, pb.PeerChunk, where)
        key = Key(check_id(header.exec_id, "exec_id"), header.op, header.src, header.dst)
        where = f"value {key} sent to party {self._rank}"
        if key.dst != self._rank:
            raise BadRequest(f"{where}: this is party {self._rank}, not {key.dst}")
        if not (0 <= key.src < len(self._names)) or key.src == self._rank:
            raise BadRequest(
                f"{where}: expected a source among the other parties, got party {key.src}"
            )
        if self._tls:
            caller = peer_common_name(context)
            if caller != self._names[key.src]:
                raise Forbidden(
                    f"{where}: claims to come from {self._names[key.src]!r}, but the caller's "
                    f"certificate names {caller!r}"
                )
        ttype = codec.decode_type(header.type, where)
        value = receive_tensor(ttype, parts, where)
        self._mailbox.deliver(key, value)
        return pb.SendReply()
