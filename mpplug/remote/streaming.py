"""Values and programs on the wire: their raw bytes in chunks, the first with a header.

Chunk messages (PutChunk, ProgramChunk, FetchChunk, PeerChunk) are encoded and decoded here
by hand: each chunk is copied once, from the sender's array into the message and from the
message into the receiver's buffer, which is preallocated at exactly the declared size.
(A protobuf message around a megabyte of bytes costs several copies and allocations.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from google.protobuf import message_factory
from google.protobuf.message import DecodeError, Message

from mpplug.core import TensorType
from mpplug.core.memory import fresh_bytes
from mpplug.errors import WireError
from mpplug.runtime import codec

CHUNK_BYTES = 1 << 20
"""Bytes per data message: far below MAX_MESSAGE_BYTES, large enough to amortize overhead."""

MAX_MESSAGE_BYTES = 4 << 20
"""The gRPC message limit set on every channel and server: four chunks of headroom."""

SLOWEST_BYTES_PER_S = 64 << 20
"""The slowest link a transfer deadline allows for, on top of the cluster timeout."""

HEADER_FIELD = 1
DATA_FIELD = 2
"""The field numbers of every chunk message: its header (first message only) and its data."""

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


def transfer_deadline(timeout: float, nbytes: int) -> float:
    """Seconds a call moving `nbytes` may take: the timeout plus time on a slow link."""
    return timeout + nbytes / SLOWEST_BYTES_PER_S


def fits_one_chunk(nbytes: int) -> bool:
    """Whether a payload goes as a single message (a unary call)."""
    return nbytes <= CHUNK_BYTES


def as_bytes_view(payload: Any) -> memoryview:
    """A flat byte view of an array or bytes-like object, without copying."""
    if isinstance(payload, np.ndarray):
        payload = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    return memoryview(payload).cast("B")


# -- sending --------------------------------------------------------------------------------
def encode_chunks(header: Message, payload: Any) -> Iterator[bytes]:
    """The serialized chunk messages carrying `payload` (at least one), the first also
    carrying `header`."""
    view = as_bytes_view(payload)
    head = header.SerializeToString()
    yield b"".join((_field_key(HEADER_FIELD, len(head)), head, *_data_field(view[:CHUNK_BYTES])))
    for start in range(CHUNK_BYTES, len(view), CHUNK_BYTES):
        yield b"".join(_data_field(view[start : start + CHUNK_BYTES]))


def _data_field(part: memoryview) -> tuple[bytes, memoryview] | tuple[()]:
    return (_field_key(DATA_FIELD, len(part)), part) if len(part) else ()


def _field_key(number: int, length: int) -> bytes:
    """The tag and length that open a length-delimited protobuf field."""
    return varint(number << 3 | _LENGTH_DELIMITED) + varint(length)


def varint(value: int) -> bytes:
    """A protobuf base-128 varint; a negative value as its 64-bit two's complement, as
    protobuf writes int64."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# -- receiving ------------------------------------------------------------------------------
def read_chunks(
    messages: Iterator[bytes], chunk_type: type[Message], where: str
) -> tuple[Any, Iterator[memoryview]]:
    """The header of a stream of serialized `chunk_type` messages and an iterator over all
    its data; WireError if a message does not decode, the stream is empty, the first message
    has no header or a later one has."""
    name = chunk_type.DESCRIPTOR.full_name
    first = next(messages, None)
    if first is None:
        raise WireError(f"{where}: the stream is empty; expected a {name} with a header")
    head, data = _split(first, name, f"{where} message 0")
    if head is None:
        raise WireError(f"{where}: the first message has no header")
    header_type = _header_type(chunk_type)
    try:
        header = header_type.FromString(head.tobytes())
    except DecodeError as exc:
        raise WireError(f"{where}: the header does not decode as {name}: {exc}") from None
    return header, _data(data, messages, name, where)


def _header_type(chunk_type: type[Message]) -> type[Message]:
    descriptor: Any = chunk_type.DESCRIPTOR.fields_by_number[HEADER_FIELD].message_type
    return message_factory.GetMessageClass(descriptor)


def _data(first: memoryview, rest: Iterator[bytes], name: str, where: str) -> Iterator[memoryview]:
    yield first
    for i, raw in enumerate(rest, 1):
        head, data = _split(raw, name, f"{where} message {i}")
        if head is not None:
            raise WireError(f"{where}: message {i} repeats the header")
        yield data


def _split(raw: bytes, name: str, where: str) -> tuple[memoryview | None, memoryview]:
    """The header and data fields of one serialized chunk message (other fields skipped)."""
    view = memoryview(raw)
    found: dict[int, memoryview] = {}
    pos = 0
    try:
        while pos < len(view):
            key, pos = _read_varint(view, pos)
            number, wire = key >> 3, key & 7
            if (number in (HEADER_FIELD, DATA_FIELD) and wire != _LENGTH_DELIMITED) or number == 0:
                raise ValueError(f"field {number} has wire type {wire}")
            if wire == _VARINT:
                pos = _read_varint(view, pos)[1]
            elif wire in (_FIXED64, _FIXED32):
                pos += 8 if wire == _FIXED64 else 4
            elif wire == _LENGTH_DELIMITED:
                length, pos = _read_varint(view, pos)
                found[number] = view[pos : pos + length]
                pos += length
            else:
                raise ValueError(f"field {number} has unknown wire type {wire}")
            if pos > len(view):
                raise ValueError("truncated message")
    except ValueError as exc:
        raise WireError(f"{where}: does not decode as {name}: {exc}") from None
    return found.get(HEADER_FIELD), found.get(DATA_FIELD, view[:0])


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def receive_bytes(size: int, parts: Iterable[Any], where: str) -> np.ndarray[Any, Any]:
    """Exactly `size` bytes gathered into one preallocated uint8 buffer."""
    buffer = fresh_bytes(size)
    filled = 0
    for part in parts:
        end = filled + len(part)
        if end > size:
            raise WireError(f"{where}: received more than the {size} bytes declared")
        buffer[filled:end] = np.frombuffer(part, dtype=np.uint8)
        filled = end
    if filled != size:
        raise WireError(f"{where}: the stream ended after {filled} of {size} declared bytes")
    return buffer


def receive_joined(size: int, parts: Iterable[Any], where: str) -> bytes:
    """Exactly `size` bytes as one bytes object, copied once, straight from the messages."""
    held = []
    filled = 0
    for part in parts:
        filled += len(part)
        if filled > size:
            raise WireError(f"{where}: received more than the {size} bytes declared")
        held.append(part)
    if filled != size:
        raise WireError(f"{where}: the stream ended after {filled} of {size} declared bytes")
    return b"".join(held)


def receive_tensor(ttype: TensorType, parts: Iterable[Any], where: str) -> np.ndarray[Any, Any]:
    """A tensor of the (already validated) type `ttype` from its streamed bytes."""
    return codec.from_buffer(ttype, receive_bytes(ttype.nbytes, parts, where), where)


def read_tensors(
    messages: Iterator[bytes], chunk_type: type[Message], count: int, where: str
) -> list[np.ndarray[Any, Any]]:
    """`count` tensors from one stream of `chunk_type` messages (header: a TensorType), each
    tensor's first message carrying its type; WireError if the stream says otherwise."""
    name = chunk_type.DESCRIPTOR.full_name
    header_type = _header_type(chunk_type)
    arrays: list[np.ndarray[Any, Any]] = []
    ttype: TensorType | None = None
    msg: Any = None
    buffer = np.empty(0, dtype=np.uint8)
    filled = 0
    for i, raw in enumerate(messages):
        head, data = _split(raw, name, f"{where} message {i}")
        if head is not None:
            if ttype is not None:
                arrays.append(_finished(msg, ttype, buffer, filled, f"{where} value {len(arrays)}"))
            if len(arrays) == count:
                raise WireError(f"{where}: more than the {count} values asked for")
            try:
                msg = header_type.FromString(head.tobytes())
            except DecodeError as exc:
                raise WireError(f"{where}: a header does not decode as {name}: {exc}") from None
            ttype = codec.decode_type(msg, f"{where} value {len(arrays)}")
            buffer, filled = fresh_bytes(ttype.nbytes), 0
        elif ttype is None:
            raise WireError(f"{where}: the first message has no header")
        end = filled + len(data)
        if end > len(buffer):
            raise WireError(
                f"{where} value {len(arrays)}: more than the {len(buffer)} bytes declared"
            )
        buffer[filled:end] = np.frombuffer(data, dtype=np.uint8)
        filled = end
    if ttype is not None:
        arrays.append(_finished(msg, ttype, buffer, filled, f"{where} value {len(arrays)}"))
    if len(arrays) != count:
        raise WireError(f"{where}: the stream ended after {len(arrays)} of {count} values")
    return arrays


def _finished(
    msg: Any, ttype: TensorType, buffer: np.ndarray[Any, Any], filled: int, where: str
) -> Any:
    if filled != len(buffer):
        raise WireError(f"{where}: the stream ended after {filled} of {len(buffer)} bytes")
    return codec.finish(msg, codec.from_buffer(ttype, buffer, where), where)
