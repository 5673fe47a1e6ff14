"""Hostile callers at CI size (the fuzzer is bench/fuzz.py): party servers, plain and with mutual
TLS, answer every fuzzed request typed, never hang, crash or log a traceback, and still serve.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import DecodeError

from bench.fuzz import (
    BULK,
    CLOSED,
    CRASH,
    CUT,
    DRIVER,
    HANG,
    HEALTH_INTERNAL,
    OK,
    OUTSIDER,
    PEER,
    SILENT,
    TLS_REFUSED,
    TYPED,
    UNTYPED,
    BulkAnswer,
    BulkCall,
    Call,
    Report,
    bulk_frame,
    chunk,
    classify,
    classify_bulk,
    print_defects,
    run,
)
from mpplug.protos import service_pb2 as pb
from mpplug.remote.bulk import MAGIC

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
    BULK,
)
"""Methods that must have answered some fuzzed requests with a reply, so the fuzzer is known
to get past sessions, programs and (with TLS) certificates rather than being turned away."""


def _defects(report: Report, capsys: pytest.CaptureFixture[str]) -> str:
    print_defects(report)
    return capsys.readouterr().out


@pytest.mark.slow
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
    refused = ("PartyService/Put", "PartyService/PutSmall", "PeerService/SendSmall", BULK)
    assert all(tally.codes[m, "INVALID_ARGUMENT"] > 0 for m in refused), tally.codes
    if tls:  # the bulk port refuses the driver's certificate, and a peer's for another party
        assert tally.codes[BULK, "PERMISSION_DENIED"] > 0, tally.codes


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


VALUE = BulkCall(0, BULK, (b"frame", b"payload"), "valid", PEER)
CUT_SHORT = BulkCall(0, BULK, (b"frame", b"pay"), "cut short", PEER, hang_up=True)
STALLED = BulkCall(0, BULK, (b"frame", b"pay"), "stall", PEER, stall=True)
REFUSED_CALLER = BulkCall(0, BULK, (b"frame", b"payload"), "driver", DRIVER, must_refuse=True)
FOREIGN = BulkCall(0, BULK, (b"frame", b"payload"), "outsider", OUTSIDER, must_refuse=True)


@pytest.mark.parametrize(
    ("call", "answer", "kind"),
    [
        (VALUE, BulkAnswer("OK", "", last=True), OK),
        (VALUE, BulkAnswer("INVALID_ARGUMENT", "expected b'MPB1', got b'HTTP'", False), TYPED),
        (VALUE, BulkAnswer("RESOURCE_EXHAUSTED", "", last=False), UNTYPED),
        (VALUE, BulkAnswer("UNKNOWN", "KeyError: 'x'", last=False), UNTYPED),
        (VALUE, BulkAnswer("unknown status", "status 99: boom", last=False), UNTYPED),
        (VALUE, BulkAnswer(CLOSED, "closed after 0 of 5 reply bytes", last=True), UNTYPED),
        (VALUE, BulkAnswer(SILENT, "none within 30.0 s", last=True), HANG),
        (CUT_SHORT, BulkAnswer(CLOSED, "closed after 0 of 5 reply bytes", last=True), TYPED),
        (CUT_SHORT, BulkAnswer(CLOSED, "closed after 0 of 5 reply bytes", last=False), UNTYPED),
        (CUT_SHORT, BulkAnswer(SILENT, "none within 30.0 s", last=True), HANG),
        (STALLED, BulkAnswer(SILENT, "none within 0.5 s", last=True), CUT),
        (STALLED, BulkAnswer(SILENT, "none within 30.0 s", last=False), HANG),
        (REFUSED_CALLER, BulkAnswer("PERMISSION_DENIED", "not a party", last=False), TYPED),
        (REFUSED_CALLER, BulkAnswer("OK", "", last=True), UNTYPED),
        (FOREIGN, BulkAnswer(TLS_REFUSED, "[SSL] alert unknown ca", last=False), TYPED),
        (FOREIGN, BulkAnswer(CLOSED, "closed after 0 of 5 reply bytes", last=False), TYPED),
        (VALUE, BulkAnswer(TLS_REFUSED, "[SSL] alert unknown ca", last=False), UNTYPED),
    ],
)
def test_bulk_answers_are_classified_by_what_was_due(call, answer, kind):
    assert classify_bulk(call, answer) == kind


def test_bulk_frames_are_what_the_port_reads():
    header = pb.PeerHeader(exec_id="s:e", src=1).SerializeToString()
    frame = bulk_frame(header)
    assert frame[:4] == MAGIC and int.from_bytes(frame[4:8], "big") == len(header)
    assert pb.PeerHeader.FromString(frame[8:]).exec_id == "s:e"
    assert bulk_frame(header, b"HTTP", 2**32 - 1)[:8] == b"HTTP\xff\xff\xff\xff"


def test_chunk_messages_are_what_the_party_parses():
    header = pb.PutHeader(session="s", name="v")
    parsed = pb.PutChunk.FromString(chunk(header.SerializeToString(), b"abc"))
    assert (parsed.header, parsed.data) == (header, b"abc")
    assert not pb.PutChunk.FromString(chunk(None, b"x")).HasField("header")
    with pytest.raises(DecodeError):
        pb.PutChunk.FromString(chunk(b"\xff", b""))
