"""How one party's share of an execution ended, as an `ExecuteReply` and back.

Each failure crosses the wire as its fields, so the driver raises the same typed error the
party raised (PartyError, CommTimeoutError, ExecutionAborted, PartyUnavailableError).
"""

from __future__ import annotations

from mpplug.errors import (
    CommTimeoutError,
    ExecutionAborted,
    MPPlugError,
    PartyError,
    PartyUnavailableError,
)
from mpplug.protos import service_pb2 as pb

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
