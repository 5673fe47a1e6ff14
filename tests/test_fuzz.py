"""Hostile callers at CI size (the fuzzer is bench/fuzz.py): party servers, plain and with mutual
TLS, answer every fuzzed request typed, never hang, crash or log a traceback, and still serve.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import DecodeError

from bench.fuzz import (
    CRASH,
    CUT,
    HANG,
    HEALTH_INTERNAL,
    OK,
    OUTSIDER,
    TYPED,
    UNTYPED,
    Call,
    Report,
    chunk,
    classify,
    print_defects,
    run,
)
from mpplug.protos import service_pb2 as pb

REQUESTS = 1000
SEED = {False: 11, True: 12}
REACHED = (
    "PartyService/OpenSession",
    "PartyService/PutSmall",
    "PartyService/LoadProgram",
    "PartyService/Execute",
    "PartyService/ExecuteStream",
    "PartyService/Status",
    "PeerService/SendSmall",
    "Health/Check",
)
"""Methods that must have answered some fuzzed requests with a reply, so the fuzzer is known
to get past sessions, programs and (with TLS) certificates rather than being turned away."""


def _defects(report: Report, capsys: pytest.CaptureFixture[str]) -> str:
    print_defects(report)
    return capsys.readouterr().out


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_party_servers_answer_hostile_callers_with_typed_errors(tmp_path, capsys, tls):
    report = run(tmp_path, tls=tls, requests=REQUESTS, seed=SEED[tls])
    tally = report.tally
    defects = _defects(report, capsys)
    assert tally.total() >= REQUESTS
    assert not tally.crashed and tally.total(CRASH) == 0, defects
    assert tally.total(HANG) == 0, defects
    assert tally.total(UNTYPED) == 0, defects
    assert report.tracebacks == {}, defects
    assert report.serve_error is None
    for method in REACHED:
        assert tally.kinds[method, OK] > 0, f"{method}: no reply among {tally.codes}"
    assert tally.codes["PartyService/Execute", "OK completed"] > 0
    refused = ("PartyService/Put", "PartyService/PutSmall", "PeerService/SendSmall")
    assert all(tally.codes[m, "INVALID_ARGUMENT"] > 0 for m in refused), tally.codes


CALL = Call(0, "PartyService/KeepAlive", (b"",), "valid")


@pytest.mark.parametrize(
    ("call", "code", "details", "kind"),
    [
        (CALL, grpc.StatusCode.NOT_FOUND, "no open session 'x' on this party", TYPED),
        (CALL, grpc.StatusCode.INVALID_ARGUMENT, "session: expected 1-64 letters", TYPED),
        (CALL, grpc.StatusCode.UNKNOWN, "Exception calling application: KeyError", UNTYPED),
        (CALL, grpc.StatusCode.INTERNAL, "boom", UNTYPED),
        (
            CALL,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "Stream removed (received metadata size exceeds hard limit (value length 70032 vs. "
            "16384))",
            UNTYPED,
        ),
        (CALL, grpc.StatusCode.RESOURCE_EXHAUSTED, "this party has 1024 sessions open", TYPED),
        (CALL, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", HANG),
        (CALL, grpc.StatusCode.UNAVAILABLE, "failed to connect", UNTYPED),
        (
            Call(0, "PartyService/Put", (b"",), "stall", stall=True),
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "Deadline Exceeded",
            CUT,
        ),
        (
            Call(0, "Health/Check", (b"\xff",), "random bytes"),
            grpc.StatusCode.INTERNAL,
            "Exception deserializing request!",
            HEALTH_INTERNAL,
        ),
        (
            Call(0, "PartyService/Status", (b"",), "valid", identity=OUTSIDER),
            grpc.StatusCode.UNAVAILABLE,
            "Ssl handshake failed",
            TYPED,
        ),
    ],
)
def test_answers_are_classified_typed_untyped_cut_or_hung(call, code, details, kind):
    assert classify(call, code, details) == kind


def test_chunk_messages_are_what_the_party_parses():
    header = pb.PutHeader(session="s", name="v")
    parsed = pb.PutChunk.FromString(chunk(header.SerializeToString(), b"abc"))
    assert (parsed.header, parsed.data) == (header, b"abc")
    assert not pb.PutChunk.FromString(chunk(None, b"x")).HasField("header")
    with pytest.raises(DecodeError):
        pb.PutChunk.FromString(chunk(b"\xff", b""))
