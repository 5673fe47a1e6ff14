"""Executions over one long-lived ExecuteStream call: the party side that serves it and the
driver side that feeds it. A message each way per execution costs less than a call each.

Replies name their request's exec_id and come back in the order executions end, so one slow
execution holds up no other. A request the party refuses gets a `Refused` reply (what Execute
would answer with a status); the stream itself ends when its call does, and then every
execution still running on it is aborted, or when the party drains it as it stops: new
requests are refused as UNAVAILABLE, and the call ends once every one has its reply.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from mpplug.protos import service_pb2 as pb
from mpplug.remote.outcomes import COMPLETED
from mpplug.remote.rpc import (
    MAX_DETAILS_CHARS,
    REFUSALS,
    STREAM_REFUSED_KEY,
    refusal_of,
    status_of,
)

log = logging.getLogger(__name__)

MAX_UNANSWERED = 64
"""Requests of one stream a party holds unanswered (running, or replies the driver has not
read) before it stops reading more: HTTP/2 flow control then holds the writer back."""

OnCallEnd = Callable[[Callable[[], None]], Callable[[], None]]
"""Given an abort callback, arranges for it to run if the call carrying an execution ends
before the execution does; returns what undoes that once the execution is over."""


class Executions(Protocol):
    """What runs the requests of a stream (PartyServicer)."""

    def admit_execution(self, request: pb.ExecuteRequest) -> Any: ...

    def execute(self, request: pb.ExecuteRequest, session: Any, on_end: OnCallEnd) -> Any: ...

    def end_execution(self) -> None: ...


class ExecutionStream:
    """The party side of one ExecuteStream: a thread of its own reads the requests, each is
    admitted (an execution slot taken, or refused at once as Execute would be) and runs on
    `runs`, and the replies are yielded as executions end."""

    def __init__(
        self, executions: Executions, runs: ThreadPoolExecutor, context: grpc.ServicerContext
    ) -> None:
        self._executions = executions
        self._runs = runs
        self._context = context
        self._replies: queue.SimpleQueue[pb.ExecuteReply | _End | _Drain] = queue.SimpleQueue()
        self._unanswered = threading.Semaphore(MAX_UNANSWERED)
        self._aborts: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._started = self._answered = 0
        self._draining = self._closing = False
        context.add_callback(self._call_ended)

    def drain(self) -> None:
        """Refuse requests from now on (UNAVAILABLE: the party is stopping), and end the call
        once every request read has its reply."""
        with self._lock:
            self._draining = True
        self._replies.put(_DRAIN)

    def replies(self, requests: Iterator[bytes]) -> Iterator[bytes]:
        """The serialized replies, until the requests end and every execution has replied."""
        threading.Thread(
            target=self._read, args=(requests,), name="mpplug-execute-stream", daemon=True
        ).start()
        outstanding, reading = 0, True
        while (reading or outstanding) and not self._drained():
            item = self._replies.get()
            if isinstance(item, _Drain):
                continue
            if isinstance(item, _End):
                reading, outstanding = False, outstanding + item.requests
                if item.error:
                    self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, item.error)
                continue
            outstanding -= 1
            self._unanswered.release()
            with self._lock:
                self._answered += 1
            yield item.SerializeToString()

    def _drained(self) -> bool:
        """Whether the stream is draining and every request read has its reply; from then on
        the reader starts no request (the driver sees the call end without its reply)."""
        with self._lock:
            self._closing = self._draining and self._started == self._answered
            return self._closing

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
                if not self._hold_back():
                    break
                count += 1
                self._start(request)
        except grpc.RpcError:
            pass  # the call ended (the driver cancelled or went away)
        finally:
            self._replies.put(_End(count, error[:MAX_DETAILS_CHARS]))

    def _hold_back(self) -> bool:
        """Wait until fewer than MAX_UNANSWERED requests are unanswered; False if the call
        ends first."""
        while not self._unanswered.acquire(timeout=1.0):
            if self._ended.is_set():
                return False
        return True

    def _start(self, request: pb.ExecuteRequest) -> None:
        with self._lock:
            if self._closing:
                return
            self._started += 1
            draining = self._draining
        if draining:
            self._replies.put(_reply(request, "UNAVAILABLE", "the party is stopping"))
            return
        try:
            session = self._executions.admit_execution(request)
        except REFUSALS as exc:
            self._replies.put(_refused(request, exc))
            return
        try:
            self._runs.submit(self._run, request, session)
        except RuntimeError:  # the server is stopping
            self._executions.end_execution()
            self._replies.put(_reply(request, "UNAVAILABLE", "the party is stopping"))

    def _run(self, request: pb.ExecuteRequest, session: Any) -> None:
        try:
            reply = self._executions.execute(request, session, self._on_end)
        except REFUSALS as exc:
            reply = _refused(request, exc)
        except Exception as exc:  # never leave the driver waiting: answer as gRPC would
            log.exception("execution %s failed unexpectedly", request.exec_id)
            reply = _reply(request, "UNKNOWN", f"{type(exc).__name__}: {exc}")
        finally:
            self._executions.end_execution()
        if reply is COMPLETED:
            reply = pb.ExecuteReply(completed=pb.Completed())
        reply.exec_id = request.exec_id
        self._replies.put(reply)

    def _on_end(self, abort: Callable[[], None]) -> Callable[[], None]:
        key = id(abort)
        with self._lock:
            if not self._ended.is_set():
                self._aborts[key] = abort
                return lambda: self._forget(key)
        abort()
        return lambda: None

    def _forget(self, key: int) -> None:
        with self._lock:
            self._aborts.pop(key, None)

    def _call_ended(self) -> None:
        with self._lock:
            self._ended.set()
            aborts, self._aborts = list(self._aborts.values()), {}
        for abort in aborts:
            abort()


class _Drain:
    """Wakes the reply loop to look whether a draining stream is done."""


_DRAIN = _Drain()


@dataclass(frozen=True)
class _End:
    """The requests ended after `requests` of them; `error`: why, if the driver's were bad."""

    requests: int
    error: str


def _refused(request: pb.ExecuteRequest, exc: Exception) -> pb.ExecuteReply:
    code, message, missing = refusal_of(exc)
    return _reply(request, code.name, message, missing)


def _reply(request: pb.ExecuteRequest, code: str, message: str, missing: str = "") -> Any:
    refused = pb.Refused(code=code, message=message[:MAX_DETAILS_CHARS], missing=missing)
    return pb.ExecuteReply(exec_id=request.exec_id, refused=refused)


@dataclass(frozen=True)
class StreamFailure:
    """How a stream ended for the executions still waiting on it: a gRPC status, and whether
    the party refused the stream itself (all its execution streams are taken) before reading
    any request, so that those may go as Execute calls instead."""

    code: grpc.StatusCode
    details: str
    refused: bool = False


Outcome = pb.ExecuteReply | StreamFailure
"""How an execution sent on a stream ended at its party: its reply, or the stream's failure."""


class ExecuteStream:
    """The driver side of one party's ExecuteStream: `submit` sends a request, and a thread of
    its own hands each reply to the callback submitted with its request. When the call fails,
    every execution waiting on it is told so, and the stream takes no more requests."""

    def __init__(self, open_call: Callable[[Iterator[bytes]], Any], name: str) -> None:
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
        failure = StreamFailure(grpc.StatusCode.UNAVAILABLE, "the party ended the stream")
        answered = False
        try:
            for data in self._call:
                answered = True
                reply = pb.ExecuteReply.FromString(data)
                with self._lock:
                    on_outcome = self._waiting.pop(reply.exec_id, None)
                if on_outcome is not None:
                    _tell(on_outcome, reply)
        except grpc.RpcError as exc:
            code, details = status_of(exc)
            refused = not answered and _marked_refused(exc)
            failure = StreamFailure(code, details, refused)
        except DecodeError as exc:
            self._call.cancel()
            failure = StreamFailure(
                grpc.StatusCode.INTERNAL, f"a reply does not decode as ExecuteReply: {exc}"
            )
        finally:
            with self._lock:
                self._open = False
                self.failure = failure
                waiting, self._waiting = list(self._waiting.values()), {}
            self._requests.put(None)  # lets gRPC's thread reading the requests go
            for on_outcome in waiting:
                _tell(on_outcome, failure)


def _tell(on_outcome: Callable[[Outcome], None], outcome: Outcome) -> None:
    """Hand an outcome to its callback; one that raises must not stop the stream's thread."""
    try:
        on_outcome(outcome)
    except Exception:
        log.exception("handling the outcome of an execution failed")


def _marked_refused(exc: grpc.RpcError) -> bool:
    metadata = exc.trailing_metadata() if isinstance(exc, grpc.Call) else None
    return any(key == STREAM_REFUSED_KEY for key, _ in metadata or ())
