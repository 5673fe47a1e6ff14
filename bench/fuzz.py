"""A hostile caller for party servers: fuzzed requests to every gRPC method of a real 3-party
cluster and to each party's bulk port, each answer classified, and the parties' memory measured
as the fuzzing ends and expires.

Run `python -m bench.fuzz [--tls] [--requests N]` from the repository root. Each answer is
"ok" (a reply), "typed" (a status naming what was wrong), "cut" (a call allowed to wait, such
as a stalled stream, cut off by the fuzzer's own short deadline), "untyped" (UNKNOWN,
"Exception calling application", INTERNAL, an answer too long to reach the caller...), the
health service's own deserializer failing, counted apart, a "hang" (a call that should answer
at once, unanswered at the deadline) or a "crash" (a party exited).

Bulk port connections (mpplug.remote.bulk) are tallied as "Bulk/Value", each by its most
serious answer: a reply with a gRPC status code and a message is "typed" (OK is "ok"); the
connection closed without a reply is "typed" only where the fuzzer hung up mid-frame or
mid-value itself (nothing is left to answer) or the caller's certificate is foreign (refused at
the TLS handshake), else "untyped", as are a reply a sender cannot read and an OK to a caller
the port must refuse; silence is "cut" after a stall, else a "hang".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import random
import re
import socket
import ssl
import struct
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import grpc
import numpy as np
import yaml
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2

import mpplug as mp
from bench.timing import Target, verdict
from mpplug.config import ClusterSpec, TLSFiles, split_endpoint
from mpplug.core import DType, TensorType
from mpplug.core.serde import tensor_type_to_proto
from mpplug.core.validate import MAX_REGION_DEPTH
from mpplug.protos import service_pb2 as pb
from mpplug.protos import values_pb2
from mpplug.remote.bulk import MAGIC, MAX_HEADER_BYTES, MAX_REPLY_BYTES, client_context
from mpplug.remote.certs import with_tls, write_dev_certs
from mpplug.remote.driver import Driver
from mpplug.remote.launch import LocalParties
from mpplug.remote.rpc import WIRE_VERSION, raw_stub, status_of
from mpplug.remote.server import UPKEEP_MAX_S
from mpplug.remote.service import MAX_FETCH_NAMES, MAX_TIMEOUT_S
from mpplug.remote.streaming import varint
from mpplug.remote.tls import channel_credentials

DEFAULT_REQUESTS = 10_000
IDLE_TIMEOUT_S = 3.0
"""The parties' session idle timeout: short, so that abandoned sessions expire in the run."""
DEADLINE_S = 30.0
"""A call that should answer at once and has not within this is a hang (generous: the
slowest answers, such as 4096 values in one FetchMany, take seconds on a loaded machine; the
table reports each method's slowest answer)."""
STALL_S = 0.5
"""The deadline that cuts a stalled request stream."""
WAIT_S = 3.0
"""The deadline of calls that may rightly wait longer (executions asking for long receives,
damaged programs that may loop)."""
RECEIVE_S = 0.1
"""The receive timeout of the fuzzer's executions: those waiting for a peer end this soon."""
CONCURRENCY = 16
GROWTH_LIMIT_MIB = 64
EXPIRED_LIMIT_MIB = 16

WORLD = 3
DATASET = "table"
SESSION_PREFIX = "fuzz"
STATE_VALUES = {"s-f32": TensorType("float32"), "s-vec": TensorType("float32", (4,))}
WRONG_VALUE = ("s-i32", TensorType("int32", (3,)))
PUT_NAMES = tuple(f"v{i}" for i in range(16))
OUT_NAMES = tuple(f"o{i}" for i in range(16))
ABANDONED_VALUE_BYTES = 256 << 10
"""Each abandoned session holds two values of this size until it expires."""
MAX_FUZZ_MESSAGE = 3 << 20
BIG_VALUE_BYTES = (3 << 20) // 2
"""1.5 MiB: two chunks over gRPC, or a value over the bulk port."""

OK, TYPED, CUT, UNTYPED, HANG, CRASH = "ok", "typed", "cut", "untyped", "hang", "crash"
HEALTH_INTERNAL = "health INTERNAL (gRPC's deserializer)"
KINDS = (OK, TYPED, CUT, UNTYPED, HEALTH_INTERNAL, HANG, CRASH)
DEFECTS = (UNTYPED, HANG, CRASH)
TYPED_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.ABORTED,
    }
)

UNTYPED_SIGNS = (
    "Exception calling application",
    "Exception iterating",
    "received metadata size exceeds",  # the party's answer was too long for the caller to read
)

DRIVER, PEER, OUTSIDER = "driver", "peer", "outsider"
"""Who calls: with TLS the driver's certificate, another party's, or one from a foreign CA."""

SERVICES = {
    "PartyService": pb.DESCRIPTOR.services_by_name["PartyService"],
    "PeerService": pb.DESCRIPTOR.services_by_name["PeerService"],
    "Health": health_pb2.DESCRIPTOR.services_by_name["Health"],
}
METHODS = {f"{s}/{m.name}": m for s, d in SERVICES.items() for m in d.methods}

# -- hostile values ------------------------------------------------------------------------
# fmt: off
HOSTILE_STRINGS = (
    "", " ", "x" * 65, "x" * 257, "x" * 70_000, "\x00", "a\x00b", "../../etc/passwd", "é" * 40,
    "\U0001f4a5", ":", "a:b:c", "%s%n%x", "-", "_" * 64, "fuzz:fuzz",
)
SHORT_STRINGS = tuple(s for s in HOSTILE_STRINGS if len(s) < 300)
UINT32_VALUES = (0, 1, 2, 3, 4, 255, 2**31 - 1, 2**31, 2**32 - 1)
UINT64_VALUES = (*UINT32_VALUES, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
INT32_VALUES = (0, 1, -1, 2**31 - 1, -(2**31))
INT64_VALUES = (0, 1, -1, 2**32, 2**62, -(2**62), 2**63 - 1, -(2**63))
DOUBLE_VALUES = (
    0.0, -0.0, -1.0, 5e-324, 1e-300, 1e300, math.inf, -math.inf, math.nan, MAX_TIMEOUT_S,
    MAX_TIMEOUT_S + 1, 0.25,
)
ENUM_VALUES = (0, 16, 17, 99, 2**31 - 1, -1)
ABSURD_SHAPES = (
    [2**63 - 1], [2**62, 2**62, 0], [0, 2**62, 2**62], [2**63 - 1, 0], [0, 2**63 - 1], [-1],
    [-(2**63)], [2**31, 2**31], [1 << 40], [3, -2], [1] * 33, [0] * 33, [2**32, 2**32, 0],
    [4, 2**61], [2**34], [2**32, 4],
)
# fmt: on
BIG_DECLARED = (
    TensorType("uint8", (2**34,)),  # 16 GiB, the codec's limit
    TensorType("uint8", (2**34 + 1,)),
    TensorType("float32", (2**28,)),  # 1 GiB
    TensorType("complex128", (2**20, 2**10)),
)
HEALTH_SERVICES = ("", "mpplug.PartyService", "mpplug.PeerService", "nope", "x" * 10_000)

BULK = "Bulk/Value"
"""What answers from the parties' bulk ports are tallied as."""
BULK_SHARE = 0.15
"""The share of cases that go to a bulk port rather than to a gRPC method."""
BULK_PREFIX = struct.Struct(">4sI")
"""A sender's magic and header length."""
BULK_REPLY = struct.Struct(">BI")
"""A receiver's status code number and message length."""
BIG_BULK_SHARE = 0.25
"""The share of bulk values over a chunk (a real sender's are mostly smaller, mp.mpc rounds)."""
BAD_MAGICS = (b"MPB0", b"MPB3", b"mpb1", b"\x00" * 4, b"\xff" * 4, b"\x16\x03\x01\x02", b"PRI ")
OVERSIZED_HEADER_LENGTHS = (MAX_HEADER_BYTES + 1, 2**31, 2**32 - 1)
BAD_EXEC_IDS = ("", "unscoped", "a:b:c", "x" * 65 + ":e", "s:", ":e", "s:e\x00", "s:é")
CLOSED, SILENT, TLS_REFUSED = "closed", "no answer", "TLS refused"
"""How a bulk port ended an exchange other than with a reply."""
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
GO_AHEAD = grpc.StatusCode.OK.name
"""A bulk port's OK: the go-ahead for a value's bytes, or the value delivered."""


# -- wire helpers --------------------------------------------------------------------------
def length_field(number: int, data: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(data)) + data


def chunk(header: bytes | None, data: bytes) -> bytes:
    """One serialized chunk message (PutChunk, ProgramChunk, PeerChunk): header, then data."""
    head = length_field(1, header) if header is not None else b""
    return head + (length_field(2, data) if data else b"")


def bulk_frame(header: bytes, magic: bytes = MAGIC, length: int | None = None) -> bytes:
    """What a bulk sender writes to offer a value: the magic, the header's length (or
    `length`), the serialized PeerHeader."""
    return BULK_PREFIX.pack(magic, len(header) if length is None else length) + header


def mangle(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """`data` damaged at the byte level, and how."""
    if rng.random() < 0.01:
        return data + length_field(15, bytes(5 << 20)), "over the 4 MiB message limit"
    how = rng.randrange(6)
    if how == 0:
        return rng.randbytes(rng.choice((1, 2, 5, 16, 100, 1000, 10_000))), "random bytes"
    if how == 1:
        flipped = bytearray(data or b"\x00")
        for _ in range(rng.randint(1, 8)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        return bytes(flipped), "bit flips"
    if how == 2:
        return data[: rng.randrange(len(data))] if data else b"\x0a", "truncated"
    if how == 3:
        number, wire = rng.choice((1, 2, 3, 7, 15, 2**29 - 1)), rng.randrange(8)
        value = varint(rng.choice(UINT64_VALUES)) if wire in (0, 2) else rng.randbytes(8)
        return data + varint(number << 3 | wire) + value, f"extra field {number} wire {wire}"
    if how == 4:
        return data + varint(1 << 3 | 2) + varint(2**32), "length past the end"
    nested = b""
    for _ in range(rng.choice((50, 200, 2000))):
        nested = length_field(1, nested)
    return data + nested, "deep nesting"


def _fields(msg: Message) -> list[tuple[Message, Any]]:
    """Every field of `msg` and of the messages set inside it."""
    found = []
    for fd in msg.DESCRIPTOR.fields:
        found.append((msg, fd))
        if fd.message_type is None:
            continue
        value = getattr(msg, fd.name)
        if fd.is_repeated:
            for child in value:
                found += _fields(child)
        elif msg.HasField(fd.name):
            found += _fields(value)
    return found


def _hostile_scalar(fd: FieldDescriptor, rng: random.Random, short: bool) -> Any:
    kind = fd.type
    if kind == FieldDescriptor.TYPE_STRING:
        if rng.random() < 0.1:
            return random_id(rng)
        return rng.choice(SHORT_STRINGS if short else HOSTILE_STRINGS)
    if kind == FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 1, 7, 1000)))
    if kind == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if kind == FieldDescriptor.TYPE_ENUM:
        return rng.choice(ENUM_VALUES)
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return rng.choice(DOUBLE_VALUES)
    if kind in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return rng.choice(UINT32_VALUES)
    if kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return rng.choice(UINT64_VALUES)
    if kind in (
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SFIXED32,
    ):
        return rng.choice(INT32_VALUES)
    return rng.choice(INT64_VALUES)


def _set_hostile(msg: Message, fd: FieldDescriptor, rng: random.Random) -> None:
    value = getattr(msg, fd.name)
    if fd.is_repeated:
        count = rng.choice((0, 1, 3, 2000))
        if fd.message_type is not None:
            for _ in range(count):
                value.add()
        elif count == 0:
            del value[:]
        else:
            value.extend(_hostile_scalar(fd, rng, short=count > 1) for _ in range(count))
    elif fd.message_type is not None:
        if rng.random() < 0.5:
            msg.ClearField(fd.name)
        else:
            value.Clear()
            value.SetInParent()
    else:
        setattr(msg, fd.name, _hostile_scalar(fd, rng, short=False))


def mutate_fields(msg: Message, rng: random.Random) -> str:
    """Set one to three fields anywhere in `msg` to hostile values; returns their names."""
    names = []
    for _ in range(rng.randint(1, 3)):
        fields = _fields(msg)
        if not fields:
            break
        parent, fd = rng.choice(fields)
        _set_hostile(parent, fd, rng)
        names.append(fd.name)
    if msg.ByteSize() > MAX_FUZZ_MESSAGE:
        msg.Clear()
        names.append("(too big: cleared)")
    return "fields " + ",".join(names) if names else "no fields"


def random_id(rng: random.Random) -> str:
    return f"{rng.getrandbits(64):016x}"


# -- calls ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One request to one party: its serialized message(s), how it was made, and how it may end."""

    party: int
    method: str
    messages: tuple[bytes, ...]
    label: str
    identity: str = DRIVER
    stall: bool = False
    """Keep the request stream open after the messages until the (short) deadline cuts it."""
    may_wait: bool = False
    """It may rightly run until the short deadline cuts it (an execution waiting for a peer)."""
    background: bool = False
    """Started first, its answer collected after the case's other calls."""

    def reproduction(self, limit: int = 120) -> str:
        """How to send it again (each message's first `limit` bytes; --dump has them all)."""
        shown = []
        for message in self.messages:
            cut = "" if len(message) <= limit else f"...({len(message)} bytes)"
            shown.append(f"bytes.fromhex('{message[:limit].hex()}'){cut}")
        return (
            f"party {self.party} as {self.identity}: {self.method}("
            f"{', '.join(shown) or 'no messages'}){' then stall' if self.stall else ''}"
        )


@dataclass(frozen=True)
class BulkCall(Call):
    """A connection to a party's bulk port: `messages` are values' frames and payloads in turn
    (a payload is written only once its frame is answered OK; the last value may lack one)."""

    hang_up: bool = False
    """Close the sending side after the last message (a frame or value cut short)."""
    must_refuse: bool = False
    """The port must refuse the caller or the values it claims to send (with TLS)."""

    def reproduction(self, limit: int = 120) -> str:
        shown = super().reproduction(limit)
        return f"{shown} then hang up" if self.hang_up else shown


Case = tuple[Call, ...]


@dataclass(frozen=True)
class Result:
    """How a call was answered: its kind (OK, TYPED, ...), code, details and time taken."""

    call: Call
    kind: str
    code: str
    details: str
    seconds: float


def classify(call: Call, code: grpc.StatusCode, details: str) -> str:
    """The kind of a failed call's answer (see the module docstring)."""
    if any(sign in details for sign in UNTYPED_SIGNS):
        return UNTYPED
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return CUT if call.stall or call.may_wait else HANG
    if (
        code is grpc.StatusCode.INTERNAL
        and call.method.startswith("Health/")
        and "deserializing request" in details
    ):
        return HEALTH_INTERNAL
    if code in TYPED_CODES:
        return TYPED
    if code is grpc.StatusCode.UNAVAILABLE and call.identity == OUTSIDER:
        return TYPED  # refused at the TLS handshake
    return UNTYPED


class BulkAnswer(NamedTuple):
    """What a bulk port did after one message: replied (its code's name and message), or
    CLOSED, SILENT or TLS_REFUSED; `last` when the message was the call's last."""

    code: str
    details: str
    last: bool


def classify_bulk(call: BulkCall, answer: BulkAnswer) -> str:
    """The kind of a bulk port's answer (see the module docstring)."""
    if answer.code == GO_AHEAD:
        return UNTYPED if call.must_refuse else OK
    if answer.code == SILENT:
        return CUT if call.stall and answer.last else HANG
    if answer.code in (CLOSED, TLS_REFUSED) and call.identity == OUTSIDER:
        return TYPED  # refused at the TLS handshake
    if answer.code == CLOSED:
        return TYPED if call.hang_up and answer.last else UNTYPED
    code = grpc.StatusCode.__members__.get(answer.code)
    if code is None or not answer.details:
        return UNTYPED
    return classify(call, code, answer.details)


# -- the cluster -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Fixture:
    """A running cluster, its cluster file and the identities a fuzzer may call with."""

    parties: LocalParties
    identities: dict[str, TLSFiles] | None
    """With TLS: "driver", "outsider" and each party's files."""
    idle_timeout: float
    """Seconds after which the parties close an idle session."""

    @property
    def spec(self) -> ClusterSpec:
        return self.parties.spec


@contextlib.contextmanager
def cluster(workdir: Path, *, tls: bool, idle_timeout: float = IDLE_TIMEOUT_S) -> Iterator[Fixture]:
    """Three party processes on free loopback ports, each exposing one small dataset, with
    dev certificates when `tls`. Sessions idle for `idle_timeout` seconds close, and values
    sent for executions that never start are dropped as soon. Killed on exit, even when the
    body fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    table = workdir / f"{DATASET}.npy"
    np.save(table, np.arange(12, dtype=np.int32).reshape(3, 4))
    data = ClusterSpec.local(WORLD).to_dict()
    data["limits"] = {"unclaimed_value_s": idle_timeout}
    for entry in data["parties"]:
        entry["data"] = {DATASET: str(table)}
    spec = ClusterSpec.from_dict(data, source="fuzz")
    identities = None
    if tls:
        identities = write_dev_certs(spec, workdir / "certs")
        spec = with_tls(spec, identities)
        foreign = write_dev_certs(spec, workdir / "foreign")[DRIVER]
        identities[OUTSIDER] = TLSFiles(identities[DRIVER].ca, foreign.cert, foreign.key)
    config = workdir / "cluster.yaml"
    config.write_text(yaml.safe_dump(spec.to_dict()))
    with LocalParties(
        config, log_dir=workdir / "logs", session_idle_timeout=idle_timeout
    ) as parties:
        parties.start()
        parties.wait_ready(timeout=120.0)
        yield Fixture(parties, identities, idle_timeout)


class Clients:
    """Raw stubs to each party for each identity, channels opened on first use."""

    def __init__(self, fixture: Fixture) -> None:
        self._fixture = fixture
        self._channels: dict[tuple[int, str], grpc.Channel] = {}
        self._stubs: dict[tuple[int, str, str], SimpleNamespace] = {}
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._lock = threading.Lock()

    def method(self, party: int, identity: str, method: str) -> Any:
        service, name = method.split("/")
        key = (party, identity, service)
        with self._lock:
            if key not in self._stubs:
                self._stubs[key] = raw_stub(self._channel(party, identity), SERVICES[service])
            return getattr(self._stubs[key], name)

    def _channel(self, party: int, identity: str) -> grpc.Channel:
        files = self._fixture.identities
        key = (party, identity if files is not None else DRIVER)
        if key not in self._channels:
            endpoint = self._fixture.spec.parties[party].endpoint
            options = [
                ("grpc.max_send_message_length", -1),
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.enable_http_proxy", 0),
            ]
            if files is None:
                self._channels[key] = grpc.insecure_channel(endpoint, options=options)
            else:
                credentials = channel_credentials(files[self._who(party, identity)])
                self._channels[key] = grpc.secure_channel(endpoint, credentials, options=options)
        return self._channels[key]

    def _who(self, party: int, identity: str) -> str:
        if identity == PEER:
            return self._fixture.spec.names[peer_of(party)]
        return identity

    def bulk_socket(self, party: int, identity: str, timeout: float) -> socket.socket:
        """A new connection to `party`'s bulk port, with TLS as `identity` when the cluster
        has it (OSError if it cannot be made, ssl.SSLError if the handshake fails)."""
        endpoint = self._fixture.spec.parties[party].bulk
        assert endpoint is not None, "ClusterSpec.local gives every party a bulk port"
        sock = socket.create_connection(split_endpoint(endpoint, "bulk"), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        context = self._bulk_context(party, identity)
        if context is None:
            return sock
        try:
            return context.wrap_socket(sock)
        except BaseException:
            sock.close()
            raise

    def _bulk_context(self, party: int, identity: str) -> ssl.SSLContext | None:
        files = self._fixture.identities
        if files is None:
            return None
        who = self._who(party, identity)
        with self._lock:
            if who not in self._contexts:
                self._contexts[who] = client_context(files[who])
            return self._contexts[who]

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()


def peer_of(party: int) -> int:
    """The party whose certificate the fuzzer shows when it calls `party` as a peer."""
    return (party + 1) % WORLD


# -- real programs and the fuzzer's own session ----------------------------------------------
@dataclass(frozen=True)
class RealProgram:
    """A program traced here, as a driver would send it."""

    name: str
    data: bytes
    digest: str
    args: tuple[tuple[int, TensorType], ...]
    """(holding party, type) per argument."""
    outputs: int
    shuffle_op: int | None
    """The first SHUFFLE op's id, if any (values sent to it may be injected)."""


F32_AT_0 = mp.MPObject(TensorType("float32"), {0})


def _ranks() -> Any:
    return mp.run_jax(lambda r: r + 1, mp.prank())


def _hop(x: Any) -> Any:
    return mp.p2p(0, 2, mp.run_jax(lambda a: a + 1, x))


def _loop(x: Any) -> Any:
    return mp.fori_loop(0, 3, lambda i, v: mp.run_jax(lambda a: a * 2, v), x)


def _reading() -> Any:
    table = mp.read(1, DATASET, type=TensorType("int32", (3, 4)))
    return mp.run_jax(lambda t: t.sum(), table)


def real_programs() -> list[RealProgram]:
    """Small programs of every kind of op: local calls, a party-to-party value, a loop
    region, a dataset read."""
    made = []
    for fn, args in ((_ranks, ()), (_hop, (F32_AT_0,)), (_loop, (F32_AT_0,)), (_reading, ())):
        program = mp.compile(mp.function(fn), *args, world_size=WORLD)
        data = program.to_bytes()
        graph = values_pb2.Graph.FromString(data)
        shuffles = [op.id for op in graph.ops if op.kind == values_pb2.Op.SHUFFLE]
        made.append(
            RealProgram(
                fn.__name__.strip("_"),
                data,
                program.digest,
                tuple((min(a.parties), a.type) for a in args),
                len(graph.outputs),
                shuffles[0] if shuffles else None,
            )
        )
    return made


def _one_chunk_program(session: str, program: RealProgram) -> bytes:
    header = pb.ProgramHeader(session=session, digest=program.digest, size=len(program.data))
    return chunk(header.SerializeToString(), program.data)


def _put_message(session: str, name: str, ttype: TensorType, data: bytes) -> bytes:
    header = pb.PutHeader(session=session, name=name, type=tensor_type_to_proto(ttype))
    return chunk(header.SerializeToString(), data)


def establish(clients: Clients, session: str, programs: Sequence[RealProgram]) -> None:
    """At every party where `session` is open: load the programs, store the state values
    and run each program once (so that it is compiled); raises if any of it fails."""
    for party in range(WORLD):
        load = clients.method(party, DRIVER, "PartyService/LoadProgram")
        for program in programs:
            load(iter([_one_chunk_program(session, program)]), timeout=60.0, wait_for_ready=True)
        put = clients.method(party, DRIVER, "PartyService/PutSmall")
        for name, ttype in [*STATE_VALUES.items(), WRONG_VALUE]:
            put(
                _put_message(session, name, ttype, bytes(ttype.nbytes)),
                timeout=60.0,
                wait_for_ready=True,
            )
    for party in range(WORLD):
        for program in programs:
            request = _execute(session, program, party, random.Random(0), timeout=RECEIVE_S)
            reply = pb.ExecuteReply.FromString(
                clients.method(party, DRIVER, "PartyService/Execute")(
                    request, timeout=120.0, wait_for_ready=True
                )
            )
            if reply.WhichOneof("outcome") not in ("completed", "comm_timeout"):
                raise RuntimeError(f"warming {program.name} at party {party}: {reply}")


@contextlib.contextmanager
def session_kept(
    clients: Clients, names: Sequence[str], session: str, every: float
) -> Iterator[None]:
    """`session` opened at every party and renewed every `every` seconds, as a driver would,
    until the block ends (then left to expire)."""
    for party in range(WORLD):
        clients.method(party, DRIVER, "PartyService/OpenSession")(
            _open(session, names), timeout=60.0, wait_for_ready=True
        )
    stop = threading.Event()
    request = pb.KeepAliveRequest(session=session).SerializeToString()

    def renew() -> None:
        while not stop.wait(every):
            for party in range(WORLD):
                with contextlib.suppress(grpc.RpcError):
                    clients.method(party, DRIVER, "PartyService/KeepAlive")(request, timeout=every)

    renewing = threading.Thread(target=renew, name="fuzz-keepalive", daemon=True)
    renewing.start()
    try:
        yield
    finally:
        stop.set()
        renewing.join()


def _open(session: str, names: Sequence[str]) -> bytes:
    return _open_request(session, names).SerializeToString()


def _open_request(session: str, names: Sequence[str]) -> pb.OpenSessionRequest:
    return pb.OpenSessionRequest(session=session, parties=names, wire_version=WIRE_VERSION)


def _inputs(program: RealProgram, party: int, rng: random.Random) -> list[str]:
    names = []
    for holder, ttype in program.args:
        held = [n for n, t in STATE_VALUES.items() if t == ttype]
        names.append(held[0] if holder == party and held else rng.choice(PUT_NAMES))
    return names


def _execute_request(
    session: str, program: RealProgram, party: int, rng: random.Random, timeout: float
) -> pb.ExecuteRequest:
    return pb.ExecuteRequest(
        session=session,
        exec_id=random_id(rng),
        digest=program.digest,
        inputs=_inputs(program, party, rng),
        outputs=[rng.choice(OUT_NAMES) for _ in range(program.outputs)],
        timeout=timeout,
    )


def _execute(
    session: str, program: RealProgram, party: int, rng: random.Random, timeout: float
) -> bytes:
    return _execute_request(session, program, party, rng, timeout).SerializeToString()


def _may_wait_execute(data: bytes) -> bool:
    """Whether an Execute request asks for receives that may wait over a second."""
    try:
        request = pb.ExecuteRequest.FromString(data)
    except DecodeError:
        return False
    return request.timeout > 1.0


# -- the fuzzer ------------------------------------------------------------------------------
class Fuzzer:
    """Makes cases: each a short sequence of calls, from a seeded generator."""

    def __init__(
        self,
        rng: random.Random,
        names: Sequence[str],
        session: str,
        programs: Sequence[RealProgram],
        tls: bool,
    ) -> None:
        self.rng = rng
        self.names = list(names)
        self.session = session
        self.programs = list(programs)
        self.tls = tls
        self._generators: dict[str, Callable[[int], Case]] = {
            "PartyService/OpenSession": self._open_session,
            "PartyService/KeepAlive": self._keep_alive,
            "PartyService/CloseSession": self._close_session,
            "PartyService/Put": lambda party: self._put(party, small=False),
            "PartyService/PutSmall": lambda party: self._put(party, small=True),
            "PartyService/LoadProgram": self._load_program,
            "PartyService/Execute": self._execute,
            "PartyService/ExecuteStream": self._execute_stream,
            "PartyService/Abort": self._abort,
            "PartyService/Fetch": self._fetch,
            "PartyService/FetchMany": self._fetch_many,
            "PartyService/Release": self._release,
            "PartyService/Status": self._status,
            "PartyService/DatasetInfo": self._dataset_info,
            "PeerService/Send": lambda party: self._send(party, small=False),
            "PeerService/SendSmall": lambda party: self._send(party, small=True),
            "Health/Check": self._health_check,
            "Health/Watch": self._health_watch,
            "Health/List": self._health_list,
            "abandoned session": self._abandon,
            "value injected into a running execution": self._inject,
            "execution started twice": self._rerun,
            "garbage program run": self._garbage_run,
        }
        self._bulk_generators: list[Callable[[int], BulkCall]] = [
            self._bulk_valid,
            self._bulk_after_refusal,
            self._bulk_random_bytes,
            self._bulk_bad_magic,
            self._bulk_header_length,
            self._bulk_truncated_frame,
            self._bulk_undecodable,
            self._bulk_mutated,
            self._bulk_targeted,
            self._bulk_cut_short,
            self._bulk_stall,
        ]
        if tls:
            self._bulk_generators.append(self._bulk_refused_caller)

    def case(self) -> Case:
        if self.rng.random() < BULK_SHARE:
            return (self.rng.choice(self._bulk_generators)(self.rng.randrange(WORLD)),)
        kind = self.rng.choice(list(self._generators))
        return self._generators[kind](self.rng.randrange(WORLD))

    # -- shared strategies --------------------------------------------------------------
    def _identity(self, preferred: str) -> str:
        if not self.tls:
            return DRIVER
        r = self.rng.random()
        if r < 0.03:
            return OUTSIDER
        if r < 0.10:
            return PEER if preferred == DRIVER else DRIVER
        return preferred

    def _unary(
        self,
        party: int,
        method: str,
        valid: Message,
        targeted: Callable[[Any], str] | None = None,
        identity: str = DRIVER,
    ) -> Call:
        r = self.rng.random()
        if r >= 0.75:
            data, label = mangle(valid.SerializeToString(), self.rng)
            return Call(party, method, (data,), label, self._identity(identity))
        if r < 0.15:
            label = "valid"
        elif r < 0.55 or targeted is None:
            label = mutate_fields(valid, self.rng)
        else:
            label = targeted(valid)
        data = valid.SerializeToString()
        may_wait = method == "PartyService/Execute" and _may_wait_execute(data)
        return Call(party, method, (data,), label, self._identity(identity), may_wait=may_wait)

    def _type_targeted(self, proto: Any) -> str:
        """A TensorType field set to an absurd shape or an unknown dtype."""
        if self.rng.random() < 0.7:
            shape = self.rng.choice(ABSURD_SHAPES)
            del proto.shape[:]
            proto.shape.extend(shape)
            return f"absurd shape {shape if len(shape) < 8 else f'rank {len(shape)}'}"
        dtype = self.rng.choice(ENUM_VALUES)
        proto.dtype = dtype
        return f"dtype {dtype}"

    def _value(self, big: float = 0.05) -> tuple[TensorType, bytes]:
        """A value of a random type: with probability `big` one of BIG_VALUE_BYTES."""
        dtype = self.rng.choice(list(DType))
        if self.rng.random() < big:
            shape: tuple[int, ...] = (BIG_VALUE_BYTES // dtype.itemsize,)
        else:
            shape = tuple(self.rng.randrange(0, 9) for _ in range(self.rng.randrange(0, 4)))
        ttype = TensorType(dtype, shape)
        return ttype, self.rng.randbytes(ttype.nbytes)

    def _chunked(
        self,
        party: int,
        method: str,
        header: Message,
        payload: bytes,
        small: bool,
        identity: str,
        type_field: Any = None,
    ) -> Call:
        """A chunk stream (or single chunk when `small`) of `header` then `payload`, valid
        or damaged in its header, its type, its length or the shape of the stream."""
        r = self.rng.random()
        label = "valid"
        if r < 0.25:
            label = mutate_fields(header, self.rng)
        elif r < 0.45 and type_field is not None:
            label = self._type_targeted(type_field)
        elif r < 0.55 and type_field is not None:
            big = self.rng.choice(BIG_DECLARED)
            type_field.CopyFrom(tensor_type_to_proto(big))
            label = f"declared {big}, {len(payload)} bytes sent"
        elif r < 0.65:
            payload, label = self._resized(payload)
        head = header.SerializeToString()
        if small:
            message = chunk(head, payload)
            if 0.65 <= r < 0.75:
                message, label = mangle(message, self.rng)
            return Call(party, method, (message,), label, self._identity(identity))
        messages, stall, shape = self._stream(head, payload)
        if shape:
            label = f"{label}; {shape}" if label != "valid" else shape
        return Call(party, method, messages, label, self._identity(identity), stall=stall)

    def _resized(self, payload: bytes) -> tuple[bytes, str]:
        delta = self.rng.choice((-1, 1, -len(payload), 7, 1 << 20))
        if delta < 0:
            return payload[: max(len(payload) + delta, 0)], f"{-delta} bytes short"
        return payload + bytes(delta), f"{delta} bytes too many"

    def _stream(self, head: bytes, payload: bytes) -> tuple[tuple[bytes, ...], bool, str]:
        """The messages of a stream: (messages, stall, what was done to the stream)."""
        r = self.rng.random()
        pieces = _split(payload, self.rng)
        if r < 0.4:
            return (chunk(head, payload),), False, ""
        if r < 0.55:
            return (chunk(head, b""), *(chunk(None, p) for p in pieces)), False, "split"
        if r < 0.62 and len(pieces) > 1:
            swapped = [chunk(None, p) for p in reversed(pieces)]
            return (chunk(head, b""), *swapped), False, "chunks out of order"
        if r < 0.68:
            return (chunk(head, b""), chunk(head, payload)), False, "header repeated"
        if r < 0.73:
            return (chunk(None, payload),), False, "no header"
        if r < 0.77:
            return (), False, "empty stream"
        if r < 0.82:
            return (chunk(head, b""), *[b""] * 1000, chunk(None, payload)), False, "empty messages"
        if r < 0.90:
            return (chunk(head, b""), *(chunk(None, p) for p in pieces[:-1])), True, "stall"
        if r < 0.95:
            return (chunk(head, payload[: len(payload) // 2]),), False, "stops mid-way"
        message, how = mangle(chunk(head, payload), self.rng)
        return (message,), False, how

    # -- PartyService -------------------------------------------------------------------
    def _open_session(self, party: int) -> Case:
        valid = _open_request(random_id(self.rng), self.names)
        return (self._unary(party, "PartyService/OpenSession", valid),)

    def _keep_alive(self, party: int) -> Case:
        valid = pb.KeepAliveRequest(session=self.session)
        return (self._unary(party, "PartyService/KeepAlive", valid),)

    def _close_session(self, party: int) -> Case:
        session = random_id(self.rng)
        opened = Call(party, "PartyService/OpenSession", (_open(session, self.names),), "valid")
        closing = pb.CloseSessionRequest(session=session)
        return opened, self._unary(party, "PartyService/CloseSession", closing)

    def _put(self, party: int, small: bool) -> Case:
        ttype, payload = self._value()
        if small:
            payload = payload[: 1 << 20]
            ttype = TensorType("uint8", (len(payload),)) if len(payload) != ttype.nbytes else ttype
        header = pb.PutHeader(
            session=self.session,
            name=self.rng.choice(PUT_NAMES),
            type=tensor_type_to_proto(ttype),
        )
        method = "PartyService/PutSmall" if small else "PartyService/Put"
        return (self._chunked(party, method, header, payload, small, DRIVER, header.type),)

    def _load_program(self, party: int) -> Case:
        program = self.rng.choice(self.programs)
        data, label = program.data, ""
        r = self.rng.random()
        if r < 0.15:
            data, label = self.rng.randbytes(self.rng.choice((0, 1, 100, 5000))), "garbage"
        elif r < 0.30:
            data, how = mangle(data, self.rng)
            label = f"program {how}"
        elif r < 0.50:
            data, label = self._mutated_graph(program)
        size = len(data)
        if 0.50 <= r < 0.60:
            size = self.rng.choice((0, size - 1, size + 1, 2**29, (1 << 30) + 1, 2**63, 2**64 - 1))
            label = f"size {size} for {len(data)} bytes"
        header = pb.ProgramHeader(
            session=self.session, digest=hashlib.sha256(data).hexdigest(), size=size
        )
        call = self._chunked(party, "PartyService/LoadProgram", header, data, False, DRIVER)
        if label:
            both = label if call.label == "valid" else f"{label}; {call.label}"
            call = dataclasses.replace(call, label=both)
        return (call,)

    def _mutated_graph(self, program: RealProgram) -> tuple[bytes, str]:
        graph = values_pb2.Graph.FromString(program.data)
        if self.rng.random() < 0.3:
            types = _tensor_types(graph)
            label = self._type_targeted(self.rng.choice(types)) if types else "no types"
        else:
            label = mutate_fields(graph, self.rng)
        return graph.SerializeToString(deterministic=True), f"program {program.name}: {label}"

    def _execute(self, party: int) -> Case:
        program = self.rng.choice(self.programs)
        valid = _execute_request(self.session, program, party, self.rng, timeout=RECEIVE_S)

        def targeted(request: Any) -> str:
            choice = self.rng.randrange(3)
            if choice == 0 and request.inputs:
                request.inputs[0] = WRONG_VALUE[0]
                return "an input of the wrong type"
            if choice == 1:
                request.digest = hashlib.sha256(self.rng.randbytes(8)).hexdigest()
                return "a digest never loaded"
            request.timeout = MAX_TIMEOUT_S
            return "the longest timeout"

        return (self._unary(party, "PartyService/Execute", valid, targeted),)

    def _execute_stream(self, party: int) -> Case:
        """A stream of Execute requests (fuzzed as Execute's are), maybe left open."""
        messages = []
        for _ in range(self.rng.randrange(1, 5)):
            (call,) = self._execute(party)
            messages.append(call.messages[0])
        stall = self.rng.random() < 0.1
        return (
            Call(
                party,
                "PartyService/ExecuteStream",
                tuple(messages),
                f"{len(messages)} execute requests" + (", left open" if stall else ""),
                self._identity(DRIVER),
                stall=stall,
                may_wait=any(_may_wait_execute(m) for m in messages),
            ),
        )

    def _abort(self, party: int) -> Case:
        valid = pb.AbortRequest(session=self.session, exec_id=random_id(self.rng), reason="fuzz")

        def targeted(request: Any) -> str:
            request.reason = "r" * (1 << 20)
            return "a 1 MiB reason"

        return (self._unary(party, "PartyService/Abort", valid, targeted),)

    def _value_names(self) -> list[str]:
        return [*STATE_VALUES, *PUT_NAMES, *OUT_NAMES]

    def _fetch(self, party: int) -> Case:
        valid = pb.FetchRequest(session=self.session, name=self.rng.choice(self._value_names()))
        return (self._unary(party, "PartyService/Fetch", valid),)

    def _fetch_many(self, party: int) -> Case:
        names = self.rng.sample(self._value_names(), self.rng.randrange(1, 6))
        valid = pb.FetchManyRequest(session=self.session, names=names)

        def targeted(request: Any) -> str:
            count = self.rng.choice((MAX_FETCH_NAMES, MAX_FETCH_NAMES + 1))
            request.names[:] = ["s-vec"] * count
            return f"{count} names"

        return (self._unary(party, "PartyService/FetchMany", valid, targeted),)

    def _release(self, party: int) -> Case:
        names = self.rng.sample([*PUT_NAMES, *OUT_NAMES], self.rng.randrange(0, 6))
        valid = pb.ReleaseRequest(session=self.session, names=names)
        return (self._unary(party, "PartyService/Release", valid),)

    def _status(self, party: int) -> Case:
        return (self._unary(party, "PartyService/Status", pb.StatusRequest()),)

    def _dataset_info(self, party: int) -> Case:
        valid = pb.DatasetInfoRequest(session=self.session, name=DATASET)
        return (self._unary(party, "PartyService/DatasetInfo", valid),)

    # -- PeerService --------------------------------------------------------------------
    def _peer_header(self, party: int, ttype: TensorType, exec_id: str, op: int) -> Any:
        sender = peer_of(party)
        return pb.PeerHeader(
            exec_id=f"{self.session}:{exec_id}",
            op=op,
            src=sender,
            dst=party,
            type=tensor_type_to_proto(ttype),
            scope=self.rng.choice(((), (), (1, 0, 2))),
        )

    def _send(self, party: int, small: bool) -> Case:
        ttype, payload = self._value()
        if small:
            payload = payload[: 1 << 20]
            ttype = TensorType("uint8", (len(payload),)) if len(payload) != ttype.nbytes else ttype
        header = self._peer_header(party, ttype, random_id(self.rng), self.rng.randrange(64))
        method = "PeerService/SendSmall" if small else "PeerService/Send"
        return (self._chunked(party, method, header, payload, small, PEER, header.type),)

    # -- the bulk port -------------------------------------------------------------------
    def _bulk_call(
        self,
        party: int,
        messages: Sequence[bytes],
        label: str,
        identity: str | None = None,
        *,
        refuse: bool = False,
        stall: bool = False,
        hang_up: bool = False,
    ) -> BulkCall:
        """A connection to `party`'s bulk port as its peer (now and then, with TLS, as a
        caller it must refuse) unless `identity` says who; `refuse` if the port must refuse
        the values it claims to send."""
        who = self._identity(PEER) if identity is None else identity
        must_refuse = self.tls and (refuse or who != PEER)
        return BulkCall(
            party,
            BULK,
            tuple(messages),
            label,
            who,
            stall=stall,
            hang_up=hang_up,
            must_refuse=must_refuse,
        )

    def _bulk_header(self, party: int, ttype: TensorType) -> Any:
        """A valid header of a value for `party` from its peer, under the fuzzer's session and
        an execution id never started (the value expires unclaimed)."""
        return self._peer_header(party, ttype, random_id(self.rng), self.rng.randrange(64))

    def _bulk_value(self, party: int) -> tuple[Any, bytes]:
        """A valid header and its value's bytes, now and then over a chunk."""
        ttype, payload = self._value(big=BIG_BULK_SHARE)
        return self._bulk_header(party, ttype), payload

    def _bulk_valid(self, party: int) -> BulkCall:
        """One or two values on one connection, as a peer sends them: each answered OK, then
        OK once delivered."""
        values = [self._bulk_value(party) for _ in range(self.rng.choice((1, 1, 2)))]
        messages = [m for head, payload in values for m in (_frame(head), payload)]
        return self._bulk_call(party, messages, f"{len(values)} valid")

    def _bulk_after_refusal(self, party: int) -> BulkCall:
        """A value refused by its header, then a valid one on the same connection (a refusal
        leaves the connection open), as the peer (a caller refused is disconnected)."""
        refused, _ = self._bulk_value(party)
        how = self._misaddressed(party, refused)
        header, payload = self._bulk_value(party)
        messages = (_frame(refused), b"", _frame(header), payload)
        return self._bulk_call(party, messages, f"{how}, then a valid value", PEER)

    def _misaddressed(self, party: int, header: Any) -> str:
        """Make `header` one the port must refuse for its ids or scope; returns how."""
        how = self.rng.randrange(4)
        if how == 0:
            header.dst = self.rng.choice((peer_of(party), WORLD, 2**32 - 1))
            return f"dst {header.dst}"
        if how == 1:
            header.src = self.rng.choice((party, WORLD))
            return f"src {header.src}"
        if how == 2:
            header.exec_id = self.rng.choice(BAD_EXEC_IDS)
            return f"exec_id {header.exec_id[:40]!r}"
        scope = self.rng.choice(((1,), (1, 0), (0,) * (3 * MAX_REGION_DEPTH + 3)))
        header.scope[:] = scope
        return f"scope of {len(scope)} numbers"

    def _bulk_random_bytes(self, party: int) -> BulkCall:
        """Random bytes, then the sending side closed: refused for their magic, or (under a
        prefix's eight bytes) nothing left to answer."""
        data = self.rng.randbytes(self.rng.choice((1, 2, 5, 16, 100, 1000, 10_000)))
        return self._bulk_call(party, (data,), f"{len(data)} random bytes", hang_up=True)

    def _bulk_bad_magic(self, party: int) -> BulkCall:
        """A valid header behind the wrong magic: INVALID_ARGUMENT, then the port closes."""
        header, _ = self._bulk_value(party)
        magic = self.rng.choice(BAD_MAGICS)
        frame = bulk_frame(header.SerializeToString(), magic)
        return self._bulk_call(party, (frame,), f"magic {magic!r}")

    def _bulk_header_length(self, party: int) -> BulkCall:
        """A header length over the limit (INVALID_ARGUMENT, then the port closes), or one
        exactly at it, the header padded with an unknown field (let in)."""
        header, payload = self._bulk_value(party)
        head = header.SerializeToString()
        if self.rng.random() < 0.25:
            padded = _padded(head, MAX_HEADER_BYTES)
            return self._bulk_call(party, (bulk_frame(padded), payload), "header at the limit")
        length = self.rng.choice(OVERSIZED_HEADER_LENGTHS)
        return self._bulk_call(party, (bulk_frame(head, length=length),), f"header length {length}")

    def _bulk_truncated_frame(self, party: int) -> BulkCall:
        """A frame cut in its prefix or its header, then the sending side closed: nothing
        left to answer, the port closes too."""
        header, _ = self._bulk_value(party)
        frame = _frame(header)
        cut = self.rng.randrange(1, len(frame))
        where = "prefix" if cut < BULK_PREFIX.size else "header"
        label = f"frame cut at byte {cut} of {len(frame)} (in its {where})"
        return self._bulk_call(party, (frame[:cut],), label, hang_up=True)

    def _bulk_undecodable(self, party: int) -> BulkCall:
        """A frame whose header's bytes are damaged (refused, or let in if they still decode
        as a header the port admits); only the frame is sent."""
        header, _ = self._bulk_value(party)
        data, how = mangle(header.SerializeToString(), self.rng)
        if len(data) > MAX_HEADER_BYTES:
            data, how = data[:MAX_HEADER_BYTES], f"{how}, cut to the limit"
        return self._bulk_call(party, (bulk_frame(data),), f"header {how}")

    def _bulk_mutated(self, party: int) -> BulkCall:
        """A header with random fields set to hostile values; only the frame is sent."""
        header, _ = self._bulk_value(party)
        label = mutate_fields(header, self.rng)
        return self._bulk_call(party, (_frame(header),), label)

    def _bulk_targeted(self, party: int) -> BulkCall:
        """A header misaddressed, or of an absurd shape, an unknown dtype or a size far over
        what comes; only the frame is sent."""
        header, _ = self._bulk_value(party)
        r = self.rng.random()
        if r < 0.4:
            label = self._misaddressed(party, header)
        elif r < 0.8:
            label = self._type_targeted(header.type)
        else:
            big = self.rng.choice(BIG_DECLARED)
            header.type.CopyFrom(tensor_type_to_proto(big))
            label = f"declared {big}"
        return self._bulk_call(party, (_frame(header),), label)

    def _bulk_cut_short(self, party: int) -> BulkCall:
        """A value let in, its bytes cut short, then the sending side closed: the port drops
        it and closes."""
        size = self.rng.choice((1, 4096, BIG_VALUE_BYTES))
        header = self._bulk_header(party, TensorType("uint8", (size,)))
        sent = self.rng.randrange(size)
        messages = (_frame(header), self.rng.randbytes(sent))
        return self._bulk_call(party, messages, f"{sent} of {size} bytes", hang_up=True)

    def _bulk_stall(self, party: int) -> BulkCall:
        """A value stalled in its prefix, its header, after its go-ahead or in its bytes: the
        port waits (stream_idle_s, far past STALL_S, at which the fuzzer cuts it)."""
        size = self.rng.choice((1, 4096, BIG_VALUE_BYTES))
        frame = _frame(self._bulk_header(party, TensorType("uint8", (size,))))
        where = self.rng.randrange(4)
        if where == 0:
            messages: tuple[bytes, ...] = (frame[: self.rng.randrange(1, BULK_PREFIX.size)],)
        elif where == 1:
            messages = (frame[: self.rng.randrange(BULK_PREFIX.size, len(frame))],)
        elif where == 2:
            messages = (frame, b"")
        else:
            messages = (frame, self.rng.randbytes(self.rng.randrange(size)))
        place = ("prefix", "header", "go-ahead", "bytes")[where]
        return self._bulk_call(party, messages, f"stall in its {place}", stall=True)

    def _bulk_refused_caller(self, party: int) -> BulkCall:
        """A valid value offered by a caller the port must refuse: with the driver's
        certificate or a foreign one, or a peer's claiming to come from the third party."""
        header, payload = self._bulk_value(party)
        identity = self.rng.choice((DRIVER, OUTSIDER, PEER))
        label = f"valid value as {identity}"
        if identity == PEER:
            header.src = next(k for k in range(WORLD) if k not in (party, peer_of(party)))
            label = f"valid value from party {header.src} with party {peer_of(party)}'s certificate"
        messages = (_frame(header), payload)
        return self._bulk_call(party, messages, label, identity, refuse=True)

    # -- Health ---------------------------------------------------------------------------
    def _health_check(self, party: int) -> Case:
        valid = health_pb2.HealthCheckRequest(service=self.rng.choice(HEALTH_SERVICES))
        return (self._unary(party, "Health/Check", valid),)

    def _health_watch(self, party: int) -> Case:
        valid = health_pb2.HealthCheckRequest(service=self.rng.choice(HEALTH_SERVICES))
        return (self._unary(party, "Health/Watch", valid),)

    def _health_list(self, party: int) -> Case:
        return (self._unary(party, "Health/List", health_pb2.HealthListRequest()),)

    # -- compound cases -----------------------------------------------------------------
    def _abandon(self, party: int) -> Case:
        """A real session opened, filled, used and never closed: it must expire."""
        session = random_id(self.rng)
        program = self.rng.choice(self.programs)
        ttype = TensorType("uint8", (ABANDONED_VALUE_BYTES,))
        payload = self.rng.randbytes(ABANDONED_VALUE_BYTES)
        steps = [
            ("PartyService/OpenSession", _open(session, self.names)),
            ("PartyService/PutSmall", _put_message(session, "a", ttype, payload)),
            ("PartyService/PutSmall", _put_message(session, "b", ttype, payload)),
            ("PartyService/LoadProgram", _one_chunk_program(session, program)),
        ]
        calls = [Call(party, m, (data,), "abandoned session") for m, data in steps]
        execute = _execute(session, self.programs[0], party, self.rng, timeout=RECEIVE_S)
        calls.append(Call(party, "PartyService/Execute", (execute,), "abandoned session"))
        return tuple(calls)

    def _running_hop(self, timeout: float, exec_id: str) -> tuple[RealProgram, Call]:
        """An Execute of the hop program at its receiving party (2), started first."""
        hop = next(p for p in self.programs if p.shuffle_op is not None)
        request = _execute_request(self.session, hop, 2, self.rng, timeout)
        request.exec_id = exec_id
        call = Call(
            2,
            "PartyService/Execute",
            (request.SerializeToString(),),
            "running hop",
            background=True,
        )
        return hop, call

    def _inject(self, party: int) -> Case:
        """A value of the right key, right or wrong type, sent into a running execution (at
        party 2, the receiver of the hop program)."""
        exec_id = random_id(self.rng)
        hop, running = self._running_hop(5 * RECEIVE_S, exec_id)
        if self.rng.random() < 0.3:
            ttype = TensorType("float32")
            label = "right type"
        else:
            ttype, _ = self._value()
            label = f"type {ttype}"
        header = self._peer_header(2, ttype, exec_id, hop.shuffle_op or 0)
        header.ClearField("scope")
        sending = self._chunked(
            2, "PeerService/SendSmall", header, self.rng.randbytes(ttype.nbytes), True, PEER
        )
        return running, dataclasses.replace(sending, label=f"injected {label}; {sending.label}")

    def _rerun(self, party: int) -> Case:
        """The same execution started twice at party 2 while the first still runs."""
        exec_id = random_id(self.rng)
        _, running = self._running_hop(5 * RECEIVE_S, exec_id)
        second = dataclasses.replace(running, background=False, label="same exec_id again")
        return running, second

    def _garbage_run(self, party: int) -> Case:
        """A damaged copy of a real program, loaded with a correct digest, then run."""
        program = self.rng.choice(self.programs)
        data, label = self._mutated_graph(program)
        digest = hashlib.sha256(data).hexdigest()
        header = pb.ProgramHeader(session=self.session, digest=digest, size=len(data))
        load = Call(
            party, "PartyService/LoadProgram", (chunk(header.SerializeToString(), data),), label
        )
        request = _execute_request(self.session, program, party, self.rng, timeout=RECEIVE_S)
        request.digest = digest
        run = Call(
            party, "PartyService/Execute", (request.SerializeToString(),), label, may_wait=True
        )
        return load, run


def _frame(header: Message) -> bytes:
    return bulk_frame(header.SerializeToString())


def _padded(head: bytes, size: int) -> bytes:
    """`head` with an unknown field (number 15) making it `size` bytes, as parsers skip."""
    filler = size - len(head) - 1 - len(varint(size))
    padded = head + length_field(15, bytes(filler))
    assert len(padded) == size, "the filler's length takes as many bytes as `size`"
    return padded


def _split(payload: bytes, rng: random.Random) -> list[bytes]:
    """`payload` in pieces of random sizes (at least one piece)."""
    pieces, start = [], 0
    while start < len(payload):
        size = rng.choice((1, 7, 4096, 1 << 20))
        pieces.append(payload[start : start + size])
        start += size
        if len(pieces) > 64:
            pieces.append(payload[start:])
            break
    return pieces or [b""]


def _tensor_types(msg: Message) -> list[Any]:
    """Every TensorType message inside `msg`."""
    found: list[Any] = []
    for parent, fd in _fields(msg):
        if fd.message_type is None or fd.message_type.full_name != "mpplug.TensorType":
            continue
        value = getattr(parent, fd.name)
        if fd.is_repeated:
            found += list(value)
        elif parent.HasField(fd.name):
            found.append(value)
    return found


# -- running cases -----------------------------------------------------------------------
class Runner:
    """Sends cases to the parties and classifies every answer."""

    def __init__(self, clients: Clients, parties: LocalParties, deadline: float) -> None:
        self.clients = clients
        self.parties = parties
        self.deadline = deadline

    def run_case(self, case: Case) -> list[Result]:
        """Send a case's calls in order (background ones first, collected last)."""
        results = []
        waiting: list[tuple[Call, Any, float]] = []
        for call in case:
            if call.background:
                stub = self.clients.method(call.party, call.identity, call.method)
                future = stub.future(call.messages[0], **self._options(call))
                waiting.append((call, future, time.monotonic()))
            else:
                results.append(self.invoke(call))
        for call, future, start in waiting:
            try:
                answer = _answer(call, future.result())
                results.append(Result(call, OK, answer, "", time.monotonic() - start))
            except grpc.RpcError as exc:
                results.append(self._failed(call, exc, start))
        return results

    def _options(self, call: Call) -> dict[str, Any]:
        """The call's deadline; and calls other than the outsider's wait for the connection
        (on a loaded machine a handshake may take long; that is a hang if it takes too long)."""
        deadline = STALL_S if call.stall else WAIT_S if call.may_wait else self.deadline
        return {"timeout": deadline, "wait_for_ready": call.identity != OUTSIDER}

    def invoke(self, call: Call) -> Result:
        """Send one call and classify its answer."""
        if isinstance(call, BulkCall):
            return self.exchange(call)
        method = METHODS[call.method]
        stub = self.clients.method(call.party, call.identity, call.method)
        options = self._options(call)
        start = time.monotonic()
        reply = None
        try:
            if method.client_streaming and method.server_streaming:
                release = threading.Event()
                try:
                    replies = list(stub(_stalling(call.messages, release, call.stall), **options))
                finally:
                    release.set()
                return _stream_result(call, replies, time.monotonic() - start)
            if method.client_streaming:
                release = threading.Event()
                try:
                    stub(_stalling(call.messages, release, call.stall), **options)
                finally:
                    release.set()
            elif method.server_streaming:
                replies = stub(call.messages[0], **options)
                if method.name == "Watch":  # endless: its first answer, then we hang up
                    next(replies, None)
                    replies.cancel()
                else:
                    for _ in replies:
                        pass
            else:
                reply = stub(call.messages[0], **options)
        except grpc.RpcError as exc:
            return self._failed(call, exc, start)
        return Result(call, OK, _answer(call, reply), "", time.monotonic() - start)

    def _failed(self, call: Call, exc: grpc.RpcError, start: float) -> Result:
        code, details = status_of(exc)
        kind = classify(call, code, details)
        if kind in (UNTYPED, HANG) and self._exited(call.party):
            kind = CRASH
        return Result(call, kind, code.name, details, time.monotonic() - start)

    def _exited(self, party: int) -> bool:
        return self.parties.processes[self.parties.spec.names[party]].poll() is not None

    def exchange(self, call: BulkCall) -> Result:
        """Send a bulk call over a connection of its own; its result is its most serious
        answer (the first of them)."""
        start = time.monotonic()
        answers = self._bulk_answers(call)
        kinds = [classify_bulk(call, answer) for answer in answers]
        worst = max(range(len(answers)), key=lambda i: KINDS.index(kinds[i]))
        kind, answer = kinds[worst], answers[worst]
        if kind in (UNTYPED, HANG) and self._exited(call.party):
            kind = CRASH
        return Result(call, kind, answer.code, answer.details, time.monotonic() - start)

    def _bulk_answers(self, call: BulkCall) -> list[BulkAnswer]:
        """The port's answer to each message sent in turn, until one is no reply or refuses
        a caller it must refuse."""
        try:
            sock = self.clients.bulk_socket(call.party, call.identity, self.deadline)
        except ssl.SSLError as exc:
            return [BulkAnswer(TLS_REFUSED, str(exc), last=False)]
        except TimeoutError:
            return [BulkAnswer(SILENT, "connecting", last=False)]
        except OSError as exc:
            return [BulkAnswer(CLOSED, f"connecting: {exc}", last=False)]
        answers: list[BulkAnswer] = []
        with contextlib.closing(sock):
            refused = False
            for i, message in enumerate(call.messages):
                if i % 2 and refused:
                    continue  # the bytes of a value refused are not sent
                answer = self._answer_to(sock, call, message, last=i == len(call.messages) - 1)
                answers.append(answer)
                refused = answer.code != GO_AHEAD
                if answer.code in (CLOSED, SILENT, TLS_REFUSED) or (refused and call.must_refuse):
                    break  # the connection is over (a caller refused is disconnected)
        return answers

    def _answer_to(
        self, sock: socket.socket, call: BulkCall, message: bytes, last: bool
    ) -> BulkAnswer:
        """Send one message (the last one, then hang up if the call does) and read the port's
        answer: within STALL_S after the last message of a stall, else the deadline."""
        seconds = STALL_S if last and call.stall else self.deadline
        try:
            with contextlib.suppress(OSError):  # refused and closed before it read all of it
                sock.settimeout(self.deadline)
                sock.sendall(message)
                if last and call.hang_up:  # the plain socket's: an SSLSocket's drops TLS
                    socket.socket.shutdown(sock, socket.SHUT_WR)
            code, details = read_bulk_reply(sock, seconds)
        except TimeoutError:
            return BulkAnswer(SILENT, f"none within {seconds} s", last)
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError, ConnectionError) as exc:
            return BulkAnswer(CLOSED, str(exc) or type(exc).__name__, last)
        except ssl.SSLError as exc:
            hung_up = last and call.hang_up  # TLS answers a stream ended uncleanly with an alert
            return BulkAnswer(CLOSED if hung_up else TLS_REFUSED, str(exc), last)
        return BulkAnswer(code, details, last)


def read_bulk_reply(sock: socket.socket, seconds: float) -> tuple[str, str]:
    """A bulk port's reply within `seconds`: its code's name and its message ("unknown
    status" or "unreadable reply" and what was wrong for one a sender would not take);
    TimeoutError if it does not come in time, ConnectionError if the connection ends first."""
    give_up = time.monotonic() + seconds
    number, length = BULK_REPLY.unpack(_receive(sock, BULK_REPLY.size, give_up))
    if length > MAX_REPLY_BYTES:
        return "unreadable reply", f"status {number} with a message of {length} bytes"
    message = _receive(sock, length, give_up).decode(errors="replace")
    code = STATUS_BY_NUMBER.get(number)
    if code is None:
        return "unknown status", f"status {number}: {message}"
    return code.name, message


def _receive(sock: socket.socket, size: int, give_up: float) -> bytes:
    data = bytearray()
    while len(data) < size:
        left = give_up - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(data)} of {size} bytes before the deadline")
        sock.settimeout(left)
        part = sock.recv(size - len(data))
        if not part:
            raise ConnectionError(f"closed after {len(data)} of {size} reply bytes")
        data += part
    return bytes(data)


def _stream_result(call: Call, replies: list[bytes], seconds: float) -> Result:
    """An ExecuteStream that ended OK: untyped if a reply is, or one is missing or unmatched."""
    sent = sorted(pb.ExecuteRequest.FromString(m).exec_id for m in call.messages if _decodes(m))
    answers = [pb.ExecuteReply.FromString(reply) for reply in replies]
    untyped = [
        a.refused.message
        for a in answers
        if a.WhichOneof("outcome") == "refused"
        and (a.refused.code == "UNKNOWN" or any(s in a.refused.message for s in UNTYPED_SIGNS))
    ]
    answered = sorted(a.exec_id for a in answers)
    if untyped or answered != sent:
        details = untyped[0] if untyped else f"replies for {answered}"
        return Result(call, UNTYPED, "OK", f"{details}; sent {sent}", seconds)
    outcomes = sorted({a.WhichOneof("outcome") or "none" for a in answers})
    return Result(call, OK, f"OK {'+'.join(outcomes)}", "", seconds)


def _decodes(message: bytes) -> bool:
    try:
        pb.ExecuteRequest.FromString(message)
    except DecodeError:
        return False
    return True


def _answer(call: Call, reply: bytes | None) -> str:
    """A successful reply's code: "OK", and for executions how they ended."""
    if call.method != "PartyService/Execute" or reply is None:
        return "OK"
    answer = pb.ExecuteReply.FromString(reply)
    outcome = answer.WhichOneof("outcome")
    if outcome == "party_error":
        return f"OK party_error {answer.party_error.error_type}"
    return f"OK {outcome}"


def _stalling(messages: Sequence[bytes], release: threading.Event, stall: bool) -> Iterator[bytes]:
    yield from messages
    if stall:
        release.wait(60.0)


# -- tallies -------------------------------------------------------------------------------
@dataclass
class Defect:
    """One kind of defect: how often it was seen, and its first example."""

    example: Call
    details: str
    count: int = 0


def _pattern(details: str) -> str:
    """The first line of an answer's details with its ids and numbers blanked, so that one
    kind of defect is counted once."""
    first = details.splitlines()[0] if details else ""
    return re.sub(r"\d+", "N", re.sub(r"[0-9a-f]{16,}", "<id>", first))[:200]


@dataclass
class Tally:
    """Counts of answers by method and kind, and each kind of defect with one example."""

    kinds: Counter[tuple[str, str]] = field(default_factory=Counter)
    codes: Counter[tuple[str, str]] = field(default_factory=Counter)
    defects: dict[tuple[str, str, str, str], Defect] = field(default_factory=dict)
    """By (kind, method, code, details pattern)."""
    crashed: dict[str, int | None] = field(default_factory=dict)
    slowest: dict[str, tuple[float, str]] = field(default_factory=dict)
    """The longest answer per method, among those not cut off by a short deadline."""

    def add(self, result: Result) -> None:
        method = result.call.method
        if result.kind != CUT:
            seen = (result.seconds, result.call.label)
            self.slowest[method] = max(self.slowest.get(method, seen), seen)
        self.kinds[method, result.kind] += 1
        self.codes[method, result.code] += 1
        if result.kind in DEFECTS:
            key = (result.kind, method, result.code, _pattern(result.details))
            self.defects.setdefault(key, Defect(result.call, result.details)).count += 1

    def total(self, kind: str | None = None) -> int:
        return sum(n for (_, k), n in self.kinds.items() if kind is None or k == kind)

    def methods(self) -> list[str]:
        return sorted({method for method, _ in self.kinds})


def fuzz(
    fixture: Fixture,
    clients: Clients,
    requests: int,
    seed: int,
    *,
    deadline: float = DEADLINE_S,
    concurrency: int = CONCURRENCY,
) -> Tally:
    """Send at least `requests` fuzzed calls (whole cases) to the parties, `concurrency` cases
    at a time; stops early if a party exits."""
    rng = random.Random(seed)
    session = f"{SESSION_PREFIX}{seed & 0xFFFFFFFF:08x}{uuid.uuid4().hex[:8]}"
    programs = real_programs()
    names = fixture.spec.names
    fuzzer = Fuzzer(rng, names, session, programs, fixture.identities is not None)
    runner = Runner(clients, fixture.parties, deadline)
    tally = Tally()
    sent = 0
    pending: set[Future[list[Result]]] = set()
    with (
        session_kept(clients, names, session, fixture.idle_timeout / 4),
        ThreadPoolExecutor(concurrency, thread_name_prefix="fuzz") as pool,
    ):
        establish(clients, session, programs)
        while sent < requests and fixture.parties.alive():
            case = fuzzer.case()
            sent += len(case)
            pending.add(pool.submit(runner.run_case, case))
            if len(pending) >= 2 * concurrency:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                _collect(done, tally)
        done, _ = wait(pending)
        _collect(done, tally)
    for name, process in fixture.parties.processes.items():
        if process.poll() is not None:
            tally.crashed[name] = process.returncode
    return tally


def _collect(done: set[Future[list[Result]]], tally: Tally) -> None:
    for future in done:
        for result in future.result():
            tally.add(result)


# -- checks around the fuzzing -------------------------------------------------------------
def _relay(x: Any) -> Any:
    return mp.run_jax_at(1, lambda v: v * 2, mp.p2p(0, 1, x))


def serve_check(fixture: Fixture, rounds: int = 10) -> str | None:
    """Run real programs through a Driver: streamed puts and fetches (more than a party has
    upload or download slots), a party-to-party value (over a chunk: it crosses the bulk
    port) and a dataset read, each result checked. None if all is well, else what went
    wrong."""
    payload = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: two chunks each way
    relay = mp.function(_relay)
    try:
        with Driver(fixture.parties.config, timeout=30.0) as driver:
            for i in range(rounds):
                x = driver.put(0, payload + i)
                got = driver.fetch(driver.evaluate(relay, x), party=1)
                if not np.array_equal(got, (payload + i) * 2):
                    return f"round {i}: relayed value differs from the one put"
            total = driver.fetch(driver.evaluate(mp.function(_reading)), party=1)
            if int(total) != 66:
                return f"dataset sum: expected 66, got {total}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def rss_bytes(pid: int) -> int:
    """A process's resident set size (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def rss(fixture: Fixture) -> dict[str, int]:
    return {name: rss_bytes(p.pid) for name, p in fixture.parties.processes.items()}


def open_sessions(clients: Clients) -> list[int]:
    """How many sessions each party holds (Status names no session, so renews none)."""
    status = clients.method
    request = pb.StatusRequest().SerializeToString()
    return [
        pb.StatusReply.FromString(
            status(k, DRIVER, "PartyService/Status")(request, timeout=10.0)
        ).sessions
        for k in range(WORLD)
    ]


def wait_for_expiry(fixture: Fixture, clients: Clients) -> tuple[float, list[int]]:
    """Wait until no party holds a session (or three idle timeouts and ten seconds passed),
    then one upkeep round more, for the values sent to executions that never started (they
    live as long as an idle session); (seconds waited, sessions still open per party)."""
    start = time.monotonic()
    limit = 3 * fixture.idle_timeout + 10.0
    while True:
        left = open_sessions(clients)
        waited = time.monotonic() - start
        if not any(left) or waited > limit:
            break
        time.sleep(0.25)
    time.sleep(UPKEEP_MAX_S)
    return waited, left


_EXCEPTION_LINE = re.compile(r"^\S.*")


def tracebacks(fixture: Fixture) -> dict[str, list[str]]:
    """Per party, the last line (the exception) of each traceback in its log."""
    found: dict[str, list[str]] = {}
    for name in fixture.parties.processes:
        lines = fixture.parties.log_path(name).read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if "Traceback (most recent call last)" not in line:
                continue
            after = (m.group(0) for m in map(_EXCEPTION_LINE.match, lines[i + 1 :]) if m)
            found.setdefault(name, []).append(next(after, "(log ends)")[:300])
    return found


# -- a whole run ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Memory:
    """RSS per party (bytes) at each point, and how the sessions expired: at the start (one
    real program run), at the baseline (after the warm-up, once its sessions expired), after
    the measured requests, and once their sessions expired."""

    start: dict[str, int]
    baseline: dict[str, int]
    after: dict[str, int]
    expired: dict[str, int]
    expiry_s: float
    sessions_left: list[int]

    def growth(self, at: dict[str, int]) -> int:
        return max(at[name] - self.baseline[name] for name in self.baseline)


@dataclass(frozen=True)
class Report:
    """What one run found."""

    tls: bool
    tally: Tally
    seconds: float
    tracebacks: dict[str, list[str]]
    serve_error: str | None
    memory: Memory | None

    @property
    def traceback_count(self) -> int:
        return sum(len(found) for found in self.tracebacks.values())


def run(
    workdir: Path,
    *,
    tls: bool,
    requests: int,
    seed: int,
    warmup: int = 0,
    measure_memory: bool = False,
    deadline: float = DEADLINE_S,
    concurrency: int = CONCURRENCY,
    idle_timeout: float = IDLE_TIMEOUT_S,
) -> Report:
    """Start a cluster and check it serves; fuzz it with `warmup` requests, then (with
    `measure_memory`, once their sessions expired, RSS taken) with `requests` more; then
    check it still serves and scan its logs. The cluster is gone when this returns.

    The warm-up replays the measured requests (same seed): a party keeps programs and their
    compiled code across sessions, in caches of 128 programs and 256 compiled functions, so
    new programs grow it until those are full, by design; replayed, they fill the caches
    before the baseline, and the growth measured is what the requests leave behind."""
    with cluster(workdir, tls=tls, idle_timeout=idle_timeout) as fixture:
        clients = Clients(fixture)
        try:
            before = serve_check(fixture)
            if before is not None:
                raise RuntimeError(f"the cluster does not serve before fuzzing: {before}")
            start = rss(fixture)
            if warmup:
                fuzz(fixture, clients, warmup, seed, deadline=deadline, concurrency=concurrency)
            baseline = settled_rss(fixture, clients) if measure_memory else None
            began = time.monotonic()
            tally = fuzz(
                fixture, clients, requests, seed, deadline=deadline, concurrency=concurrency
            )
            seconds = time.monotonic() - began
            memory = None
            if baseline is not None and fixture.parties.alive():
                after = rss(fixture)
                expiry_s, left = wait_for_expiry(fixture, clients)
                memory = Memory(start, baseline, after, rss(fixture), expiry_s, left)
            alive = fixture.parties.alive()
            serve_error = serve_check(fixture) if alive else "a party exited"
            return Report(tls, tally, seconds, tracebacks(fixture), serve_error, memory)
        finally:
            clients.close()


def settled_rss(fixture: Fixture, clients: Clients) -> dict[str, int]:
    """RSS per party once every session expired; RuntimeError if some never did."""
    waited, left = wait_for_expiry(fixture, clients)
    if any(left):
        raise RuntimeError(f"sessions still open {waited:.0f}s after the warm-up: {left}")
    return rss(fixture)


# -- output --------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def print_table(report: Report) -> None:
    """Answers by method and kind, the slowest answer, the most frequent codes."""
    tally = report.tally
    print(f"| method | inputs | {' | '.join(KINDS)} | slowest | answers |")
    print(f"|---|---:|{'---:|' * len(KINDS)}---:|---|")
    for method in tally.methods():
        counts = [tally.kinds[method, kind] for kind in KINDS]
        codes = sorted(
            ((n, code) for (m, code), n in tally.codes.items() if m == method), reverse=True
        )
        answers = ", ".join(f"{code} {n}" for n, code in codes[:4])
        slowest = f"{tally.slowest.get(method, (0.0, ''))[0]:.2f} s"
        print(
            f"| {method} | {sum(counts)} | {' | '.join(map(str, counts))} | {slowest} | {answers} |"
        )
    totals = [tally.total(kind) for kind in KINDS]
    print(f"| all | {tally.total()} | {' | '.join(map(str, totals))} | | |")


def print_defects(report: Report) -> None:
    """The slowest answers, then each kind of defect with an example to send again."""
    slow = sorted(((s, m, label) for m, (s, label) in report.tally.slowest.items()), reverse=True)
    for seconds, method, label in slow[:5]:
        print(f"- slowest {method}: {seconds:.2f} s [{label}]")
    for (kind, method, code, _), defect in sorted(
        report.tally.defects.items(), key=lambda item: -item[1].count
    ):
        example = defect.example
        print(f"- {kind} x{defect.count}: {method} -> {code}: {defect.details[:300]}")
        print(f"    e.g. [{example.label}] {example.reproduction()}")
    for party, lines in report.tracebacks.items():
        for line, n in Counter(lines).most_common():
            print(f"- traceback x{n} in party {party}'s log: {line}")
    for name, exit_code in report.tally.crashed.items():
        print(f"- crash: party {name} exited with code {exit_code}")


def summary(report: Report) -> str:
    """One line: inputs, crashes, hangs, untyped errors, tracebacks and RSS."""
    t = report.tally
    line = (
        f"{'TLS' if report.tls else 'plain'}: {t.total()} inputs in {report.seconds:.1f}s, "
        f"{len(t.crashed)} crashes, {t.total(HANG)} hangs, {t.total(UNTYPED)} untyped errors, "
        f"{report.traceback_count} tracebacks in the logs (warm-up included), "
        f"{t.total(HEALTH_INTERNAL)} health INTERNAL"
    )
    memory = report.memory
    if memory is not None:
        points = (memory.start, memory.baseline, memory.after, memory.expired)
        per_party = ", ".join(
            f"{name} {'/'.join(_mib(at[name]) for at in points)}" for name in memory.baseline
        )
        line += f"; RSS MiB start/baseline/after/expired: {per_party}"
        line += f"; sessions expired in {memory.expiry_s:.1f}s"
    return line


def targets(report: Report) -> list[Target]:
    """No defect of any kind; with memory measured, RSS growth within the limits."""
    t = report.tally
    found = [
        Target("no party crashed", not t.crashed and not t.total(CRASH), str(len(t.crashed))),
        Target("no call hung", t.total(HANG) == 0, str(t.total(HANG))),
        Target("no untyped error", t.total(UNTYPED) == 0, str(t.total(UNTYPED))),
        Target(
            "no traceback in the party logs",
            not report.traceback_count,
            str(report.traceback_count),
        ),
        Target(
            "the parties serve real programs afterwards",
            report.serve_error is None,
            report.serve_error or "yes",
        ),
    ]
    memory = report.memory
    if memory is not None:
        after, expired = memory.growth(memory.after), memory.growth(memory.expired)
        found += [
            Target(
                f"RSS growth after {t.total()} inputs < {GROWTH_LIMIT_MIB} MiB per party",
                after < GROWTH_LIMIT_MIB << 20,
                f"{_mib(after)} MiB",
            ),
            Target(
                f"RSS within {EXPIRED_LIMIT_MIB} MiB of baseline once every session expired",
                expired < EXPIRED_LIMIT_MIB << 20 and not any(memory.sessions_left),
                f"{_mib(expired)} MiB, sessions left {memory.sessions_left}",
            ),
        ]
    return found


def dump(report: Report, path: Path) -> None:
    """Every defect with its full reproduction, as JSON."""
    entries = [
        {
            "kind": kind,
            "method": method,
            "label": defect.example.label,
            "code": code,
            "details": defect.details,
            "count": defect.count,
            "party": defect.example.party,
            "identity": defect.example.identity,
            "stall": defect.example.stall,
            "hang_up": isinstance(defect.example, BulkCall) and defect.example.hang_up,
            "messages_hex": [m.hex() for m in defect.example.messages],
        }
        for (kind, method, code, _), defect in report.tally.defects.items()
    ]
    path.write_text(json.dumps({"tracebacks": report.tracebacks, "defects": entries}, indent=1))


def main(argv: list[str] | None = None) -> int:
    """Fuzz a fresh cluster after a warm-up of the same requests; exit 1 on any defect."""
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__)
    parser.add_argument("--tls", action="store_true", help="parties with mutual TLS")
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dump", type=Path, help="write every defect's reproduction here (JSON)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mpplug-fuzz-") as tmp:
        report = run(
            Path(tmp),
            tls=args.tls,
            requests=args.requests,
            seed=args.seed,
            warmup=args.requests,
            measure_memory=True,
        )
    print_table(report)
    print()
    print_defects(report)
    print(summary(report))
    if args.dump is not None:
        dump(report, args.dump)
    return verdict(targets(report))


if __name__ == "__main__":
    sys.exit(main())
