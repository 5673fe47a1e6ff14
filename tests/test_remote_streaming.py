"""The hand-written chunk codec agrees with protobuf, and rejects what protobuf would."""

from __future__ import annotations

import numpy as np
import pytest

from mpplug.core import DType, TensorType
from mpplug.core.serde import tensor_type_to_proto
from mpplug.errors import WireError
from mpplug.protos import service_pb2 as pb
from mpplug.remote.streaming import (
    CHUNK_BYTES,
    DATA_FIELD,
    HEADER_FIELD,
    encode_chunks,
    read_chunks,
    receive_bytes,
    receive_tensor,
)

CHUNK_TYPES = [pb.PutChunk, pb.ProgramChunk, pb.FetchChunk, pb.PeerChunk]


@pytest.mark.parametrize("chunk_type", CHUNK_TYPES, ids=lambda t: t.__name__)
def test_every_chunk_message_has_the_header_and_data_fields_the_codec_writes(chunk_type):
    fields = chunk_type.DESCRIPTOR.fields_by_number
    assert fields[HEADER_FIELD].message_type is not None
    assert (
        fields[DATA_FIELD].name == "data"
        and fields[DATA_FIELD].type == fields[DATA_FIELD].TYPE_BYTES
    )
    assert sorted(fields) == [HEADER_FIELD, DATA_FIELD]


@pytest.mark.parametrize("nbytes", [0, 5, CHUNK_BYTES, 2 * CHUNK_BYTES + 3])
def test_encoded_chunks_parse_as_protobuf_and_back(nbytes):
    payload = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    header = pb.PeerHeader(
        exec_id="e1",
        op=3,
        src=1,
        dst=0,
        type=tensor_type_to_proto(TensorType(DType.UINT8, (nbytes,))),
    )
    encoded = list(encode_chunks(header, payload))
    assert len(encoded) == max(1, -(-nbytes // CHUNK_BYTES))
    parsed = [pb.PeerChunk.FromString(raw) for raw in encoded]
    assert parsed[0].header == header and not any(p.HasField("header") for p in parsed[1:])
    assert b"".join(p.data for p in parsed) == payload.tobytes()
    assert all(len(p.data) <= CHUNK_BYTES for p in parsed)

    again, parts = read_chunks(iter(p.SerializeToString() for p in parsed), pb.PeerChunk, "test")
    assert again == header
    np.testing.assert_array_equal(
        receive_tensor(TensorType(DType.UINT8, (nbytes,)), parts, "test"), payload
    )


def test_unknown_fields_are_skipped_like_protobuf_does():
    raw = pb.FetchChunk(
        type=tensor_type_to_proto(TensorType(DType.INT32, (2,))), data=b"\1\0\0\0\2\0\0\0"
    ).SerializeToString()
    # then field 3 as a varint, field 4 as fixed32, field 4 again as bytes
    extended = raw + b"\x18\x07" + b"\x25\0\0\0\0" + b"\x22\x02hi"
    assert pb.FetchChunk.FromString(extended).data == b"\1\0\0\0\2\0\0\0"
    header, parts = read_chunks(iter([extended]), pb.FetchChunk, "test")
    assert header.dtype == DType.INT32.proto
    assert list(receive_tensor(TensorType(DType.INT32, (2,)), parts, "test")) == [1, 2]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x0a\x05ab", "truncated message"),
        (b"\x0a", "truncated or overlong varint"),
        (b"\x08\x01", "field 1 has wire type 0"),
        (b"\x1f", "field 3 has unknown wire type 7"),
        (b"\x02\x00", "field 0"),
        (b"\x0a\x03\xff\xff\xff", "the header does not decode"),
    ],
)
def test_malformed_chunks_are_wire_errors(raw, message):
    with pytest.raises(WireError, match=message):
        read_chunks(iter([raw]), pb.PeerChunk, "test")


def test_a_stream_must_start_with_the_header_and_hold_exactly_the_declared_bytes():
    with pytest.raises(WireError, match="the stream is empty"):
        read_chunks(iter([]), pb.PutChunk, "test")
    with pytest.raises(WireError, match="first message has no header"):
        read_chunks(iter([pb.PutChunk(data=b"x").SerializeToString()]), pb.PutChunk, "test")
    with pytest.raises(WireError, match="received more than the 3 bytes declared"):
        receive_bytes(3, [b"ab", b"cd"], "test")
    with pytest.raises(WireError, match="ended after 2 of 3 declared bytes"):
        receive_bytes(3, [b"ab"], "test")
