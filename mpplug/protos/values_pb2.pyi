from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    BOOL: _ClassVar[DType]
    INT8: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    UINT16: _ClassVar[DType]
    UINT32: _ClassVar[DType]
    UINT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    COMPLEX64: _ClassVar[DType]
    COMPLEX128: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
BOOL: DType
INT8: DType
INT16: DType
INT32: DType
INT64: DType
UINT8: DType
UINT16: DType
UINT32: DType
UINT64: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT32: DType
FLOAT64: DType
COMPLEX64: DType
COMPLEX128: DType

class TensorType(_message.Message):
    __slots__ = ("dtype", "shape", "table")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    table: TableSchema
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., table: _Optional[_Union[TableSchema, _Mapping]] = ...) -> None: ...

class TableColumn(_message.Message):
    __slots__ = ("name", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class TableSchema(_message.Message):
    __slots__ = ("columns", "rows")
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    columns: _containers.RepeatedCompositeFieldContainer[TableColumn]
    rows: int
    def __init__(self, columns: _Optional[_Iterable[_Union[TableColumn, _Mapping]]] = ..., rows: _Optional[int] = ...) -> None: ...

class AttrList(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[AttrValue]
    def __init__(self, items: _Optional[_Iterable[_Union[AttrValue, _Mapping]]] = ...) -> None: ...

class AttrValue(_message.Message):
    __slots__ = ("b", "i", "f", "s", "raw", "list")
    B_FIELD_NUMBER: _ClassVar[int]
    I_FIELD_NUMBER: _ClassVar[int]
    F_FIELD_NUMBER: _ClassVar[int]
    S_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    b: bool
    i: int
    f: float
    s: str
    raw: bytes
    list: AttrList
    def __init__(self, b: _Optional[bool] = ..., i: _Optional[int] = ..., f: _Optional[float] = ..., s: _Optional[str] = ..., raw: _Optional[bytes] = ..., list: _Optional[_Union[AttrList, _Mapping]] = ...) -> None: ...

class Attr(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: AttrValue
    def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[AttrValue, _Mapping]] = ...) -> None: ...

class PFunction(_message.Message):
    __slots__ = ("fn_type", "fn_name", "fn_body", "ins_info", "outs_info", "attrs")
    FN_TYPE_FIELD_NUMBER: _ClassVar[int]
    FN_NAME_FIELD_NUMBER: _ClassVar[int]
    FN_BODY_FIELD_NUMBER: _ClassVar[int]
    INS_INFO_FIELD_NUMBER: _ClassVar[int]
    OUTS_INFO_FIELD_NUMBER: _ClassVar[int]
    ATTRS_FIELD_NUMBER: _ClassVar[int]
    fn_type: str
    fn_name: str
    fn_body: bytes
    ins_info: _containers.RepeatedCompositeFieldContainer[TensorType]
    outs_info: _containers.RepeatedCompositeFieldContainer[TensorType]
    attrs: _containers.RepeatedCompositeFieldContainer[Attr]
    def __init__(self, fn_type: _Optional[str] = ..., fn_name: _Optional[str] = ..., fn_body: _Optional[bytes] = ..., ins_info: _Optional[_Iterable[_Union[TensorType, _Mapping]]] = ..., outs_info: _Optional[_Iterable[_Union[TensorType, _Mapping]]] = ..., attrs: _Optional[_Iterable[_Union[Attr, _Mapping]]] = ...) -> None: ...

class ValueRef(_message.Message):
    __slots__ = ("op", "index")
    OP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    op: int
    index: int
    def __init__(self, op: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("dst", "src")
    DST_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    dst: int
    src: int
    def __init__(self, dst: _Optional[int] = ..., src: _Optional[int] = ...) -> None: ...

class PartyList(_message.Message):
    __slots__ = ("parties",)
    PARTIES_FIELD_NUMBER: _ClassVar[int]
    parties: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, parties: _Optional[_Iterable[int]] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("ops", "outputs")
    OPS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[Op]
    outputs: _containers.RepeatedCompositeFieldContainer[ValueRef]
    def __init__(self, ops: _Optional[_Iterable[_Union[Op, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[ValueRef, _Mapping]]] = ...) -> None: ...

class Op(_message.Message):
    __slots__ = ("id", "kind", "parties", "inputs", "outs", "function", "routes", "input_index", "regions", "out_parties")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Op.Kind]
        INPUT: _ClassVar[Op.Kind]
        CALL: _ClassVar[Op.Kind]
        SHUFFLE: _ClassVar[Op.Kind]
        COND: _ClassVar[Op.Kind]
        WHILE: _ClassVar[Op.Kind]
    KIND_UNSPECIFIED: Op.Kind
    INPUT: Op.Kind
    CALL: Op.Kind
    SHUFFLE: Op.Kind
    COND: Op.Kind
    WHILE: Op.Kind
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARTIES_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTS_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    OUT_PARTIES_FIELD_NUMBER: _ClassVar[int]
    id: int
    kind: Op.Kind
    parties: _containers.RepeatedScalarFieldContainer[int]
    inputs: _containers.RepeatedCompositeFieldContainer[ValueRef]
    outs: _containers.RepeatedCompositeFieldContainer[TensorType]
    function: int
    routes: _containers.RepeatedCompositeFieldContainer[Route]
    input_index: int
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    out_parties: _containers.RepeatedCompositeFieldContainer[PartyList]
    def __init__(self, id: _Optional[int] = ..., kind: _Optional[_Union[Op.Kind, str]] = ..., parties: _Optional[_Iterable[int]] = ..., inputs: _Optional[_Iterable[_Union[ValueRef, _Mapping]]] = ..., outs: _Optional[_Iterable[_Union[TensorType, _Mapping]]] = ..., function: _Optional[int] = ..., routes: _Optional[_Iterable[_Union[Route, _Mapping]]] = ..., input_index: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., out_parties: _Optional[_Iterable[_Union[PartyList, _Mapping]]] = ...) -> None: ...

class Graph(_message.Message):
    __slots__ = ("version", "name", "world_size", "functions", "ops", "outputs")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    name: str
    world_size: int
    functions: _containers.RepeatedCompositeFieldContainer[PFunction]
    ops: _containers.RepeatedCompositeFieldContainer[Op]
    outputs: _containers.RepeatedCompositeFieldContainer[ValueRef]
    def __init__(self, version: _Optional[int] = ..., name: _Optional[str] = ..., world_size: _Optional[int] = ..., functions: _Optional[_Iterable[_Union[PFunction, _Mapping]]] = ..., ops: _Optional[_Iterable[_Union[Op, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[ValueRef, _Mapping]]] = ...) -> None: ...
