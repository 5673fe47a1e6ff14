"""PFunction: a frozen record with canonical protobuf bytes, a sha256 digest and value equality.

Also pins down the error types the issue names and how malformed records and bytes are refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import pytest

import mpplug as mp
from mpplug import (
    ArgumentMismatchError,
    Attrs,
    DType,
    InvalidPFunctionError,
    MPPlugError,
    PFunction,
    TensorType,
    UnknownKernelError,
)
from mpplug.kernels import KernelRuntime, invoke
from mpplug.protos import values_pb2 as pb

F32 = TensorType("f32", (2, 3))
I64 = TensorType("i64", ())


def make(**changes: object) -> PFunction:
    fields: dict[str, object] = {
        "fn_type": "test.kind",
        "fn_name": "f",
        "fn_body": b"\x00body\xff",
        "ins_info": (F32, I64),
        "outs_info": (F32,),
        "attrs": {"n": 3, "name": "x", "flag": True, "scale": 0.5, "raw": b"\x01", "t": (1, "a")},
    }
    fields.update(changes)
    return PFunction(**fields)  # type: ignore[arg-type]


def test_fields_are_kept_and_normalized():
    pf = make(fn_body=bytearray(b"abc"), ins_info=[F32], attrs={"xs": [1, [2, 3]]})
    assert pf.fn_type == "test.kind"
    assert pf.fn_name == "f"
    assert pf.fn_body == b"abc" and type(pf.fn_body) is bytes
    assert pf.ins_info == (F32,) and pf.outs_info == (F32,)
    assert isinstance(pf.attrs, Attrs)
    assert pf.attrs["xs"] == (1, (2, 3))


def test_record_is_frozen_and_attrs_are_immutable():
    pf = make()
    for field in ("fn_type", "fn_name", "fn_body", "ins_info", "outs_info", "attrs"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(pf, field, None)
    with pytest.raises(TypeError):
        pf.attrs["n"] = 4  # type: ignore[index]
    source = {"n": [1, 2]}
    pf = make(attrs=source)
    source["n"].append(3)
    assert pf.attrs["n"] == (1, 2)


def test_byte_round_trip_gives_an_equal_record_with_the_same_digest():
    pf = make()
    data = pf.to_bytes()
    back = PFunction.from_bytes(data)
    assert back == pf
    assert back.digest == pf.digest
    assert back.to_bytes() == data
    assert dict(back.attrs) == dict(pf.attrs)
    assert type(back.attrs["flag"]) is bool and type(back.attrs["n"]) is int


def test_digest_is_the_sha256_of_the_canonical_bytes():
    pf = make()
    assert pf.digest == hashlib.sha256(pf.to_bytes()).hexdigest()
    assert len(pf.digest) == 64


@pytest.mark.parametrize(
    "value",
    [
        True,
        False,
        0,
        -7,
        2**63 - 1,
        -(2**63),
        0.25,
        -1e300,
        math.inf,
        "",
        "héllo ✓",
        b"",
        bytes(range(256)),
        (),
        (1, 2.5, "s", b"b", True, (3, ("deep",))),
    ],
    ids=repr,
)
def test_every_attr_kind_round_trips_exactly(value: object):
    pf = make(attrs={"v": value})
    back = PFunction.from_bytes(pf.to_bytes())
    assert back.attrs["v"] == value
    assert type(back.attrs["v"]) is type(value)
    assert back == pf and back.digest == pf.digest


def test_equal_records_are_equal_and_hash_equal():
    a, b = make(), make()
    assert a is not b
    assert a == b and hash(a) == hash(b) and a.digest == b.digest
    assert len({a, b}) == 1


def test_attr_order_does_not_change_bytes():
    a = make(attrs={"a": 1, "b": 2, "c": 3})
    b = make(attrs={"c": 3, "a": 1, "b": 2})
    assert a.to_bytes() == b.to_bytes() and a == b


@pytest.mark.parametrize(
    "change",
    [
        {"fn_type": "test.other"},
        {"fn_name": "g"},
        {"fn_body": b"\x00body\xfe"},
        {"ins_info": (F32,)},
        {"ins_info": (I64, F32)},
        {"outs_info": (TensorType("f32", (3, 2)),)},
        {"attrs": {}},
        {"attrs": {"n": 4}},
    ],
    ids=lambda c: next(iter(c)),
)
def test_any_field_change_makes_a_different_record(change: dict[str, object]):
    base, other = make(), make(**change)
    assert base != other
    assert base.digest != other.digest
    assert base.to_bytes() != other.to_bytes()


@pytest.mark.parametrize(("left", "right"), [(True, 1), (False, 0), (1, 1.0), (0.0, -0.0)])
def test_equality_agrees_with_hash_for_python_equal_attrs(left: object, right: object):
    # Python says True == 1 and 0.0 == -0.0, but they are different attrs with different
    # bytes; equality must agree with hash and digest.
    a, b = make(attrs={"v": left}), make(attrs={"v": right})
    assert a.digest != b.digest
    assert a != b


def test_a_nan_attr_round_trips_to_an_equal_record():
    pf = make(attrs={"v": math.nan})
    back = PFunction.from_bytes(pf.to_bytes())
    assert back == pf and hash(back) == hash(pf)


def test_records_compare_unequal_to_other_types():
    assert make() != make().to_bytes()
    assert make() != "PFunction"


def test_repr_shows_kernel_name_types_and_digest_prefix():
    text = repr(make())
    assert "test.kind:f(f32[2,3], i64[]) -> (f32[2,3])" in text
    assert "body=6 bytes" in text and make().digest[:12] in text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fn_type": ""}, "expected a non-empty str fn_type, got ''"),
        ({"fn_type": None}, "expected a non-empty str fn_type, got None"),
        ({"fn_body": "text"}, "expected fn_body as bytes, got str"),
        (
            {"ins_info": (F32, "f32[2]")},
            r"ins_info\[1\]: expected TensorType or TableType, got str",
        ),
        (
            {"outs_info": (np.float32,)},
            r"outs_info\[0\]: expected TensorType or TableType, got type",
        ),
        ({"attrs": {"v": None}}, "attr 'v': expected bool, int, float, str, bytes or a tuple"),
        ({"attrs": {"v": {"a": 1}}}, "attr 'v': expected .* got dict"),
        ({"attrs": {"v": (1, None)}}, "attr 'v': expected .* got NoneType"),
        ({"attrs": {"v": 2**63}}, "attr 'v': expected an int in the signed 64-bit range"),
        ({"attrs": {"v": -(2**63) - 1}}, "attr 'v': expected an int in the signed 64-bit"),
        ({"attrs": {1: "a"}}, "attr keys must be str, got int"),
    ],
)
def test_malformed_records_are_refused_with_a_message(change: dict[str, object], message: str):
    with pytest.raises(InvalidPFunctionError, match=message):
        make(**change)


@pytest.mark.parametrize(
    "data", [b"\xff\xff\xff", b"\x0a\x05ab", bytes(range(7, 64))], ids=["ff", "short", "ramp"]
)
def test_bytes_that_do_not_decode_are_refused(data: bytes):
    with pytest.raises(InvalidPFunctionError, match=rf"bytes \({len(data)}\) do not decode"):
        PFunction.from_bytes(data)


def test_non_bytes_are_refused():
    with pytest.raises(InvalidPFunctionError, match="expected PFunction bytes, got str"):
        PFunction.from_bytes("abc")  # type: ignore[arg-type]


def _edited(edit: Callable[[pb.PFunction], object]) -> bytes:
    """`make()`'s bytes after `edit` changed the decoded message."""
    msg = pb.PFunction()
    msg.ParseFromString(make().to_bytes())
    edit(msg)
    return msg.SerializeToString()


def test_decoded_records_are_validated_and_errors_say_where():
    def bad_dtype(msg: pb.PFunction) -> None:
        msg.ins_info[1].dtype = pb.DType.DTYPE_UNSPECIFIED

    def negative_dim(msg: pb.PFunction) -> None:
        msg.outs_info[0].shape[1] = -3

    def clear_fn_type(msg: pb.PFunction) -> None:
        msg.fn_type = ""

    with pytest.raises(InvalidPFunctionError, match=r"ins_info\[1\]: expected a DType enum"):
        PFunction.from_bytes(_edited(bad_dtype))
    with pytest.raises(InvalidPFunctionError, match=r"outs_info\[0\]: expected non-negative"):
        PFunction.from_bytes(_edited(negative_dim))
    with pytest.raises(InvalidPFunctionError, match=r"\['zz'\]: attr value has no kind set"):
        PFunction.from_bytes(_edited(lambda msg: msg.attrs.add(key="zz")))
    with pytest.raises(InvalidPFunctionError, match="duplicate attr key 'n'"):
        PFunction.from_bytes(_edited(lambda msg: msg.attrs.add(key="n", value=pb.AttrValue(i=1))))
    with pytest.raises(InvalidPFunctionError, match="non-empty str fn_type"):
        PFunction.from_bytes(_edited(clear_fn_type))


def test_an_exported_pfunction_survives_the_byte_round_trip_and_still_runs():
    def f(x, y):
        return jnp.tanh(x @ y) + 1

    x = np.arange(6, dtype=np.float32).reshape(2, 3) / 10
    y = np.ones((3, 2), np.float32)
    pf, _, _ = mp.jax_export(f, x, y)
    back = PFunction.from_bytes(pf.to_bytes())
    assert back == pf and back.digest == pf.digest
    assert back.fn_body == pf.fn_body and back.attrs == pf.attrs
    (out,) = invoke(back, x, y, runtime=KernelRuntime())
    np.testing.assert_allclose(np.asarray(out), np.tanh(x @ y) + 1, rtol=1e-6)


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (InvalidPFunctionError, ValueError),
        (ArgumentMismatchError, ValueError),
        (UnknownKernelError, LookupError),
    ],
)
def test_errors_derive_from_mpplug_error_and_the_expected_builtin(
    error: type[Exception], builtin: type[Exception]
):
    assert issubclass(error, MPPlugError)
    assert issubclass(error, builtin)
    assert issubclass(MPPlugError, Exception)
    with pytest.raises(builtin):
        raise error("x")


def test_pfunction_and_types_are_public():
    assert mp.PFunction is PFunction and mp.TensorType is TensorType and mp.DType is DType


def test_decoded_types_are_made_once_and_a_bad_one_names_each_place_it_is_met() -> None:
    from mpplug.core import serde
    from mpplug.errors import UnsupportedDTypeError
    from mpplug.protos import values_pb2

    good = values_pb2.TensorType(dtype=values_pb2.FLOAT32, shape=[2, 3])
    first = serde.tensor_type_from_proto(good, "ins_info[0]")
    assert first is serde.tensor_type_from_proto(good, "outs[1]")
    assert first == mp.TensorType(np.float32, (2, 3))
    bad = values_pb2.TensorType(dtype=values_pb2.FLOAT32, shape=[4, -1])
    for where in ("ins_info[0]", "ops[7].outs[2]"):
        with pytest.raises(ValueError, match=rf"^{re.escape(where)}: expected non-negative"):
            serde.tensor_type_from_proto(bad, where)
    unknown = values_pb2.TensorType(dtype=99, shape=[1])
    with pytest.raises(UnsupportedDTypeError, match=r"^outs\[0\]: expected a DType enum"):
        serde.tensor_type_from_proto(unknown, "outs[0]")
