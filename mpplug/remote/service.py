"""The driver-facing service of a party: sessions, values in and out, programs and executions.

Every request is validated; a bad one is answered INVALID_ARGUMENT or NOT_FOUND and the party
keeps serving. Executions run on the shared `Party` against the session's value store.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

from mpplug.config import ClusterSpec
from mpplug.core import TensorType
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.outcomes import COMPLETED, EXECUTION_ERRORS, failure_reply
from mpplug.remote.rpc import BadRequest, check_id, check_name, handle_errors
from mpplug.remote.session import Session, Sessions
from mpplug.remote.streaming import encode_chunks, read_chunks, receive_bytes, receive_tensor
from mpplug.runtime import codec
from mpplug.runtime.communicator import Mailbox
from mpplug.runtime.party import Party

MAX_PROGRAM_BYTES = 1 << 30
"""The largest program a party accepts (programs embed their constants)."""

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest receive timeout an execution may ask for."""


class PartyServicer(rpc_pb.PartyServiceServicer):
    """Serves one party's sessions to drivers."""

    RAW_REQUESTS = ("Put", "PutSmall", "LoadProgram")
    """Methods that read their chunk messages themselves (streaming.read_chunks)."""

    def __init__(self, spec: ClusterSpec, party: Party, mailbox: Mailbox) -> None:
        self._names = spec.names
        self._party = party
        self._mailbox = mailbox
        self._sessions = Sessions()
        self._running: set[str] = set()
        self._lock = threading.Lock()
        self._started = time.monotonic()

    @property
    def name(self) -> str:
        return self._names[self._party.rank]

    @handle_errors
    def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
    ) -> pb.OpenSessionReply:
        if list(request.parties) != self._names:
            raise BadRequest(
                f"the driver's cluster lists parties {list(request.parties)}, "
                f"but party {self.name}'s lists {self._names}"
            )
        self._sessions.open(request.session)
        return pb.OpenSessionReply(party=self.name, rank=self._party.rank)

    @handle_errors
    def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
    ) -> pb.CloseSessionReply:
        session = self._sessions.close(request.session)
        return pb.CloseSessionReply(values_dropped=len(session))

    @handle_errors
    def Put(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> pb.PutReply:
        return self._put(chunks)

    @handle_errors
    def PutSmall(self, chunk: bytes, context: grpc.ServicerContext) -> pb.PutReply:
        return self._put(iter([chunk]))

    def _put(self, chunks: Iterator[bytes]) -> pb.PutReply:
        header, parts = read_chunks(chunks, pb.PutChunk, "Put")
        session = self._sessions.get(header.session)
        name = check_name(header.name, "Put name")
        where = f"Put {name!r}"
        ttype = codec.decode_type(header.type, where)
        session.store({name: receive_tensor(ttype, parts, where)})
        return pb.PutReply()

    @handle_errors
    def LoadProgram(
        self, chunks: Iterator[bytes], context: grpc.ServicerContext
    ) -> pb.LoadProgramReply:
        header, parts = read_chunks(chunks, pb.ProgramChunk, "LoadProgram")
        self._sessions.get(header.session)
        where = f"program {header.digest[:12]}"
        if header.size > MAX_PROGRAM_BYTES:
            raise BadRequest(
                f"{where}: {header.size} bytes is over the limit of {MAX_PROGRAM_BYTES}"
            )
        data = receive_bytes(header.size, parts, where).tobytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != header.digest:
            raise BadRequest(f"{where}: the bytes received have digest {digest}")
        return pb.LoadProgramReply(digest=self._party.load_program(data))

    @handle_errors
    def Execute(self, request: pb.ExecuteRequest, context: grpc.ServicerContext) -> pb.ExecuteReply:
        session = self._sessions.get(request.session)
        session.release(request.release)
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
        try:
            values = self._run(request.digest, exec_id, inputs, request.timeout, context)
        except EXECUTION_ERRORS as exc:
            return failure_reply(exc)
        session.store(
            {name: value for name, value in zip(outputs, values, strict=True) if value is not None}
        )
        return COMPLETED

    def _run(
        self,
        digest: str,
        exec_id: str,
        inputs: list[Any],
        timeout: float,
        context: grpc.ServicerContext,
    ) -> list[Any]:
        """Run one execution; if its call ends first (the driver cancelled or went away),
        its receives are aborted so it does not wait out the timeout."""
        with self._lock:
            if exec_id in self._running:
                raise BadRequest(f"execution {exec_id} is already running on this party")
            self._running.add(exec_id)
        finished = threading.Event()

        def on_call_done() -> None:
            if not finished.is_set():
                self._mailbox.abort(exec_id, "the driver cancelled the execution")

        context.add_callback(on_call_done)
        try:
            return self._party.execute(digest, exec_id, inputs, timeout)
        finally:
            finished.set()
            self._mailbox.finish(exec_id)
            with self._lock:
                self._running.discard(exec_id)

    def _inputs(self, session: Session, names: list[str], held: list[Any]) -> list[Any]:
        """Argument values this party holds (None elsewhere), checked against the program."""
        inputs: list[Any] = [None] * len(names)
        for op in held:
            name = names[op.input_index]
            value = session.get(name)
            got = TensorType(value.dtype, value.shape)
            if got != op.outs[0]:
                raise BadRequest(
                    f"argument {op.input_index} ({name!r}): expected {op.outs[0]}, got {got}"
                )
            inputs[op.input_index] = value
        return inputs

    @handle_errors
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortReply:
        self._sessions.get(request.session)
        exec_id = check_id(request.exec_id, "exec_id")
        self._mailbox.abort(exec_id, request.reason or "aborted by the driver")
        return pb.AbortReply()

    @handle_errors
    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        session = self._sessions.get(request.session)
        session.release(request.release)
        value = session.get(request.name)
        array = codec.as_host_array(np.asarray(value))
        return encode_chunks(codec.encode_type(array), array)

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
            uptime_s=time.monotonic() - self._started,
        )
