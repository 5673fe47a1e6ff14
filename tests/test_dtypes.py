"""DType and TensorType: the closed set of element types, their conversions and their names.

Pins down numpy/JAX/protobuf round trips, the clear refusal of everything else, and `f32[2,3]`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mpplug import DType, MPPlugError, TensorType
from mpplug.errors import UnsupportedDTypeError
from mpplug.protos import values_pb2 as pb

ALL = list(DType)
NUMPY_NAMES = {
    DType.BOOL: "bool",
    DType.INT8: "int8",
    DType.INT16: "int16",
    DType.INT32: "int32",
    DType.INT64: "int64",
    DType.UINT8: "uint8",
    DType.UINT16: "uint16",
    DType.UINT32: "uint32",
    DType.UINT64: "uint64",
    DType.FLOAT16: "float16",
    DType.BFLOAT16: "bfloat16",
    DType.FLOAT32: "float32",
    DType.FLOAT64: "float64",
    DType.COMPLEX64: "complex64",
    DType.COMPLEX128: "complex128",
}


def test_the_supported_set_is_exactly_the_fifteen_issue_types():
    assert {d.numpy.name for d in ALL} == set(NUMPY_NAMES.values())
    assert len(ALL) == 15


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_numpy_dtype_round_trips(dtype: DType):
    assert dtype.numpy.name == NUMPY_NAMES[dtype]
    assert DType.from_any(dtype.numpy) is dtype
    assert DType.from_any(np.zeros((2,), dtype.numpy).dtype) is dtype
    assert DType.from_any(dtype.numpy.type) is dtype  # the scalar type, e.g. np.float32


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_jax_dtype_round_trips(dtype: DType):
    assert DType.from_any(jnp.dtype(dtype.numpy)) is dtype
    assert DType.from_any(jax.ShapeDtypeStruct((2,), dtype.numpy).dtype) is dtype


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_names_and_short_names_convert(dtype: DType):
    assert DType.from_any(NUMPY_NAMES[dtype]) is dtype
    assert DType.from_any(dtype.value) is dtype
    assert DType.from_any(dtype) is dtype
    assert str(dtype) == dtype.value


def test_jax_scalar_types_and_arrays_convert():
    assert DType.from_any(jnp.bfloat16) is DType.BFLOAT16
    assert DType.from_any(jnp.float32) is DType.FLOAT32
    assert DType.from_any(jnp.zeros((2,), jnp.bfloat16).dtype) is DType.BFLOAT16
    assert DType.from_any(jnp.zeros((2,), jnp.int8).dtype) is DType.INT8
    assert DType.from_any(ml_dtypes.bfloat16) is DType.BFLOAT16


def test_python_scalar_types_map_to_64_bit_numpy_defaults():
    assert DType.from_any(bool) is DType.BOOL
    assert DType.from_any(int) is DType.INT64
    assert DType.from_any(float) is DType.FLOAT64
    assert DType.from_any(complex) is DType.COMPLEX128


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_proto_numbers_match_the_proto_enum(dtype: DType):
    assert dtype.proto == pb.DType.Value(dtype.name)
    assert DType.from_proto(dtype.proto) is dtype


@pytest.mark.parametrize("number", [0, -1, 16, 1000])
def test_unknown_proto_numbers_are_refused(number: int):
    with pytest.raises(UnsupportedDTypeError, match=rf"DType enum number in 1\.\.15, got {number}"):
        DType.from_proto(number)


@pytest.mark.parametrize(
    "bad",
    [
        np.dtype(object),
        np.dtype("U3"),
        np.dtype("S3"),
        np.dtype([("a", "<i4"), ("b", "<f4")]),
        np.dtype("datetime64[s]"),
        np.dtype(np.longdouble) if np.dtype(np.longdouble).itemsize > 8 else np.dtype("V8"),
        np.dtype(">f4"),
        np.dtype(">i8"),
        str,
        object,
    ],
    ids=lambda d: str(d),
)
def test_unsupported_numpy_dtypes_are_refused_with_the_supported_list(bad: object):
    with pytest.raises(UnsupportedDTypeError) as info:
        DType.from_any(bad)
    message = str(info.value)
    assert message.startswith("expected one of bool, int8")
    assert "bfloat16" in message and "complex128" in message
    assert "got dtype" in message


@pytest.mark.parametrize("bad", [None, "no_such_type", 3.5, [("a", "i4"), ("a", "i4")]])
def test_things_that_are_not_dtypes_are_refused(bad: object):
    with pytest.raises(UnsupportedDTypeError, match="expected a supported dtype, got"):
        DType.from_any(bad)


def test_unsupported_dtype_error_is_an_mpplug_error_and_a_type_error():
    with pytest.raises(MPPlugError):
        DType.from_any(object)
    with pytest.raises(TypeError):
        DType.from_any(object)


def test_itemsize_and_64_bit_flags():
    assert [d.itemsize for d in ALL] == [1, 1, 2, 4, 8, 1, 2, 4, 8, 2, 2, 4, 8, 8, 16]
    assert {d for d in ALL if d.is_64bit} == {
        DType.INT64,
        DType.UINT64,
        DType.FLOAT64,
        DType.COMPLEX128,
    }


def test_numpy_dtypes_are_little_endian():
    assert all(d.numpy == d.numpy.newbyteorder("<") for d in ALL)


# ---------------------------------------------------------------- TensorType


def test_tensor_type_prints_compactly():
    assert str(TensorType("float32", (2, 3))) == "f32[2,3]"
    assert str(TensorType(np.int64, ())) == "i64[]"
    assert str(TensorType(jnp.bfloat16, [0, 5])) == "bf16[0,5]"
    assert str(TensorType(DType.BOOL, (1, 2, 3, 4))) == "bool[1,2,3,4]"
    assert repr(TensorType("c128", (7,))) == "TensorType(c128[7])"


def test_tensor_type_normalizes_its_fields():
    t = TensorType(np.dtype("float32"), [np.int64(2), 3])
    assert t.dtype is DType.FLOAT32
    assert t.shape == (2, 3)
    assert all(type(d) is int for d in t.shape)


def test_tensor_type_is_frozen():
    t = TensorType("f32", (2,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.shape = (3,)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.dtype = DType.INT8  # type: ignore[misc]


def test_tensor_types_compare_and_hash_by_value():
    a = TensorType("float32", (2, 3))
    b = TensorType(np.float32, [2, 3])
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a != TensorType("float32", (3, 2))
    assert a != TensorType("float64", (2, 3))


def test_tensor_type_of_array_likes_and_scalars():
    assert TensorType.of(np.zeros((2, 3), np.int16)) == TensorType("i16", (2, 3))
    assert TensorType.of(jnp.zeros((4,), jnp.bfloat16)) == TensorType("bf16", (4,))
    assert TensorType.of(jax.ShapeDtypeStruct((5, 1), np.uint64)) == TensorType("u64", (5, 1))
    assert TensorType.of(np.float32(1.0)) == TensorType("f32", ())
    assert TensorType.of(1.5) == TensorType("f64", ())
    assert TensorType.of(True) == TensorType("bool", ())
    t = TensorType("f32", (1,))
    assert TensorType.of(t) is t


def test_tensor_type_sizes():
    t = TensorType("c64", (2, 3, 4))
    assert (t.ndim, t.size, t.nbytes) == (3, 24, 24 * 8)
    assert TensorType("f32", ()).size == 1
    assert TensorType("f32", (0, 9)).nbytes == 0


def test_tensor_type_refuses_negative_dimensions_and_unsupported_dtypes():
    with pytest.raises(ValueError, match=r"non-negative dimensions, got shape \(2, -1\)"):
        TensorType("f32", (2, -1))
    with pytest.raises(UnsupportedDTypeError, match="got dtype <U3"):
        TensorType(np.dtype("U3"), (2,))
    with pytest.raises(UnsupportedDTypeError, match=r"with \.shape and \.dtype, got str"):
        TensorType.of("not an array")
