"""gRPC plumbing: servicers registered so every bad request gets a clear status, and typed
errors on the client for the statuses a party answers with.

Servicer methods raise `BadRequest`, `NotFound`, `Forbidden`, `VersionMismatch` or
`Exhausted`; `handle_errors` turns them into INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED,
FAILED_PRECONDITION and RESOURCE_EXHAUSTED with the message. `add_service` decodes requests
itself, so bytes that are not the expected message are INVALID_ARGUMENT too.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection
from types import SimpleNamespace
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from mpplug.errors import (
    InvalidProgramError,
    MPPlugError,
    PartyUnavailableError,
    WireError,
    WireVersionError,
)
from mpplug.runtime.communicator import MailboxFull
from mpplug.runtime.party import UnknownProgramError

WIRE_VERSION = 2
"""The version of the messages drivers and parties exchange, checked both ways when a session
opens; bump it whenever a message changes meaning, so that sides of different releases refuse
each other rather than misread each other."""

MISSING_KEY = "mpplug-missing"
"""Trailing metadata naming what a NOT_FOUND was about: "session", "program", "value" or
"dataset"."""

STREAM_REFUSED_KEY = "mpplug-stream-refused"
"""Trailing metadata of a RESOURCE_EXHAUSTED that refused an ExecuteStream before it read any
request (every execution stream of the party is taken)."""

_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SCOPED_ID = re.compile(r"[A-Za-z0-9_-]{1,64}:[A-Za-z0-9_-]{1,64}")
MAX_NAME_CHARS = 256


class BadRequest(MPPlugError, ValueError):
    """A request that is malformed or does not fit the program: INVALID_ARGUMENT."""


class NotFound(MPPlugError, LookupError):
    """A session, program or value this party does not hold: NOT_FOUND."""

    def __init__(self, missing: str, message: str) -> None:
        super().__init__(message)
        self.missing = missing


class Forbidden(MPPlugError, PermissionError):
    """A caller whose certificate does not allow the request: PERMISSION_DENIED."""


class VersionMismatch(MPPlugError):
    """A caller of another wire version: FAILED_PRECONDITION."""


class Exhausted(MPPlugError):
    """A request over one of the party's limits (sessions, busy slots): RESOURCE_EXHAUSTED."""


def describe_version(version: int) -> str:
    """How an error names the wire version the other side sent."""
    if version == 0:
        return "no wire version (a release from before wire versions)"
    return f"wire version {version}"


def check_id(value: str, field: str) -> str:
    """A session or execution id: 1-64 letters, digits, '_' or '-'."""
    if not _ID.fullmatch(value):
        raise BadRequest(f"{field}: expected 1-64 letters, digits, '_' or '-', got {value!r}")
    return value


def scoped_id(session: str, exec_id: str) -> str:
    """The id an execution's values and aborts go by on the parties: "<session>:<exec_id>",
    so that one session can neither abort nor feed another's executions."""
    return f"{session}:{exec_id}"


def check_scoped_id(value: str, field: str) -> str:
    """An id as `scoped_id` makes it."""
    if not _SCOPED_ID.fullmatch(value):
        raise BadRequest(f"{field}: expected '<session>:<execution id>', got {value!r}")
    return value


def check_name(value: str, field: str) -> str:
    """A value name: non-empty, at most MAX_NAME_CHARS characters."""
    if not 0 < len(value) <= MAX_NAME_CHARS:
        raise BadRequest(f"{field}: expected 1-{MAX_NAME_CHARS} characters, got {value!r}")
    return value


F = TypeVar("F", bound=Callable[..., Any])


REFUSALS = (
    NotFound,
    UnknownProgramError,
    Forbidden,
    VersionMismatch,
    Exhausted,
    MailboxFull,
    BadRequest,
    WireError,
    InvalidProgramError,
)
"""The typed errors a servicer method refuses a request with (see `refusal_of`)."""


def refusal_of(exc: Exception) -> tuple[grpc.StatusCode, str, str]:
    """The status code, message (cut to MAX_DETAILS_CHARS) and missing thing ("" unless
    NOT_FOUND) that one of REFUSALS is answered with."""
    missing = ""
    if isinstance(exc, NotFound):
        code, missing = grpc.StatusCode.NOT_FOUND, exc.missing
    elif isinstance(exc, UnknownProgramError):
        code, missing = grpc.StatusCode.NOT_FOUND, "program"
    elif isinstance(exc, Forbidden):
        code = grpc.StatusCode.PERMISSION_DENIED
    elif isinstance(exc, VersionMismatch):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, (Exhausted, MailboxFull)):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    else:
        code = grpc.StatusCode.INVALID_ARGUMENT
    return code, _cut(str(exc)), missing


def handle_errors(method: F) -> F:
    """Map the typed errors a servicer method raises to gRPC status codes."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except REFUSALS as exc:
            code, message, missing = refusal_of(exc)
            if missing:
                context.set_trailing_metadata(((MISSING_KEY, missing),))
            context.abort(code, message)

    return wrapper  # type: ignore[return-value]


MAX_DETAILS_CHARS = 1024
"""Error messages quote what the caller sent; cut there, a status stays within the caller's
16 KiB metadata limit (it would otherwise see RESOURCE_EXHAUSTED instead of the answer)."""


def _cut(message: str) -> str:
    if len(message) > MAX_DETAILS_CHARS:
        return f"{message[:MAX_DETAILS_CHARS]}... ({len(message)} characters)"
    return message


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, exc: Exception) -> NoReturn:
    context.abort(code, _cut(str(exc)))
    raise AssertionError("unreachable: context.abort raises")


_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


Admit = Callable[[grpc.ServicerContext, str], None]
"""Checks that the caller may call the named method; raises Forbidden if not."""


def add_service(
    server: grpc.Server,
    servicer: Any,
    service: ServiceDescriptor,
    raw: Collection[str] = (),
    admit: Admit | None = None,
) -> None:
    """Serve `service` with `servicer`'s methods, decoding each request message ourselves;
    methods named in `raw` get the serialized bytes (see streaming.read_chunks), as must
    every method whose requests stream. `admit`, if given, vets each caller before anything
    of its request is read."""
    handlers = {}
    for method in service.methods:
        behaviour = getattr(servicer, method.name)
        if admit is not None:
            behaviour = _admitting(behaviour, admit, method.name)
        if method.name not in raw:
            if method.client_streaming:
                raise TypeError(
                    f"{method.full_name}: expected a streaming request to be read raw "
                    f"(named in `raw`), got raw={sorted(raw)}"
                )
            request_type = message_factory.GetMessageClass(method.input_type)
            behaviour = _decoding(behaviour, request_type, method.full_name)
        make = _HANDLERS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(behaviour, response_serializer=_serialize)
    server.add_registered_method_handlers(service.full_name, handlers)


def _admitting(behaviour: Callable[..., Any], admit: Admit, method: str) -> Callable[..., Any]:
    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            admit(context, method)
        except Forbidden as exc:
            _abort(context, grpc.StatusCode.PERMISSION_DENIED, exc)
        except VersionMismatch as exc:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, exc)
        return behaviour(request, context)

    return handler


def _serialize(reply: Message | bytes) -> bytes:
    """Replies are messages, or bytes a handler serialized itself (see encode_chunks)."""
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def raw_stub(channel: grpc.Channel, service: ServiceDescriptor) -> SimpleNamespace:
    """A callable for each method of `service` that sends and returns serialized messages
    (bytes, or iterators of bytes for streams), for the chunked transfers."""
    calls = {}
    for method in service.methods:
        streams = (method.client_streaming, method.server_streaming)
        kind = "_".join("stream" if s else "unary" for s in streams)
        calls[method.name] = getattr(channel, kind)(f"/{service.full_name}/{method.name}")
    return SimpleNamespace(**calls)


def _decode(request_type: type[Message], data: bytes, where: str) -> Any:
    try:
        return request_type.FromString(data)
    except DecodeError as exc:
        raise WireError(
            f"{where}: the request does not decode as {request_type.DESCRIPTOR.full_name}: {exc}"
        ) from None


def _decoding(
    behaviour: Callable[..., Any], request_type: type[Message], where: str
) -> Callable[..., Any]:
    def handler(data: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = _decode(request_type, data, where)
        except WireError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        return behaviour(request, context)

    return handler


def missing_of(exc: grpc.RpcError) -> str | None:
    """What a NOT_FOUND reply said was missing, if anything."""
    if not isinstance(exc, grpc.Call) or exc.code() is not grpc.StatusCode.NOT_FOUND:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == MISSING_KEY:
            return str(value)
    return None


def status_of(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a failed call."""
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.UNKNOWN, str(exc)


def rpc_failure(exc: grpc.RpcError, party: str, method: str) -> MPPlugError:
    """The typed error for a failed call to `party` (see `failure_of`)."""
    code, details = status_of(exc)
    return failure_of(code, details, missing_of(exc), party, method)


def failure_of(
    code: grpc.StatusCode, details: str, missing: str | None, party: str, method: str
) -> MPPlugError:
    """The typed error for `party` answering `method` with status `code`:
    PartyUnavailableError when it cannot be reached, did not answer in time or lost our
    session (it restarted); MPPlugError otherwise."""
    if code is grpc.StatusCode.UNAVAILABLE:
        return PartyUnavailableError(party, f"{method} failed: {details}")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return PartyUnavailableError(party, f"{method} got no answer before its deadline")
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return WireVersionError(details)
    if missing == "session":
        return PartyUnavailableError(party, f"{method}: {details} (did the party restart?)")
    return MPPlugError(f"party {party} refused {method}: {code.name}: {details}")
