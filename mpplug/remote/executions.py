"""Executions over one long-lived ExecuteStream call: the party side that serves it and the
driver side that feeds it. A message each way per execution costs less than a call each.

Replies name their request's exec_id and come back in the order executions end, so one slow
execution holds up no other. A request the party refuses gets a `Refused` reply (what Execute
would answer with a status); the stream itself ends only when its call does, and then every
execution still running on it is aborted.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from mpplug.protos import service_pb2 as pb
from mpplug.remote.limits import Slots
from mpplug.remote.outcomes import COMPLETED
from mpplug.remote.rpc import MAX_DETAILS_CHARS, REFUSALS, refusal_of, status_of

log = logging.getLogger(__name__)

OnCallEnd = Callable[[Callable[[], None]], Callable[[], None]]
"""Given an abort callback, arranges for it to run if the call carrying an execution ends
before the execution does; returns what undoes that once the execution is over."""

Execute = Callable[[pb.ExecuteRequest, OnCallEnd], pb.ExecuteReply]
"""Runs one execution request (PartyServicer.execute); raises one of REFUSALS to refuse it."""


class ExecutionStream:
    """The party side of one ExecuteStream: a thread of its own reads the requests, each takes
    one of `slots` (refused at once when none is free, as Execute is) and runs on `runs`, and
    the replies are yielded as executions end."""

    def __init__(
        self,
        execute: Execute,
        slots: Slots,
        runs: ThreadPoolExecutor,
        context: grpc.ServicerContext,
    ) -> None:
        self._execute = execute
        self._slots = slots
        self._runs = runs
        self._context = context
        self._replies: queue.SimpleQueue[pb.ExecuteReply | _End] = queue.SimpleQueue()
        self._aborts: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._ended = False
        context.add_callback(self._call_ended)

    def replies(self, requests: Iterator[bytes]) -> Iterator[bytes]:
        """The serialized replies, until the requests end and every execution has replied."""
        threading.Thread(
            target=self._read, args=(requests,), name="mpplug-execute-stream", daemon=True
        ).start()
        outstanding, reading = 0, True
        while reading or outstanding:
            item = self._replies.get()
            if isinstance(item, _End):
                reading, outstanding = False, outstanding + item.requests
                if item.error:
                    self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, item.error)
                continue
            outstanding -= 1
            yield item.SerializeToString()

    def _read(self, requests: Iterator[bytes]) -> None:
        count, error = 0, ""
        try:
            for i, data in enumerate(requests):
                try:
                    request = pb.ExecuteRequest.FromString(data)
                except DecodeError as exc:
                    error = (
                        f"ExecuteStream message {i} does not decode as mpplug.ExecuteRequest: {exc}"
                    )
                    break
                count += 1
                self._start(request)
        except grpc.RpcError:
            pass  # the call ended (the driver cancelled or went away)
        self._replies.put(_End(count, error[:MAX_DETAILS_CHARS]))

    def _start(self, request: pb.ExecuteRequest) -> None:
        try:
            self._slots.take()
        except REFUSALS as exc:
            self._replies.put(_refused(request, exc))
            return
        self._runs.submit(self._run, request)

    def _run(self, request: pb.ExecuteRequest) -> None:
        try:
            reply = self._execute(request, self._on_end)
        except REFUSALS as exc:
            reply = _refused(request, exc)
        except Exception as exc:  # never leave the driver waiting: answer as gRPC would
            log.exception("execution %s failed unexpectedly", request.exec_id)
            message = f"{type(exc).__name__}: {exc}"[:MAX_DETAILS_CHARS]
            reply = pb.ExecuteReply(refused=pb.Refused(code="UNKNOWN", message=message))
        finally:
            self._slots.give_back()
        if reply is COMPLETED:
            reply = pb.ExecuteReply(completed=pb.Completed())
        reply.exec_id = request.exec_id
        self._replies.put(reply)

    def _on_end(self, abort: Callable[[], None]) -> Callable[[], None]:
        key = id(abort)
        with self._lock:
            if not self._ended:
                self._aborts[key] = abort
                return lambda: self._forget(key)
        abort()
        return lambda: None

    def _forget(self, key: int) -> None:
        with self._lock:
            self._aborts.pop(key, None)

    def _call_ended(self) -> None:
        with self._lock:
            self._ended = True
            aborts, self._aborts = list(self._aborts.values()), {}
        for abort in aborts:
            abort()


@dataclass(frozen=True)
class _End:
    """The requests ended after `requests` of them; `error`: why, if the driver's were bad."""

    requests: int
    error: str


def _refused(request: pb.ExecuteRequest, exc: Exception) -> pb.ExecuteReply:
    code, message, missing = refusal_of(exc)
    return pb.ExecuteReply(
        exec_id=request.exec_id,
        refused=pb.Refused(code=code.name, message=message, missing=missing),
    )


@dataclass(frozen=True)
class StreamFailure:
    """How a stream ended for the executions still waiting on it: a gRPC status."""

    code: grpc.StatusCode
    details: str

    @property
    def refused(self) -> bool:
        """Whether the party refused the stream itself (all its execution streams are taken),
        before reading any request: those may go as Execute calls instead."""
        return self.code is grpc.StatusCode.RESOURCE_EXHAUSTED


Outcome = pb.ExecuteReply | StreamFailure
"""How an execution sent on a stream ended at its party: its reply, or the stream's failure."""


class ExecuteStream:
    """The driver side of one party's ExecuteStream: `submit` sends a request, and a thread of
    its own hands each reply to the callback submitted with its request. When the call fails,
    every execution waiting on it is told so, and the stream takes no more requests."""

    def __init__(self, open_call: Callable[[Iterator[bytes]], Iterator[bytes]], name: str) -> None:
        self._requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._waiting: dict[str, Callable[[Outcome], None]] = {}
        self._lock = threading.Lock()
        self._open = True
        self.failure: StreamFailure | None = None
        """How the call ended, once it has."""
        self._call = open_call(iter(self._requests.get, None))
        threading.Thread(target=self._read, name=name, daemon=True).start()

    @property
    def open(self) -> bool:
        return self._open

    def submit(self, request: pb.ExecuteRequest, on_outcome: Callable[[Outcome], None]) -> bool:
        """Send `request`; `on_outcome` gets its reply or the stream's failure, on the
        stream's thread. False, and nothing sent, if the stream has ended."""
        with self._lock:
            if not self._open:
                return False
            self._waiting[request.exec_id] = on_outcome
        self._requests.put(request.SerializeToString())
        return True

    def forget(self, exec_id: str) -> None:
        """Stop waiting for `exec_id` (its execution was given up on)."""
        with self._lock:
            self._waiting.pop(exec_id, None)

    def close(self) -> None:
        """End the requests; the party finishes the executions running and ends the call."""
        with self._lock:
            self._open = False
        self._requests.put(None)

    def _read(self) -> None:
        try:
            for data in self._call:
                reply = pb.ExecuteReply.FromString(data)
                with self._lock:
                    on_outcome = self._waiting.pop(reply.exec_id, None)
                if on_outcome is not None:
                    on_outcome(reply)
            failure = StreamFailure(
                grpc.StatusCode.UNAVAILABLE, "the party ended the execution stream"
            )
        except grpc.RpcError as exc:
            failure = StreamFailure(*status_of(exc))
        except DecodeError as exc:
            self._call.cancel()  # type: ignore[attr-defined]
            failure = StreamFailure(
                grpc.StatusCode.INTERNAL, f"a reply does not decode as ExecuteReply: {exc}"
            )
        with self._lock:
            self._open = False
            self.failure = failure
            waiting, self._waiting = list(self._waiting.values()), {}
        for on_outcome in waiting:
            on_outcome(failure)
