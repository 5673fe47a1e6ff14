"""The data model: dtypes, tensor types, attrs, PFunctions and program graphs.

Pure data with protobuf serialization; knows nothing of JAX tracing, parties' runtimes or gRPC.
"""

from mpplug.core.attrs import Attrs
from mpplug.core.dtypes import DType
from mpplug.core.pfunction import PFunction
from mpplug.core.types import TensorType

__all__ = ["Attrs", "DType", "PFunction", "TensorType"]
