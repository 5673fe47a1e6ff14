"""The hand-written chunk codec agrees with protobuf, and rejects what protobuf would."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from mpplug.core import DType, TensorType
from mpplug.core.memory import MAPPED_BYTES, fresh_bytes, numpy_huge_pages
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


def _mapping_of(array: np.ndarray) -> tuple[str, list[str]]:
    """The /proc/self/smaps head line and VmFlags of the mapping holding `array`'s second
    page (NumPy advises whole pages only, and its first page is shared with malloc's header)."""
    address, head = array.ctypes.data + mmap.PAGESIZE, None
    with open("/proc/self/smaps") as smaps:
        lines = smaps.readlines()
    for line in lines:
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line: low-high perms ...
            low, high = (int(end, 16) for end in fields[0].split("-"))
            head = line if low <= address < high else None
        elif head is not None and fields[0] == "VmFlags:":
            return head, fields[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
def test_a_big_received_value_lands_in_a_private_mapping_of_its_own():
    """Not NumPy's memory, which it advises the kernel to back with huge pages (slow to fault
    in on a VM that gives memory back to its host), nor a shared mapping (Python's default,
    backed by shared memory): a private anonymous one, page-aligned, never advised."""
    size = MAPPED_BYTES + 5
    payload = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    got = receive_bytes(size, [payload[:CHUNK_BYTES], payload[CHUNK_BYTES:]], "test")
    assert got.tobytes() == payload and got.flags.writeable
    assert got.ctypes.data % mmap.PAGESIZE == 0  # malloc's blocks start past a header
    head, flags = _mapping_of(got)
    assert head.split()[1] == "rw-p" and head.split()[4] == "0", head  # private, anonymous
    assert "hg" not in flags, flags  # no MADV_HUGEPAGE
    small = receive_bytes(5, [payload[:5]], "test")
    assert small.tobytes() == payload[:5] and small.base is None  # NumPy's own, not a mapping


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
def test_numpys_own_big_arrays_are_what_the_check_above_tells_apart():
    """The check above can fail: an array NumPy allocates and advises is flagged so (its
    address starts past malloc's header, page-aligned only by chance)."""
    before = numpy_huge_pages(True)
    try:
        array = np.ones(2 * MAPPED_BYTES, np.uint8)
        assert "hg" in _mapping_of(array)[1]
    finally:
        numpy_huge_pages(before)


def _overcommits_always() -> bool:
    try:
        with open("/proc/sys/vm/overcommit_memory") as mode:
            return mode.read().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(_overcommits_always(), reason="the kernel maps any size")
def test_a_buffer_the_system_cannot_hold_is_a_memory_error_as_numpys_is():
    """The bulk listener answers MemoryError with RESOURCE_EXHAUSTED and keeps serving."""
    with pytest.raises(MemoryError, match=f"no memory to map {1 << 44} bytes"):
        fresh_bytes(1 << 44)
