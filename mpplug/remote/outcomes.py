"""How one party's share of an execution ended, as an `ExecuteReply` and back: the outcome,
the spans it recorded when profiled, and its small outputs sent back inline.

Each failure crosses the wire as its fields, so the driver raises the same typed error the
party raised (PartyError, CommTimeoutError, ExecutionAborted, PartyUnavailableError).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from mpplug.errors import (
    CommTimeoutError,
    ExecutionAborted,
    MPPlugError,
    PartyError,
    PartyUnavailableError,
    WireError,
)
from mpplug.protos import service_pb2 as pb
from mpplug.runtime import codec
from mpplug.runtime.profile import CATEGORIES, Span

EXECUTION_ERRORS = (PartyError, CommTimeoutError, ExecutionAborted, PartyUnavailableError)
COMPLETED = pb.ExecuteReply(completed=pb.Completed())


def failure_reply(exc: MPPlugError) -> pb.ExecuteReply:
    """The reply for one of EXECUTION_ERRORS."""
    if isinstance(exc, PartyError):
        return pb.ExecuteReply(
            party_error=pb.PartyFailure(
                party=exc.party, op=exc.op, error_type=exc.error_type, message=exc.message
            )
        )
    if isinstance(exc, CommTimeoutError):
        return pb.ExecuteReply(
            comm_timeout=pb.CommTimeout(
                party=exc.party, peer=exc.peer, key=exc.key, timeout=exc.timeout
            )
        )
    if isinstance(exc, PartyUnavailableError):
        return pb.ExecuteReply(unavailable=pb.Unavailable(party=exc.party, detail=exc.detail))
    if isinstance(exc, ExecutionAborted):
        return pb.ExecuteReply(aborted=pb.Aborted(message=str(exc)))
    raise TypeError(f"expected one of {[t.__name__ for t in EXECUTION_ERRORS]}, got {exc!r}")


def reply_error(reply: pb.ExecuteReply, party: str) -> MPPlugError | None:
    """The error a reply from `party` carries, or None if its share completed."""
    outcome = reply.WhichOneof("outcome")
    if outcome == "completed":
        return None
    if outcome == "party_error":
        f = reply.party_error
        return PartyError(f.party, f.op, f.error_type, f.message)
    if outcome == "comm_timeout":
        t = reply.comm_timeout
        return CommTimeoutError(t.party, t.peer, t.key, t.timeout)
    if outcome == "unavailable":
        return PartyUnavailableError(reply.unavailable.party, reply.unavailable.detail)
    if outcome == "aborted":
        return ExecutionAborted(reply.aborted.message)
    return MPPlugError(f"party {party} sent an Execute reply with no outcome")


def add_spans(reply: pb.ExecuteReply, spans: Sequence[Span]) -> None:
    for span in spans:
        reply.spans.add(
            name=span.name,
            category=span.category,
            start_ns=span.start_ns,
            duration_ns=span.duration_ns,
            args_json=json.dumps(span.args),
        )


def reply_spans(reply: pb.ExecuteReply, rank: int, party: str) -> list[Span]:
    """The spans a reply from party `rank` carries, checked; WireError if one is malformed."""
    spans = []
    for i, msg in enumerate(reply.spans):
        where = f"span {i} from party {party}"
        if msg.category not in CATEGORIES or msg.duration_ns < 0:
            raise WireError(
                f"{where}: expected a category in {sorted(CATEGORIES)} and a duration >= 0, "
                f"got {msg.category!r} and {msg.duration_ns}"
            )
        try:
            args = json.loads(msg.args_json)
        except ValueError as exc:
            raise WireError(f"{where}: args are not JSON: {exc}") from None
        if not isinstance(args, dict):
            raise WireError(f"{where}: expected args as a JSON object, got {msg.args_json!r}")
        spans.append(Span(rank, msg.name, msg.category, msg.start_ns, msg.duration_ns, args))
    return spans


MAX_INLINE_BYTES = 64 * 1024
"""The most bytes of outputs one Execute reply carries back, whatever the driver asks."""


def add_inline(reply: pb.ExecuteReply, outputs: Sequence[tuple[str, Any]], max_bytes: int) -> None:
    """Put into `reply` each (name, value) of at most `max_bytes`, while the reply's total
    stays within MAX_INLINE_BYTES."""
    budget = MAX_INLINE_BYTES
    for name, value in outputs:
        if codec.is_table(value):
            continue  # a table is fetched when asked for, never encoded on speculation
        array = codec.as_host_array(value)
        if array.nbytes <= min(max_bytes, budget):
            budget -= array.nbytes
            reply.values.add(name=name, type=codec.encode_type(array), data=array.tobytes())


def inline_values(reply: pb.ExecuteReply, party: str) -> dict[str, Any]:
    """The outputs a reply from `party` carries back, by name, each validated."""
    found = {}
    for msg in reply.values:
        where = f"output {msg.name!r} sent back by party {party}"
        found[msg.name] = codec.decode(msg.type, msg.data, where)
    return found
