from mpplug.protos import values_pb2 as _values_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("session", "parties", "wire_version")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PARTIES_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    parties: _containers.RepeatedScalarFieldContainer[str]
    wire_version: int
    def __init__(self, session: _Optional[str] = ..., parties: _Optional[_Iterable[str]] = ..., wire_version: _Optional[int] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("party", "rank", "idle_timeout", "kernels", "wire_version")
    PARTY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    party: str
    rank: int
    idle_timeout: float
    kernels: _containers.RepeatedScalarFieldContainer[str]
    wire_version: int
    def __init__(self, party: _Optional[str] = ..., rank: _Optional[int] = ..., idle_timeout: _Optional[float] = ..., kernels: _Optional[_Iterable[str]] = ..., wire_version: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class KeepAliveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("values_dropped",)
    VALUES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    values_dropped: int
    def __init__(self, values_dropped: _Optional[int] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("session", "name", "type")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    session: str
    name: str
    type: _values_pb2.TensorType
    def __init__(self, session: _Optional[str] = ..., name: _Optional[str] = ..., type: _Optional[_Union[_values_pb2.TensorType, _Mapping]] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProgramHeader(_message.Message):
    __slots__ = ("session", "digest", "size")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    session: str
    digest: str
    size: int
    def __init__(self, session: _Optional[str] = ..., digest: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class ProgramChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ProgramHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ProgramHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class LoadProgramReply(_message.Message):
    __slots__ = ("digest",)
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    digest: str
    def __init__(self, digest: _Optional[str] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("session", "exec_id", "digest", "inputs", "outputs", "timeout", "release", "profile", "inline_max_bytes")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    INLINE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    session: str
    exec_id: str
    digest: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    timeout: float
    release: _containers.RepeatedScalarFieldContainer[str]
    profile: bool
    inline_max_bytes: int
    def __init__(self, session: _Optional[str] = ..., exec_id: _Optional[str] = ..., digest: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., outputs: _Optional[_Iterable[str]] = ..., timeout: _Optional[float] = ..., release: _Optional[_Iterable[str]] = ..., profile: _Optional[bool] = ..., inline_max_bytes: _Optional[int] = ...) -> None: ...

class ExecuteReply(_message.Message):
    __slots__ = ("completed", "party_error", "comm_timeout", "aborted", "unavailable", "refused", "exec_id", "spans", "values")
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    PARTY_ERROR_FIELD_NUMBER: _ClassVar[int]
    COMM_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    completed: Completed
    party_error: PartyFailure
    comm_timeout: CommTimeout
    aborted: Aborted
    unavailable: Unavailable
    refused: Refused
    exec_id: str
    spans: _containers.RepeatedCompositeFieldContainer[ProfileSpan]
    values: _containers.RepeatedCompositeFieldContainer[InlineValue]
    def __init__(self, completed: _Optional[_Union[Completed, _Mapping]] = ..., party_error: _Optional[_Union[PartyFailure, _Mapping]] = ..., comm_timeout: _Optional[_Union[CommTimeout, _Mapping]] = ..., aborted: _Optional[_Union[Aborted, _Mapping]] = ..., unavailable: _Optional[_Union[Unavailable, _Mapping]] = ..., refused: _Optional[_Union[Refused, _Mapping]] = ..., exec_id: _Optional[str] = ..., spans: _Optional[_Iterable[_Union[ProfileSpan, _Mapping]]] = ..., values: _Optional[_Iterable[_Union[InlineValue, _Mapping]]] = ...) -> None: ...

class ProfileSpan(_message.Message):
    __slots__ = ("name", "category", "start_ns", "duration_ns", "args_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    category: str
    start_ns: int
    duration_ns: int
    args_json: str
    def __init__(self, name: _Optional[str] = ..., category: _Optional[str] = ..., start_ns: _Optional[int] = ..., duration_ns: _Optional[int] = ..., args_json: _Optional[str] = ...) -> None: ...

class InlineValue(_message.Message):
    __slots__ = ("name", "type", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: _values_pb2.TensorType
    data: bytes
    def __init__(self, name: _Optional[str] = ..., type: _Optional[_Union[_values_pb2.TensorType, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Completed(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PartyFailure(_message.Message):
    __slots__ = ("party", "op", "error_type", "message")
    PARTY_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    party: int
    op: str
    error_type: str
    message: str
    def __init__(self, party: _Optional[int] = ..., op: _Optional[str] = ..., error_type: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Refused(_message.Message):
    __slots__ = ("code", "message", "missing")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    missing: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., missing: _Optional[str] = ...) -> None: ...

class CommTimeout(_message.Message):
    __slots__ = ("party", "peer", "key", "timeout")
    PARTY_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    party: int
    peer: int
    key: str
    timeout: float
    def __init__(self, party: _Optional[int] = ..., peer: _Optional[int] = ..., key: _Optional[str] = ..., timeout: _Optional[float] = ...) -> None: ...

class Aborted(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class Unavailable(_message.Message):
    __slots__ = ("party", "detail")
    PARTY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    party: str
    detail: str
    def __init__(self, party: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("session", "exec_id", "reason")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session: str
    exec_id: str
    reason: str
    def __init__(self, session: _Optional[str] = ..., exec_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("session", "name", "release")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    session: str
    name: str
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[str] = ..., name: _Optional[str] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchManyRequest(_message.Message):
    __slots__ = ("session", "names", "release")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    session: str
    names: _containers.RepeatedScalarFieldContainer[str]
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("type", "data")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    type: _values_pb2.TensorType
    data: bytes
    def __init__(self, type: _Optional[_Union[_values_pb2.TensorType, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session", "names")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    session: str
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("party", "rank", "world_size", "sessions", "uptime_s", "datasets", "executions")
    PARTY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    EXECUTIONS_FIELD_NUMBER: _ClassVar[int]
    party: str
    rank: int
    world_size: int
    sessions: int
    uptime_s: float
    datasets: _containers.RepeatedCompositeFieldContainer[Dataset]
    executions: int
    def __init__(self, party: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., sessions: _Optional[int] = ..., uptime_s: _Optional[float] = ..., datasets: _Optional[_Iterable[_Union[Dataset, _Mapping]]] = ..., executions: _Optional[int] = ...) -> None: ...

class Dataset(_message.Message):
    __slots__ = ("name", "type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: _values_pb2.TensorType
    def __init__(self, name: _Optional[str] = ..., type: _Optional[_Union[_values_pb2.TensorType, _Mapping]] = ...) -> None: ...

class DatasetInfoRequest(_message.Message):
    __slots__ = ("session", "name")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    session: str
    name: str
    def __init__(self, session: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class DatasetInfoReply(_message.Message):
    __slots__ = ("type",)
    TYPE_FIELD_NUMBER: _ClassVar[int]
    type: _values_pb2.TensorType
    def __init__(self, type: _Optional[_Union[_values_pb2.TensorType, _Mapping]] = ...) -> None: ...

class PeerHeader(_message.Message):
    __slots__ = ("exec_id", "op", "src", "dst", "type", "scope")
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    exec_id: str
    op: int
    src: int
    dst: int
    type: _values_pb2.TensorType
    scope: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, exec_id: _Optional[str] = ..., op: _Optional[int] = ..., src: _Optional[int] = ..., dst: _Optional[int] = ..., type: _Optional[_Union[_values_pb2.TensorType, _Mapping]] = ..., scope: _Optional[_Iterable[int]] = ...) -> None: ...

class PeerChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PeerHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PeerHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SendReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
