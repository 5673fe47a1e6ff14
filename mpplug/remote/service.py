"""The driver-facing service of a party: sessions, values in and out, programs and executions.

Every request is validated; a bad one is answered INVALID_ARGUMENT or NOT_FOUND and the party
keeps serving. Executions run on the shared `Party` against the session's value store, under
ids scoped to the session. Executions and streams hold slots (`limits`); over them a call is
answered RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from mpplug.config import ClusterSpec, ServerLimits
from mpplug.core import TableType, TensorType
from mpplug.core.serde import value_type_to_proto
from mpplug.errors import DatasetError, WireError
from mpplug.kernels.registry import REGISTRY
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.executions import ExecutionStream, OnCallEnd
from mpplug.remote.limits import Slots, StreamWatch
from mpplug.remote.outcomes import (
    COMPLETED,
    EXECUTION_ERRORS,
    add_inline,
    add_spans,
    failure_reply,
)
from mpplug.remote.peer import PeerCommunicator
from mpplug.remote.rpc import (
    STREAM_REFUSED_KEY,
    WIRE_VERSION,
    BadRequest,
    Exhausted,
    Forbidden,
    NotFound,
    VersionMismatch,
    check_id,
    check_name,
    describe_version,
    handle_errors,
    scoped_id,
)
from mpplug.remote.session import Session, Sessions
from mpplug.remote.streaming import encode_chunks, read_chunks, receive_joined, receive_tensor
from mpplug.remote.tls import peer_common_name
from mpplug.runtime import codec
from mpplug.runtime.communicator import Mailbox
from mpplug.runtime.party import Party
from mpplug.runtime.profile import Recorder

log = logging.getLogger(__name__)

MAX_PROGRAM_BYTES = 1 << 30
"""The largest program a party accepts (programs embed their constants)."""

MAX_FETCH_NAMES = 4096
"""The most values one FetchMany streams."""

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest receive timeout an execution may ask for."""

SMALL_REPLY_BYTES = 32 << 10
"""A Fetch or FetchMany of at most this many bytes takes no download slot: its reply fits well
within the driver's initial 64 KiB HTTP/2 flow-control window, so sending it never waits on the
driver (as a PutSmall or LoadProgramSmall, read whole before it runs, takes no upload slot)."""


class PartyServicer(rpc_pb.PartyServiceServicer):
    """Serves one party's sessions to drivers."""

    RAW_REQUESTS = ("Put", "PutSmall", "LoadProgram", "LoadProgramSmall", "ExecuteStream")
    """Methods that read their chunk messages themselves (streaming.read_chunks)."""

    ANY_MEMBER = ("Status",)
    """Methods any certificate of the cluster may call, parties' included."""

    def __init__(
        self,
        spec: ClusterSpec,
        party: Party,
        mailbox: Mailbox,
        comm: PeerCommunicator,
        *,
        limits: ServerLimits,
        watch: StreamWatch,
        session_idle_timeout: float,
    ) -> None:
        self._names = spec.names
        self._tls = spec.tls
        self._party = party
        self._mailbox = mailbox
        self._comm = comm
        self._sessions = Sessions(limits.sessions, session_idle_timeout)
        self._executes = Slots("executions", limits.executes)
        self._execute_streams = Slots("execution streams", limits.execute_streams)
        self._stream_runs = ThreadPoolExecutor(
            limits.executes, thread_name_prefix=f"mpplug-{self.name}-execute"
        )
        self._uploads = Slots("value and program uploads", limits.uploads)
        self._downloads = Slots("value downloads", limits.downloads)
        self._watch = watch
        self._running: set[str] = set()
        self._executions_begun = 0
        self._streams: set[ExecutionStream] = set()
        self._draining = False
        self._lock = threading.Lock()
        self._started = time.monotonic()

    @property
    def name(self) -> str:
        return self._names[self._party.rank]

    def activity(self) -> tuple[int, int]:
        """(executions begun since the start, executions running now)."""
        with self._lock:
            return self._executions_begun, len(self._running)

    def drain(self) -> None:
        """The server is stopping: open execution streams refuse new requests and end once
        those they hold have their replies; new streams are refused."""
        with self._lock:
            self._draining = True
            streams = list(self._streams)
        for stream in streams:
            stream.drain()

    def close(self) -> None:
        """Let the threads running executions from streams go (the server has stopped: the
        executions were aborted with their calls)."""
        self._stream_runs.shutdown(wait=False)

    def admit(self, context: grpc.ServicerContext, method: str) -> None:
        """With TLS, only drivers call this service (Status aside): a certificate naming a
        party is refused, so a party cannot open sessions or run programs on another."""
        if not self._tls or method in self.ANY_MEMBER:
            return
        caller = peer_common_name(context)
        if caller in self._names:
            raise Forbidden(
                f"party {self.name} takes {method} only from a driver, but the caller's "
                f"certificate names party {caller!r}"
            )

    @handle_errors
    def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
    ) -> pb.OpenSessionReply:
        if request.wire_version != WIRE_VERSION:
            raise VersionMismatch(
                f"party {self.name} speaks mpplug wire version {WIRE_VERSION}, but the driver "
                f"speaks {describe_version(request.wire_version)}; run one mpplug release on "
                f"the driver and every party"
            )
        if list(request.parties) != self._names:
            raise BadRequest(
                f"the driver's cluster lists parties {list(request.parties)}, "
                f"but party {self.name}'s lists {self._names}"
            )
        self._sessions.open(request.session)
        return pb.OpenSessionReply(
            party=self.name,
            rank=self._party.rank,
            idle_timeout=self._sessions.idle_timeout,
            kernels=REGISTRY.fn_types(),
            wire_version=WIRE_VERSION,
        )

    @handle_errors
    def KeepAlive(
        self, request: pb.KeepAliveRequest, context: grpc.ServicerContext
    ) -> pb.KeepAliveReply:
        self._sessions.get(request.session)
        return pb.KeepAliveReply()

    def expire_sessions(self) -> int:
        """Close the sessions idle for longer than their timeout; returns how many."""
        expired = self._sessions.expire()
        for session in expired:
            log.info(
                "party %s: closed session %s, idle for over %gs, and its %d value(s)",
                self.name,
                session.id,
                self._sessions.idle_timeout,
                len(session),
            )
        return len(expired)

    @handle_errors
    def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
    ) -> pb.CloseSessionReply:
        session = self._sessions.close(request.session)
        return pb.CloseSessionReply(values_dropped=len(session))

    @handle_errors
    def Put(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> pb.PutReply:
        self._uploads.hold_for(context)
        return self._put(self._watch.watch(context, chunks))

    @handle_errors
    def PutSmall(self, chunk: bytes, context: grpc.ServicerContext) -> pb.PutReply:
        return self._put(iter([chunk]))

    def _put(self, chunks: Iterator[bytes]) -> pb.PutReply:
        header, parts = read_chunks(chunks, pb.PutChunk, "Put")
        session = self._sessions.get(header.session)
        name = check_name(header.name, "Put name")
        where = f"Put {name!r}"
        ttype = codec.decode_type(header.type, where)
        session.store({name: codec.finish(header.type, receive_tensor(ttype, parts, where), where)})
        return pb.PutReply()

    @handle_errors
    def LoadProgram(
        self, chunks: Iterator[bytes], context: grpc.ServicerContext
    ) -> pb.LoadProgramReply:
        self._uploads.hold_for(context)
        return self._load_program(self._watch.watch(context, chunks))

    @handle_errors
    def LoadProgramSmall(self, chunk: bytes, context: grpc.ServicerContext) -> pb.LoadProgramReply:
        return self._load_program(iter([chunk]))

    def _load_program(self, messages: Iterator[bytes]) -> pb.LoadProgramReply:
        header, parts = read_chunks(messages, pb.ProgramChunk, "LoadProgram")
        self._sessions.get(header.session)
        where = f"program {header.digest[:12]}"
        if header.size > MAX_PROGRAM_BYTES:
            raise BadRequest(
                f"{where}: {header.size} bytes is over the limit of {MAX_PROGRAM_BYTES}"
            )
        data = receive_joined(header.size, parts, where)
        digest = hashlib.sha256(data).hexdigest()
        if digest != header.digest:
            raise BadRequest(
                f"{where}: the bytes received have digest {digest}, the header says {header.digest}"
            )
        # Execute names the digest of these bytes, so they must be the canonical form.
        return pb.LoadProgramReply(digest=self._party.load_program(data, expected_digest=digest))

    @handle_errors
    def Execute(self, request: pb.ExecuteRequest, context: grpc.ServicerContext) -> pb.ExecuteReply:
        session = self.admit_execution(request)
        try:
            return self.execute(request, session, lambda abort: _on_call_end(context, abort))
        finally:
            self.end_execution()

    @handle_errors
    def ExecuteStream(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        try:
            self._execute_streams.hold_for(context)
        except Exhausted:
            context.set_trailing_metadata(((STREAM_REFUSED_KEY, "1"),))
            raise
        stream = ExecutionStream(self, self._stream_runs, context)
        with self._lock:
            if self._draining:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the party is stopping")
            self._streams.add(stream)
        context.add_callback(lambda: self._forget_stream(stream))
        return stream.replies(requests)

    def _forget_stream(self, stream: ExecutionStream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def admit_execution(self, request: pb.ExecuteRequest) -> Session:
        """The request's session, its releases applied, and an execution slot taken for it
        (`end_execution` gives it back); raises one of REFUSALS if there is none free."""
        session = self._sessions.get(request.session)
        session.release(request.release)
        self._executes.take()
        return session

    def end_execution(self) -> None:
        self._executes.give_back()

    def execute(
        self, request: pb.ExecuteRequest, session: Session, on_end: OnCallEnd
    ) -> pb.ExecuteReply:
        """Run one admitted Execute request; `on_end(abort)` has `abort` called if the call
        carrying the request ends first. Raises one of REFUSALS for a request refused
        before it runs."""
        exec_id = check_id(request.exec_id, "exec_id")
        if not (0 < request.timeout <= MAX_TIMEOUT_S and math.isfinite(request.timeout)):
            raise BadRequest(
                f"timeout: expected 0 < seconds <= {MAX_TIMEOUT_S:g}, got {request.timeout}"
            )
        interpreter = self._party.interpreter(request.digest)
        graph = interpreter.graph
        if len(request.inputs) != len(graph.input_ops):
            raise BadRequest(
                f"program {graph.name!r} takes {len(graph.input_ops)} arguments, "
                f"got {len(request.inputs)} input names"
            )
        if len(request.outputs) != len(graph.outputs):
            raise BadRequest(
                f"program {graph.name!r} has {len(graph.outputs)} outputs, "
                f"got {len(request.outputs)} output names"
            )
        outputs = [check_name(name, f"output {i}") for i, name in enumerate(request.outputs)]
        inputs = self._inputs(session, list(request.inputs), interpreter.input_ops)
        run_id = scoped_id(session.id, exec_id)
        recorder = Recorder(self._party.rank) if request.profile else None
        try:
            values = self._run(request.digest, run_id, inputs, request.timeout, on_end, recorder)
        except EXECUTION_ERRORS as exc:
            reply = failure_reply(exc)
            if recorder is not None:
                add_spans(reply, recorder.spans)
            return reply
        held = [
            (name, value) for name, value in zip(outputs, values, strict=True) if value is not None
        ]
        session.store(dict(held))
        if recorder is None and not request.inline_max_bytes:
            return COMPLETED
        reply = pb.ExecuteReply(completed=pb.Completed())
        if recorder is not None:
            add_spans(reply, recorder.spans)
        if request.inline_max_bytes:
            add_inline(reply, held, request.inline_max_bytes)
        return reply

    def _run(
        self,
        digest: str,
        run_id: str,
        inputs: list[Any],
        timeout: float,
        on_end: OnCallEnd,
        recorder: Recorder | None,
    ) -> list[Any]:
        """Run one execution (`run_id` as `scoped_id` makes it); if its call ends first (the
        driver cancelled or went away), it is aborted so it does not wait out the timeout."""
        with self._lock:
            if run_id in self._running:
                raise BadRequest(f"execution {run_id} is already running on this party")
            self._running.add(run_id)
            self._executions_begun += 1
        finished = threading.Event()

        def on_call_done() -> None:
            if not finished.is_set():
                self._abort(run_id, "the driver cancelled the execution")

        forget = on_end(on_call_done)
        self._mailbox.start(run_id)
        try:
            outputs = self._party.execute(digest, run_id, inputs, timeout, recorder)
            self._comm.settle(run_id)  # done once every value it sent is delivered
            return outputs
        finally:
            finished.set()
            forget()
            self._mailbox.finish(run_id)
            self._comm.finish(run_id)
            with self._lock:
                self._running.discard(run_id)

    def _abort(self, run_id: str, reason: str) -> None:
        """Wake the receives of `run_id` and cancel its sends in flight."""
        self._mailbox.abort(run_id, reason)
        self._comm.cancel(run_id)

    def _inputs(self, session: Session, names: list[str], held: list[Any]) -> list[Any]:
        """Argument values this party holds (None elsewhere), checked against the program."""
        inputs: list[Any] = [None] * len(names)
        for op in held:
            name = names[op.input_index]
            value, expected = session.get(name), op.outs[0]
            where = f"argument {op.input_index} ({name!r})"
            if isinstance(expected, TableType):
                try:
                    value = codec.received_table(value, expected, where)
                except WireError as exc:
                    raise BadRequest(str(exc)) from None
            elif codec.is_table(value) or TensorType(value.dtype, value.shape) != expected:
                got = "a table" if codec.is_table(value) else TensorType(value.dtype, value.shape)
                raise BadRequest(f"{where}: expected {expected}, got {got}")
            inputs[op.input_index] = value
        return inputs

    @handle_errors
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortReply:
        self._sessions.get(request.session)
        exec_id = check_id(request.exec_id, "exec_id")
        self._abort(scoped_id(request.session, exec_id), request.reason or "aborted by the driver")
        return pb.AbortReply()

    @handle_errors
    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        session = self._sessions.get(request.session)
        session.release(request.release)
        value_type, array = codec.encode(session.get(request.name))
        if array.nbytes > SMALL_REPLY_BYTES:
            self._downloads.hold_for(context)
        return self._watch.watch(context, encode_chunks(value_type, array))

    @handle_errors
    def FetchMany(
        self, request: pb.FetchManyRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        if len(request.names) > MAX_FETCH_NAMES:
            raise BadRequest(
                f"FetchMany: at most {MAX_FETCH_NAMES} names a call, got {len(request.names)}"
            )
        session = self._sessions.get(request.session)
        session.release(request.release)
        encoded = [
            codec.encode(session.get(check_name(name, f"names[{i}]")))
            for i, name in enumerate(request.names)
        ]
        if sum(array.nbytes for _, array in encoded) > SMALL_REPLY_BYTES:
            self._downloads.hold_for(context)
        stream = (chunk for header, array in encoded for chunk in encode_chunks(header, array))
        return self._watch.watch(context, stream)

    @handle_errors
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseReply:
        released = self._sessions.get(request.session).release(request.names)
        return pb.ReleaseReply(released=released)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return pb.StatusReply(
            party=self.name,
            rank=self._party.rank,
            world_size=self._party.world_size,
            sessions=len(self._sessions),
            executions=len(self._running),
            uptime_s=time.monotonic() - self._started,
            datasets=[
                pb.Dataset(name=name, type=value_type_to_proto(ttype))
                for name, ttype in sorted(self._party.runtime.datasets.types().items())
            ],
        )

    @handle_errors
    def DatasetInfo(
        self, request: pb.DatasetInfoRequest, context: grpc.ServicerContext
    ) -> pb.DatasetInfoReply:
        self._sessions.get(request.session)
        try:
            ttype = self._party.runtime.datasets.info(request.name)
        except DatasetError as exc:
            raise NotFound("dataset", str(exc)) from None
        return pb.DatasetInfoReply(type=value_type_to_proto(ttype))


def _on_call_end(context: grpc.ServicerContext, abort: Callable[[], None]) -> Callable[[], None]:
    """OnCallEnd for a unary call: the callback goes with the call, nothing to undo."""
    context.add_callback(abort)
    return lambda: None
