"""The data model: dtypes, tensor and table types, attrs, PFunctions and program graphs.

Pure data with protobuf serialization; knows nothing of JAX tracing, parties' runtimes or gRPC.
"""

from mpplug.core.attrs import Attrs
from mpplug.core.dtypes import DType
from mpplug.core.pfunction import PFunction
from mpplug.core.types import TableType, TensorType, ValueType

__all__ = ["Attrs", "DType", "PFunction", "TableType", "TensorType", "ValueType"]
